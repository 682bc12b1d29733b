"""Where a request goes: the router policies of a cluster (:mod:`fragsim.cluster`).

``round-robin``
    Request ``i`` of the trace goes to instance ``i mod n``. It reads no state, so the
    whole trace is routed before the run and every instance replays its share at
    full speed (:meth:`RequestTable.route_all <fragsim.request_table.RequestTable.route_all>`).
``random``
    Request ``i`` goes to an instance drawn uniformly from a hash of ``i`` (the same
    draw every run): the random baseline of the Mooncake paper's scheduling experiment.
    Like round-robin it reads no state and routes the whole trace before the run.
``least-loaded``
    vLLM's data-parallel score, ``4 × waiting + running``, lowest wins (ties: the
    lowest index). Waiting counts the requests routed there that its engine has not
    pulled yet.
``session``
    Consistent hashing on the request's session id (the trace's ``session`` field):
    every turn of a conversation goes where its first went, whatever the load. It
    reads no state, so it routes the whole trace before the run.
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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fragsim.cluster.view import EventIndex, LoadView, RoutedIndex
from fragsim.connector import parts

if TYPE_CHECKING:
    from fragsim.engine import Engine

ROUTERS = ("round-robin", "random", "least-loaded", "session", "prefix-aware")


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


class Random(_NoEstimate):
    name = "random"
    static = True

    def assign(self, num_requests: int, num_instances: int) -> np.ndarray:
        return self._draw(np.arange(num_requests, dtype=np.uint64), num_instances)

    def pick(self, req: int, engines: Sequence[Engine]) -> int:
        return int(self._draw(np.array([req], dtype=np.uint64), len(engines))[0])

    @staticmethod
    def _draw(reqs: np.ndarray, n: int) -> np.ndarray:
        return (_mix(reqs + np.uint64(0x5EED)) % np.uint64(n)).astype(np.int64)

    def routed(self, req: int, instance: int, engines: Sequence[Engine]) -> None:
        pass


class SessionAffinity(_NoEstimate):
    """Consistent hashing on the request's session id: a ring of 64 points per instance,
    each session at the first point past its own hash, so that a session keeps its
    instance, and adding an instance moves only the sessions it takes."""

    name = "session"
    static = True
    POINTS = 64

    def __init__(self, session: np.ndarray | None) -> None:
        if session is None:
            raise ValueError("the session router needs a session id per request (a trace "
                             "field session, session_id, conversation_id or chat_id); this trace has none")
        self.session = np.asarray(session, dtype=np.uint64)
        self._rings: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _ring(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if n not in self._rings:
            owner = np.repeat(np.arange(n), self.POINTS)
            point = _mix(owner.astype(np.uint64) * np.uint64(1 << 20) + np.tile(
                np.arange(self.POINTS, dtype=np.uint64), n))
            order = np.argsort(point, kind="stable")
            self._rings[n] = point[order], owner[order]
        return self._rings[n]

    def assign(self, num_requests: int, num_instances: int) -> np.ndarray:
        points, owners = self._ring(num_instances)
        at = np.searchsorted(points, _mix(self.session[:num_requests] + np.uint64(0x9E3779B9)))
        return owners[at % len(points)]

    def pick(self, req: int, engines: Sequence[Engine]) -> int:
        points, owners = self._ring(len(engines))
        at = int(np.searchsorted(points, _mix(self.session[req: req + 1] + np.uint64(0x9E3779B9)))[0])
        return int(owners[at % len(points)])

    def routed(self, req: int, instance: int, engines: Sequence[Engine]) -> None:
        pass


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a well-spread 64-bit hash of each value."""
    with np.errstate(over="ignore"):
        x = np.asarray(x, dtype=np.uint64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class LeastLoaded(_NoEstimate):
    name = "least-loaded"
    static = False

    def __init__(self, options: RouterOptions) -> None:
        self.view = LoadView(options.snapshot_s)

    def pick(self, req: int, engines: Sequence[Engine]) -> int:
        return int(np.argmin([4 * waiting + running for waiting, running, _ in self.view(engines)]))

    def routed(self, req: int, instance: int, engines: Sequence[Engine]) -> None:
        pass


class PrefixAware:
    name = "prefix-aware"
    static = False

    def __init__(self, keys: Any, prompt: np.ndarray, engines: Sequence[Engine], options: RouterOptions) -> None:
        if keys is None:
            raise ValueError("the prefix-aware router scores prefix blocks: it needs --prefix-caching")
        self.keys_of, self.prompt, self.weights = keys, prompt, options.weights
        self.tier_weight = 0.8
        self.view = LoadView(options.snapshot_s)
        delay = options.kv_events_delay_s
        self.gpu: list[Any] = [
            RoutedIndex(engine.kv.capacity // max(engine.kv.block_size, 1)) if delay is None
            else _subscribe(engine, EventIndex(delay, lambda e=engine: e.now)) for engine in engines]
        self.tier = [_tier_index(engine) for engine in engines]
        self.estimated_tokens = np.zeros(len(engines), dtype=np.int64)  # the router's expected hits
        self._estimate: dict[int, int] = {}

    def pick(self, req: int, engines: Sequence[Engine]) -> int:
        keys = self.keys_of.keys(req, int(self.prompt[req]))
        block = engines[0].kv.block_size
        usable = max(0, (int(self.prompt[req]) - 1) // block)  # one token is always computed
        now = float(engines[0].env.now) if engines[0].env is not None else 0.0
        hits = []
        for i in range(len(engines)):
            gpu = self.gpu[i].run(keys[:usable], 0, now)
            tier = self.tier[i]
            more = tier.run(keys[:usable], gpu) if tier is not None else 0
            hits.append(gpu + self.tier_weight * more)
        loads = self.view(engines)
        depth = [waiting + running for waiting, running, _ in loads]
        util = [u for _, _, u in loads]
        w_prefix, w_queue, w_kv = self.weights
        share = np.asarray(hits, dtype=np.float64) / max(len(keys), 1)  # the prompt's share found
        score = w_prefix * share - w_queue * _minmax(depth) - w_kv * _minmax(util)
        best = int(np.argmax(score))
        self._estimate[req] = int(round(hits[best] * block))
        return best

    def routed(self, req: int, instance: int, engines: Sequence[Engine]) -> None:
        keys = self.keys_of.keys(req, int(self.prompt[req]))
        self.gpu[instance].routed(keys)
        tier = self.tier[instance]
        if tier is not None:
            tier.routed(keys)
        self.estimated_tokens[instance] += self._estimate.pop(req, 0)

    def expected_hit(self, req: int) -> int:
        return self._estimate.get(req, 0)

    def forget(self, req: int) -> None:
        self._estimate.pop(req, None)

    def summary(self) -> dict[str, Any]:
        return {"router_estimated_hit_tokens": int(self.estimated_tokens.sum())}


def _subscribe(engine: Engine, index: EventIndex) -> EventIndex:
    """The instance's GPU prefix cache publishes its KV events to ``index``."""
    alloc = getattr(engine.kv, "alloc", None)
    if alloc is None or not hasattr(alloc, "kv_events"):
        raise ValueError("KV events come from the paged prefix cache: it needs --allocator vllm (or paged)")
    alloc.kv_events = index.publish
    return index


def _tier_index(engine: Engine) -> RoutedIndex | None:
    """The router's index of an instance's offload tier (None: it has none)."""
    from fragsim.offload.connector import OffloadConnector

    tier = next((c for c in parts(engine.connector) if isinstance(c, OffloadConnector)), None)
    if tier is None:
        return None
    return RoutedIndex(tier.num_chunks * tier.chunk // max(engine.kv.block_size, 1))


@dataclass(frozen=True)
class RouterOptions:
    """How a router scores and what it sees (:mod:`fragsim.cluster.view`)."""

    weights: tuple[float, float, float] = (2.0, 1.0, 1.0)  # prefix-aware: prefix, queue, KV use
    snapshot_s: float = 0.0              # load seen through snapshots this often (0: live)
    kv_events_delay_s: float | None = None  # prefix-aware: the cache through KV events this late
                                            # (None: the router's own index of what it routed)


def make_router(name: str, keys: Any, prompt: np.ndarray, engines: Sequence[Engine],
                session: np.ndarray | None = None, options: RouterOptions | None = None) -> Any:
    options = options or RouterOptions()
    if name == "round-robin":
        return RoundRobin()
    if name == "random":
        return Random()
    if name == "session":
        return SessionAffinity(session)
    if name == "least-loaded":
        return LeastLoaded(options)
    if name == "prefix-aware":
        return PrefixAware(keys, prompt, engines, options)
    raise ValueError(f"unknown router {name!r}; known: {', '.join(ROUTERS)}")
