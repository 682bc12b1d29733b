"""Which cached chunk an offload tier gives up: LRU and ARC, as vLLM 0.33 orders them.

A policy only orders keys; the tier (:class:`fragsim.offload.tier.Tier`) owns which
keys are resident and whether each can be evicted (no read or write in flight).
Both policies follow vLLM 0.33's ``vllm/v1/kv_offload/cpu/policies`` (``lru.py``,
``arc.py``) in what they decide, written here in fragsim's own terms:

**LRU** gives every resident key a rank, a pair compared in order, and evicts the
smallest rank first.

- A request takes one *request rank* from a global counter the first time it
  needs one. Every key it touches while it runs gets ``(request rank,
  -position)``, so within one request the tail precedes the head, and a request
  that is still running ranks by when it started, not by when its blocks finish.
- When the request finishes, its resident keys are re-ranked from tail to head
  with fresh ``(counter, 0)`` ranks, so the head is the most recently used.
- The counter moves on for every request rank and every fresh rank, exactly as
  vLLM's does, so two runs of the same calls rank alike.

**ARC** (Megiddo and Modha) keeps T1 (seen once), T2 (reused), the ghost lists B1
and B2 of keys evicted from them, and a target size for T1:

- A store of a key found in a ghost list moves the target, up for B1 and down
  for B2. This happens once per key and request, before the key is inserted.
- Inserted keys enter T1. At the request's end a key the request reused (read,
  or offered again while ready) moves from T1 to T2 or to T2's most recent end.
  A key it only inserted keeps its list and moves to that list's recent end.
- Eviction takes from T1 while T1 is at or over the target, otherwise from T2,
  and falls back to the other list. Ghost lists are then cut to the capacity.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Protocol

Key = int
Evictable = Callable[[Key], bool]


class Access(Protocol):
    """What a policy reads of one request's access (:class:`fragsim.offload.tier.RequestAccess`)."""

    lru_rank: int | None

    def position(self, key: Key) -> int | None: ...


class Policy(Protocol):
    """How a tier orders its keys for eviction."""

    def insert(self, key: Key, access: Access) -> None: ...
    def remove(self, key: Key) -> None: ...
    def on_access(self, keys: Sequence[Key], resident: Collection[Key], access: Access) -> None: ...
    def on_store_miss(self, keys: Sequence[Key]) -> None: ...
    def on_finish(self, keys: Sequence[Key], inserted_only: set[Key], reused: set[Key],
                  resident: Collection[Key]) -> None: ...
    def evict(self, n: int, protected: Collection[Key], evictable: Evictable) -> list[Key] | None: ...


class LRU:
    """Least recently used by request rank (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._rank: dict[Key, tuple[int, int]] = {}
        self._heap: list[tuple[tuple[int, int], Key]] = []  # stale entries dropped lazily
        self._counter = 0

    def _request_rank(self, access: Access) -> int:
        if access.lru_rank is None:
            self._counter += 1
            access.lru_rank = self._counter
        return access.lru_rank

    def _set(self, key: Key, rank: tuple[int, int]) -> None:
        self._rank[key] = rank
        heapq.heappush(self._heap, (rank, key))

    def insert(self, key: Key, access: Access) -> None:
        position = access.position(key)
        if position is None:
            self._counter += 1
            self._set(key, (self._counter, 0))
        else:
            self._set(key, (self._request_rank(access), -position))

    def remove(self, key: Key) -> None:
        del self._rank[key]

    def on_access(self, keys: Sequence[Key], resident: Collection[Key], access: Access) -> None:
        request = self._request_rank(access)
        for key in keys:
            position = access.position(key)
            if position is None or key not in resident:
                continue
            rank = (request, -position)
            if self._rank[key] < rank:
                self._set(key, rank)
        self._compact()

    def on_store_miss(self, keys: Sequence[Key]) -> None:
        """A missed key is not resident, so it has no rank to refresh."""

    def on_finish(self, keys: Sequence[Key], inserted_only: set[Key], reused: set[Key],
                  resident: Collection[Key]) -> None:
        for key in reversed(keys):
            if key in resident:
                self._counter += 1
                self._set(key, (self._counter, 0))
        self._compact()

    def evict(self, n: int, protected: Collection[Key], evictable: Evictable) -> list[Key] | None:
        if n == 0:
            return []
        chosen: dict[Key, None] = {}  # ordered, and a set
        kept: list[tuple[tuple[int, int], Key]] = []
        heap, ranks = self._heap, self._rank
        while heap and len(chosen) < n:
            entry = heapq.heappop(heap)
            rank, key = entry
            if ranks.get(key) != rank or key in chosen:
                continue  # an older rank of a key re-ranked since, gone, or a twin entry
            if key in protected or not evictable(key):
                kept.append(entry)
                continue
            chosen[key] = None
        for entry in kept:
            heapq.heappush(heap, entry)
        if len(chosen) < n:
            for key in chosen:
                heapq.heappush(heap, (ranks[key], key))
            return None
        for key in chosen:
            del ranks[key]
        self._compact()
        return list(chosen)

    def _compact(self) -> None:
        if len(self._heap) > 2 * len(self._rank) + 64:
            self._heap = [(rank, key) for key, rank in self._rank.items()]
            heapq.heapify(self._heap)


class ARC:
    """Adaptive replacement (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.target_t1 = 0.0
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, access: Access) -> None:
        self.t1[key] = None
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
        else:
            self.t2.pop(key, None)

    def on_access(self, keys: Sequence[Key], resident: Collection[Key], access: Access) -> None:
        """ARC learns from a request's reuse only when the request finishes."""

    def on_store_miss(self, keys: Sequence[Key]) -> None:
        for key in reversed(keys):
            if key in self.b1:
                step = max(1.0, len(self.b2) / len(self.b1))
                self.target_t1 = min(self.target_t1 + step, float(self.capacity))
                self.b1.move_to_end(key)
            elif key in self.b2:
                step = max(1.0, len(self.b1) / len(self.b2))
                self.target_t1 = max(self.target_t1 - step, 0.0)
                self.b2.move_to_end(key)

    def on_finish(self, keys: Sequence[Key], inserted_only: set[Key], reused: set[Key],
                  resident: Collection[Key]) -> None:
        t1, t2 = self.t1, self.t2
        for key in reversed(keys):
            if key in inserted_only:
                if key in t1:
                    t1.move_to_end(key)
                elif key in t2:
                    t2.move_to_end(key)
            elif key in reused:
                if key in t1:
                    del t1[key]
                    t2[key] = None
                elif key in t2:
                    t2.move_to_end(key)

    def evict(self, n: int, protected: Collection[Key], evictable: Evictable) -> list[Key] | None:
        if n == 0:
            return []

        def candidates(keys: Iterable[Key]) -> Iterator[Key]:
            return (k for k in keys if k not in protected and evictable(k))

        # Each list is scanned once from its oldest end; nothing moves until all n are found.
        from_t1, from_t2 = candidates(self.t1), candidates(self.t2)
        chosen: list[tuple[Key, bool]] = []
        t1_size = len(self.t1)
        for _ in range(n):
            key = next(from_t1, None) if t1_size >= int(self.target_t1) else None
            in_t1 = key is not None
            if key is None:
                key = next(from_t2, None)
            if key is None:
                key, in_t1 = next(from_t1, None), True
                if key is None:
                    return None
            if in_t1:
                t1_size -= 1
            chosen.append((key, in_t1))
        for key, in_t1 in chosen:
            if in_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        for ghost in (self.b1, self.b2):
            for _ in range(len(ghost) - self.capacity):
                ghost.popitem(last=False)
        return [key for key, _ in chosen]


POLICIES: dict[str, Callable[[int], Policy]] = {"lru": LRU, "arc": ARC}
