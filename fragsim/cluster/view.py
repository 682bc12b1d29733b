"""What a router sees of the instances, and when.

A router does not read an instance's state as it stands: it reads metrics scraped now
and then, and learns an instance's cache from the KV events the instance publishes,
which arrive late. :class:`LoadView` gives each instance's load (waiting, running, KV
utilisation) as of the last snapshot, taken every ``snapshot_s`` seconds (0: live,
as the instance stands at the routing instant). The prefix-aware router's picture of
each instance's cache is one of:

:class:`RoutedIndex`
    llm-d's approximate scorer: an LRU of the block keys the router itself sent to the
    instance, sized to its GPU blocks. It never hears of an eviction, and it counts a
    block the instance has not computed yet.
:class:`EventIndex`
    llm-d's precise scorer: the keys the instance's GPU prefix cache holds, as its KV
    events (a block stored, a block removed) tell, each applied ``delay_s`` seconds
    after the instance published it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fragsim.engine import Engine


def queue_depth(engine: Engine) -> tuple[int, int]:
    """(waiting, running) of an instance now, waiting counting what was routed there
    and not yet pulled into its queue, and what a prefill instance will hand it."""
    reqs = engine.requests
    unpulled = reqs.num_mine - reqs.num_arrived + reqs.num_expected
    return len(engine.waiting) + len(engine.swapped) + unpulled, engine.num_running()


def kv_utilisation(engine: Engine) -> float:
    kv = engine.kv
    if kv.free_probe is None or not kv.capacity:
        return 0.0
    return 1.0 - kv.free_probe() / kv.capacity


class LoadView:
    """Each instance's (waiting, running, KV utilisation) as the router last saw it."""

    def __init__(self, snapshot_s: float = 0.0) -> None:
        self.snapshot_s = snapshot_s
        self.taken = -float("inf")
        self.loads: list[tuple[int, int, float]] = []

    def __call__(self, engines: Sequence[Engine]) -> list[tuple[int, int, float]]:
        now = float(engines[0].env.now) if engines[0].env is not None else 0.0
        if self.snapshot_s <= 0 or now >= self.taken + self.snapshot_s or len(self.loads) != len(engines):
            self.loads = [(*queue_depth(e), kv_utilisation(e)) for e in engines]
            if self.snapshot_s > 0:  # snapshots on a fixed grid, as a scraper takes them
                self.taken = now - now % self.snapshot_s
        return self.loads


class RoutedIndex:
    """The router's LRU of block keys it sent to one instance (its belief of the cache)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[int, None] = OrderedDict()

    def run(self, keys: Sequence[int], start: int = 0, now: float | None = None) -> int:
        """Leading keys from ``start`` that it holds (``now``: unused; it has no delay)."""
        return _leading(keys, start, self.keys)

    def routed(self, keys: Sequence[int]) -> None:
        held = self.keys
        for key in keys:
            if key in held:
                held.move_to_end(key)
            else:
                held[key] = None
        while len(held) > self.capacity:
            held.popitem(last=False)


class EventIndex:
    """The keys an instance's GPU prefix cache holds, as its delayed KV events tell."""

    def __init__(self, delay_s: float, clock: Any) -> None:
        self.delay_s, self.clock = delay_s, clock
        self.keys: set[int] = set()
        self.pending: deque[tuple[float, bool, list[int]]] = deque()

    def publish(self, stored: bool, keys: list[int]) -> None:
        """The instance stored (or removed) these blocks now, by its own clock."""
        self.pending.append((self.clock() + self.delay_s, stored, list(keys)))

    def _catch_up(self, now: float) -> None:
        pending, held = self.pending, self.keys
        while pending and pending[0][0] <= now:
            _, stored, keys = pending.popleft()
            if stored:
                held.update(keys)
            else:
                held.difference_update(keys)

    def run(self, keys: Sequence[int], start: int = 0, now: float | None = None) -> int:
        if now is not None:
            self._catch_up(now)
        return _leading(keys, start, self.keys)

    def routed(self, keys: Sequence[int]) -> None:
        pass  # it learns from the instance, not from its own routing


def _leading(keys: Sequence[int], start: int, held: Any) -> int:
    """How many of ``keys`` from ``start`` on ``held`` holds, up to the first it lacks."""
    n = 0
    for key in keys[start:]:
        if key not in held:
            break
        n += 1
    return n
