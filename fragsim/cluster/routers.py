"""Where a request goes: the router policies of a cluster (:mod:`fragsim.cluster`).

``round-robin``
    Request ``i`` of the trace goes to instance ``i mod n``. It reads no state, so the
    whole trace is routed before the run and every instance replays its share at
    full speed (:meth:`RequestTable.route_all <fragsim.request_table.RequestTable.route_all>`).
``least-loaded``
    vLLM's data-parallel score, ``4 × waiting + running``, lowest wins (ties: the
    lowest index). Waiting counts the requests routed there that its engine has not
    pulled yet.
``prefix-aware``
    As llm-d's prefix-cache scorer: each instance is scored by the run of the
    request's leading prompt blocks the router believes it holds, as a share of the
    prompt's blocks (0 to 1), combined with its queue depth (``waiting + running``)
    and its KV utilisation, each min-max normalised over the instances, with weights
    ``2 : 1 : 1`` (prefix up, the other two down). A min-max prefix term would make
    one block's difference worth as much as the whole prompt, and send every new
    conversation after its system prompt to one instance. The router's belief is its own index, not the instance's cache: for
    each instance an LRU of the block keys it routed there, sized to the instance's
    GPU blocks (and, with an offload tier, a second one sized to the tier, whose hits
    weigh 0.8). That is how llm-d's approximate scorer works, and why its estimate
    is wrong once blocks leave the GPU in another order, or a tier holds them: the
    run reports the estimate beside the hits the instances really found.

The dynamic routers are asked at each request's arrival, before any instance's step
at that time, and read the instances' state as it stands then (a step in progress
counts as it was decided at its start).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from fragsim.engine import Engine

ROUTERS = ("round-robin", "least-loaded", "prefix-aware")


def queue_depth(engine: Engine) -> tuple[int, int]:
    """(waiting, running) of an instance now, waiting counting what was routed there
    and not yet pulled into its queue."""
    reqs = engine.requests
    unpulled = reqs.num_mine - reqs.num_arrived
    return len(engine.waiting) + len(engine.swapped) + unpulled, engine.num_running()


def kv_utilisation(engine: Engine) -> float:
    kv = engine.kv
    if kv.free_probe is None or not kv.capacity:
        return 0.0
    return 1.0 - kv.free_probe() / kv.capacity


def _minmax(values: Sequence[float]) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    span = arr.max() - arr.min()
    return (arr - arr.min()) / span if span > 0 else np.zeros(len(arr))


class _NoEstimate:
    """A policy that keeps no picture of the instances' caches."""

    def expected_hit(self, req: int) -> int:
        """Prompt tokens the last pick for ``req`` expects cached there."""
        return 0

    def forget(self, req: int) -> None:
        """The pick for ``req`` was not used."""

    def summary(self) -> dict[str, Any]:
        return {}


class RoundRobin(_NoEstimate):
    name = "round-robin"
    static = True

    def __init__(self) -> None:
        self.turn = 0

    def assign(self, num_requests: int, num_instances: int) -> np.ndarray:
        return np.arange(num_requests) % num_instances

    def pick(self, req: int, engines: Sequence[Engine]) -> int:
        return self.turn % len(engines)

    def routed(self, req: int, instance: int, engines: Sequence[Engine]) -> None:
        self.turn += 1


class LeastLoaded(_NoEstimate):
    name = "least-loaded"
    static = False

    def pick(self, req: int, engines: Sequence[Engine]) -> int:
        scores = []
        for engine in engines:
            waiting, running = queue_depth(engine)
            scores.append(4 * waiting + running)
        return int(np.argmin(scores))

    def routed(self, req: int, instance: int, engines: Sequence[Engine]) -> None:
        pass


class _Index:
    """The router's LRU of block keys it sent to one instance (its belief of the cache)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[int, None] = OrderedDict()

    def run(self, keys: Sequence[int], start: int = 0) -> int:
        """Leading keys from ``start`` that it holds."""
        held = self.keys
        n = 0
        for key in keys[start:]:
            if key not in held:
                break
            n += 1
        return n

    def add(self, keys: Sequence[int]) -> None:
        held = self.keys
        for key in keys:
            if key in held:
                held.move_to_end(key)
            else:
                held[key] = None
        while len(held) > self.capacity:
            held.popitem(last=False)


class PrefixAware:
    name = "prefix-aware"
    static = False

    def __init__(self, keys: Any, prompt: np.ndarray, engines: Sequence[Engine],
                 weights: tuple[float, float, float] = (2.0, 1.0, 1.0), tier_weight: float = 0.8) -> None:
        if keys is None:
            raise ValueError("the prefix-aware router scores prefix blocks: it needs --prefix-caching")
        self.keys_of, self.prompt, self.weights, self.tier_weight = keys, prompt, weights, tier_weight
        self.gpu = [_Index(engine.kv.capacity // max(engine.kv.block_size, 1)) for engine in engines]
        self.tier = [_tier_index(engine) for engine in engines]
        self.estimated_tokens = np.zeros(len(engines), dtype=np.int64)  # the router's expected hits
        self._estimate: dict[int, int] = {}

    def pick(self, req: int, engines: Sequence[Engine]) -> int:
        keys = self.keys_of.keys(req, int(self.prompt[req]))
        block = engines[0].kv.block_size
        usable = max(0, (int(self.prompt[req]) - 1) // block)  # one token is always computed
        hits, depth, util = [], [], []
        for i, engine in enumerate(engines):
            gpu = self.gpu[i].run(keys[:usable])
            tier = self.tier[i]
            more = tier.run(keys[:usable], gpu) if tier is not None else 0
            hits.append(gpu + self.tier_weight * more)
            waiting, running = queue_depth(engine)
            depth.append(waiting + running)
            util.append(kv_utilisation(engine))
        w_prefix, w_queue, w_kv = self.weights
        share = np.asarray(hits, dtype=np.float64) / max(len(keys), 1)  # the prompt's share found
        score = w_prefix * share - w_queue * _minmax(depth) - w_kv * _minmax(util)
        best = int(np.argmax(score))
        self._estimate[req] = int(round(hits[best] * block))
        return best

    def routed(self, req: int, instance: int, engines: Sequence[Engine]) -> None:
        keys = self.keys_of.keys(req, int(self.prompt[req]))
        self.gpu[instance].add(keys)
        tier = self.tier[instance]
        if tier is not None:
            tier.add(keys)
        self.estimated_tokens[instance] += self._estimate.pop(req, 0)

    def expected_hit(self, req: int) -> int:
        return self._estimate.get(req, 0)

    def forget(self, req: int) -> None:
        self._estimate.pop(req, None)

    def summary(self) -> dict[str, Any]:
        return {"router_estimated_hit_tokens": int(self.estimated_tokens.sum())}


def _tier_index(engine: Engine) -> _Index | None:
    """The router's index of an instance's offload tier (None: it has none)."""
    from fragsim.offload.connector import OffloadConnector

    tier = engine.connector
    if not isinstance(tier, OffloadConnector):
        return None
    return _Index(tier.num_chunks * tier.chunk // max(engine.kv.block_size, 1))


def make_router(name: str, keys: Any, prompt: np.ndarray, engines: Sequence[Engine]) -> Any:
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "prefix-aware":
        return PrefixAware(keys, prompt, engines)
    raise ValueError(f"unknown router {name!r}; known: {', '.join(ROUTERS)}")
