"""One offload tier: a fixed number of chunk slots, what each holds, and what may leave.

This is vLLM 0.33's ``CPUOffloadingManager`` (``vllm/v1/kv_offload/cpu/manager.py``)
in what it decides, over fragsim's integer chunk keys. The caller (a replay in
request order, or the engine's connector) makes the connector's calls:

=====================  ==========================================================
``lookup(key)``        resident and ready (``HIT``), resident with its write still
                       in flight (``PENDING``), or absent (``MISS``)
``prepare_load``       pins the keys for reading (not evictable until
                       ``complete_load``); the request counts them as reused
``prepare_store``      offers a request's new chunks. Absent keys are stored (new
                       slots, evicting idle ones by the policy, never one of the
                       offered keys); the call fails, storing nothing, when not
                       enough idle chunks remain. Stored keys are write-pending.
``complete_store``     the write landed: the chunk becomes readable and idle
                       (``success=False`` drops it again)
``finish``             the request's accesses, in prefix order, reach the policy
=====================  ==========================================================

A chunk's state is one integer, as in vLLM: ``-1`` while its write is in flight,
``0`` idle (the only evictable state), ``n > 0`` while ``n`` loads read it.

With ``store_threshold`` ≥ 2 a key is stored only once it has been offered that
many times; offers are counted in a tracker of at most ``max_tracker_size`` keys
(least recently offered dropped first, never a key of the current offer).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from fragsim.offload.policies import POLICIES, Key, Policy

WRITING = -1  # chunk state while its store is in flight


class Lookup(Enum):
    MISS = 0
    HIT = 1
    PENDING = 2  # resident, its write not yet complete


@dataclass(eq=False)
class RequestAccess:
    """One request's dealings with one tier, from its arrival to ``finish``.

    ``positions`` maps each of the request's keys to its place in the prompt (any
    increasing numbers, e.g. the chunk's end token); the policies order by it.
    """

    positions: dict[Key, int] = field(default_factory=dict)
    lru_rank: int | None = None
    seen: dict[Key, None] = field(default_factory=dict)  # every key accessed, in first-access order
    inserted: set[Key] = field(default_factory=set)
    reused: set[Key] = field(default_factory=set)
    store_misses: set[Key] = field(default_factory=set)
    finished: bool = False

    def position(self, key: Key) -> int | None:
        return self.positions.get(key)


@dataclass
class StoreResult:
    stored: list[Key]  # now write-pending; complete_store makes them readable
    evicted: list[Key]


@dataclass
class TierCounters:
    lookups: int = 0
    hits: int = 0  # chunks found ready by lookup
    loads: int = 0  # chunks pinned for reading
    stored: int = 0  # chunks whose store was prepared
    evicted: int = 0
    failed_stores: int = 0  # prepare_store calls refused for want of idle chunks
    skipped_stores: int = 0  # offered keys held back by the store threshold


class Tier:
    """A tier of ``num_chunks`` chunk slots under an eviction ``policy`` ("lru" or "arc")."""

    def __init__(self, num_chunks: int, policy: str = "lru", store_threshold: int = 1,
                 max_tracker_size: int = 64_000) -> None:
        if num_chunks < 0:
            raise ValueError(f"num_chunks must be >= 0, got {num_chunks}")
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        if store_threshold < 1:
            raise ValueError(f"store_threshold must be >= 1, got {store_threshold}")
        self.num_chunks = num_chunks
        self.policy_name = policy
        self.policy: Policy = POLICIES[policy](num_chunks)
        self.state: dict[Key, int] = {}  # resident keys -> WRITING, 0 (idle) or readers
        self.num_idle = 0
        self.num_writing = 0
        self.reserved = 0  # slots lent out whole (swapped-out sequences: fragsim's own)
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self._offers: OrderedDict[Key, int] | None = OrderedDict() if store_threshold >= 2 else None
        self.counters = TierCounters()

    # --- what is in it ---

    @property
    def num_free(self) -> int:
        return self.num_chunks - len(self.state) - self.reserved

    def lookup(self, key: Key) -> Lookup:
        self.counters.lookups += 1
        state = self.state.get(key)
        if state is None:
            return Lookup.MISS
        if state == WRITING:
            return Lookup.PENDING
        self.counters.hits += 1
        return Lookup.HIT

    def _idle(self, key: Key) -> bool:
        return self.state[key] == 0

    # --- loads ---

    def prepare_load(self, keys: Sequence[Key], access: RequestAccess) -> None:
        state = self.state
        for key in keys:
            readers = state[key]
            if readers == WRITING:
                raise ValueError(f"chunk {key} is still being written")
            if readers == 0:
                self.num_idle -= 1
            state[key] = readers + 1
        self.counters.loads += len(keys)
        self._record(keys, access, reused=keys)

    def complete_load(self, keys: Sequence[Key]) -> None:
        state = self.state
        for key in keys:
            readers = state[key] - 1
            if readers < 0:
                raise ValueError(f"chunk {key} was not being read")
            state[key] = readers
            if readers == 0:
                self.num_idle += 1

    # --- stores ---

    def prepare_store(self, keys: Sequence[Key], access: RequestAccess) -> StoreResult | None:
        state = self.state
        if self._offers is not None:
            self._count_offers(keys)
        absent = [key for key in keys if key not in state]
        ready = [key for key in keys if state.get(key, WRITING) != WRITING]
        if self._offers is not None:
            wanted = [key for key in absent if self._offers.get(key, 0) >= self.store_threshold]
            self.counters.skipped_stores += len(absent) - len(wanted)
            absent = wanted
        misses = [key for key in absent if key not in access.store_misses]
        if misses:
            self.policy.on_store_miss(misses)
            access.store_misses.update(misses)
        recorded = set(absent).union(ready)
        self._record([key for key in keys if key in recorded], access, reused=ready)
        if not absent:
            return StoreResult([], [])
        to_evict = len(absent) - self.num_free
        evicted: list[Key] = []
        if to_evict > 0:
            if to_evict > self.num_idle:
                self.counters.failed_stores += 1
                return None
            chosen = self.policy.evict(to_evict, set(keys), self._idle)
            if chosen is None:
                self.counters.failed_stores += 1
                return None
            for key in chosen:
                del state[key]
            self.num_idle -= len(chosen)
            evicted = chosen
            self.counters.evicted += len(chosen)
        for key in absent:
            state[key] = WRITING
            self.policy.insert(key, access)
        self.num_writing += len(absent)
        access.inserted.update(absent)
        self.counters.stored += len(absent)
        return StoreResult(absent, evicted)

    def reserve(self, n: int) -> list[Key] | None:
        """Lend ``n`` slots out of the pool (swap space), evicting idle chunks by the
        policy to make room; the evicted keys, or None (nothing changed) when too few
        chunks are idle. Not a vLLM call: vLLM v1 has no swap."""
        to_evict = n - self.num_free
        evicted: list[Key] = []
        if to_evict > 0:
            if to_evict > self.num_idle:
                return None
            chosen = self.policy.evict(to_evict, (), self._idle)
            if chosen is None:
                return None
            for key in chosen:
                del self.state[key]
            self.num_idle -= len(chosen)
            self.counters.evicted += len(chosen)
            evicted = chosen
        self.reserved += n
        return evicted

    def release(self, n: int) -> None:
        if n > self.reserved:
            raise ValueError(f"releasing {n} slots, {self.reserved} lent out")
        self.reserved -= n

    def complete_store(self, keys: Sequence[Key], success: bool = True) -> None:
        state = self.state
        for key in keys:
            if state.get(key) != WRITING:
                continue
            self.num_writing -= 1
            if success:
                state[key] = 0
                self.num_idle += 1
            else:
                del state[key]
                self.policy.remove(key)

    def _count_offers(self, keys: Sequence[Key]) -> None:
        offers = self._offers
        assert offers is not None
        repeated = set()
        for key in keys:
            if key in offers:
                offers.move_to_end(key)
                offers[key] += 1
                repeated.add(key)
        droppable = len(offers) - len(repeated)
        for key in keys:
            if key in offers:
                continue
            if len(offers) >= self.max_tracker_size:
                if droppable == 0:
                    continue
                offers.popitem(last=False)
                droppable -= 1
            offers[key] = 1

    # --- requests ---

    def _record(self, keys: Sequence[Key], access: RequestAccess, reused: Sequence[Key] = ()) -> None:
        seen = access.seen
        new = [key for key in keys if key not in seen]
        if new:
            if access.finished:
                raise ValueError("a finished request accessed the tier again")
            seen.update(dict.fromkeys(new))
            self.policy.on_access(new, self.state, access)
        access.reused.update(key for key in reused if key not in access.inserted)

    def finish(self, access: RequestAccess) -> None:
        if access.finished:
            return
        access.finished = True
        keys = list(access.seen)
        if all(key in access.positions for key in keys):
            keys.sort(key=access.positions.__getitem__)
        self.policy.on_finish(keys, access.inserted - access.reused, access.reused, self.state)
