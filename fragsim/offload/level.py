"""One tier in time: its chunk slots (a :class:`~fragsim.offload.tier.Tier`), what each
slot has been doing, and its counts, for :mod:`fragsim.offload.connector`.

Where a tier's chunk slots go, integrated over time (:class:`TierSplit`)::

    write_pending + read_pending + cached_hit_later + cached_never_hit + chunk_tail
        + swapped + free == num_chunks × span

A resident chunk is *write pending* from its store until the write lands, *read
pending* while a load reads it, *cached, hit later* while idle before a read that
comes, *cached, never hit again* while idle after its last read (or with none),
until evicted or the run ends. A partial chunk's unused share of all of that is its
*chunk tail*; slots lent to swapped-out sequences are *swapped*.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fragsim.offload.tier import WRITING, RequestAccess, Tier


@dataclass
class _Residency:
    """One chunk's stay in a tier, for the split."""

    t_in: float
    fill: float = 1.0                      # share of the chunk's tokens it holds
    t_ready: float | None = None
    read_total: float = 0.0
    read_since: float | None = None        # a read episode is open (readers > 0) since then
    last_read_start: float | None = None
    read_before_last: float = 0.0          # read time before the last episode started


@dataclass
class TierSplit:
    """Chunk-seconds of each part of a tier (see the module docstring)."""

    write_pending: float = 0.0
    read_pending: float = 0.0
    cached_hit_later: float = 0.0
    cached_never_hit: float = 0.0
    chunk_tail: float = 0.0
    swapped: float = 0.0       # slots lent to swapped-out sequences (one host pool)

    def close(self, r: _Residency, t_out: float) -> None:
        f = r.fill
        self.chunk_tail += (1.0 - f) * (t_out - r.t_in)
        if r.t_ready is None:
            self.write_pending += f * (t_out - r.t_in)
            return
        self.write_pending += f * (r.t_ready - r.t_in)
        read = r.read_total + (t_out - r.read_since if r.read_since is not None else 0.0)
        later = (r.last_read_start - r.t_ready - r.read_before_last) if r.last_read_start is not None else 0.0
        self.read_pending += f * read
        self.cached_hit_later += f * later
        self.cached_never_hit += f * ((t_out - r.t_ready) - read - later)

    @property
    def used(self) -> float:
        return (self.write_pending + self.read_pending + self.cached_hit_later
                + self.cached_never_hit + self.chunk_tail + self.swapped)


@dataclass
class LevelStats:
    hits: int = 0               # tokens loaded from this tier
    load_tokens: int = 0
    store_tokens: int = 0
    load_time_s: float = 0.0    # time its transfers held their resources
    store_time_s: float = 0.0
    failed_stores: int = 0


class Level:
    """One tier: its chunk slots (a :class:`~fragsim.offload.tier.Tier`), what each slot
    has been doing (the split) and its counts."""

    def __init__(self, name: str, num_chunks: int, policy: str, store_threshold: int,
                 chunk_bytes: int) -> None:
        self.name = name
        self.tier = Tier(num_chunks, policy, store_threshold=store_threshold)
        self.policy = policy
        self.num_chunks = num_chunks
        self.chunk_bytes = chunk_bytes
        self.split = TierSplit()
        self.stats = LevelStats()
        self.resident: dict[int, _Residency] = {}
        self.access: dict[int, RequestAccess] = {}
        self._lent_since = 0.0   # when the count of slots lent out last changed

    def lend(self, n: int, now: float) -> bool:
        """Lend ``n`` slots to swapped-out sequences, evicting idle chunks (False: too few)."""
        self._account_lent(now)
        evicted = self.tier.reserve(n)
        if evicted is None:
            return False
        for key in evicted:
            self.split.close(self.resident.pop(key), now)
        return True

    def take_back(self, n: int, now: float) -> None:
        self._account_lent(now)
        self.tier.release(n)

    def _account_lent(self, now: float) -> None:
        self.split.swapped += self.tier.reserved * (now - self._lent_since)
        self._lent_since = now

    def ready(self, key: int) -> bool:
        return self.tier.state.get(key, WRITING) != WRITING

    def access_of(self, req: int, keys: Sequence[int]) -> RequestAccess:
        """``req``'s dealings with this tier (-1: a store of no request, finished at once)."""
        access = self.access.get(req) if req >= 0 else None
        if access is None:
            access = RequestAccess({key: i + 1 for i, key in enumerate(keys)})
            if req >= 0:
                self.access[req] = access
        return access

    def store(self, req: int, keys: list[int], fills: dict[int, float], now: float,
              prompt_keys: Sequence[int]) -> list[int] | None:
        """Offer ``keys``; the ones now being written, or None when the tier refused."""
        access = self.access_of(req, prompt_keys)
        result = self.tier.prepare_store(keys, access)
        if req < 0:
            self.tier.finish(access)
        if result is None:
            self.stats.failed_stores += 1
            return None
        for key in result.evicted:
            self.split.close(self.resident.pop(key), now)
        for key in result.stored:
            self.resident[key] = _Residency(now, fills.get(key, 1.0))
        return result.stored

    def pin(self, req: int, keys: list[int], now: float, prompt_keys: Sequence[int]) -> None:
        self.tier.prepare_load(keys, self.access_of(req, prompt_keys))
        for key in keys:
            r = self.resident[key]
            if r.read_since is None:
                r.read_before_last = r.read_total
                r.read_since = r.last_read_start = now

    def unpin(self, keys: list[int], t: float) -> None:
        self.tier.complete_load(keys)
        for key in keys:
            if self.tier.state[key] == 0:
                r = self.resident[key]
                assert r.read_since is not None
                r.read_total += t - r.read_since
                r.read_since = None

    def written(self, keys: list[int], t: float) -> None:
        self.tier.complete_store(keys)
        for key in keys:
            r = self.resident.get(key)
            if r is not None and r.t_ready is None:
                r.t_ready = t

    def finish(self, req: int) -> None:
        access = self.access.pop(req, None)
        if access is not None:
            self.tier.finish(access)

    def close(self, now: float) -> None:
        for key in list(self.resident):
            self.split.close(self.resident.pop(key), now)
        self._account_lent(now)

    def check(self) -> None:
        tier = self.tier
        state = tier.state
        assert len(state) + tier.reserved <= tier.num_chunks, (self.name, len(state), tier.num_chunks)
        assert state.keys() == self.resident.keys(), f"{self.name}: tier and residency log drifted"
        assert tier.num_idle == sum(1 for s in state.values() if s == 0)
        assert tier.num_writing == sum(1 for s in state.values() if s == WRITING)
        for key, s in state.items():
            r = self.resident[key]
            assert (s == WRITING) == (r.t_ready is None), f"{self.name} chunk {key}: write state drifted"
            assert (s > 0) == (r.read_since is not None), f"{self.name} chunk {key}: read state drifted"

    def summary(self, span: float, chunk: int, token_bytes: int) -> dict[str, Any]:
        total = self.num_chunks * span
        split = self.split
        parts = {
            "cached_hit_later": split.cached_hit_later,
            "cached_never_hit": split.cached_never_hit,
            "write_pending": split.write_pending,
            "read_pending": split.read_pending,
            "chunk_tail": split.chunk_tail,
            "swapped": split.swapped,
        }
        fracs = {f"{k}_frac": (v / total if total > 0 else 0.0) for k, v in parts.items()}
        fracs["free_frac"] = (total - split.used) / total if total > 0 else 1.0
        s, c = self.stats, self.tier.counters
        return {
            "name": self.name,
            "policy": self.policy,
            "block_size": chunk,
            "capacity_bytes": self.num_chunks * self.chunk_bytes,
            "capacity_blocks": self.num_chunks,
            "hits_tokens": s.hits,
            "stored_blocks": c.stored,
            "evicted_blocks": c.evicted,
            "failed_stores": s.failed_stores,
            "mean_used_bytes": (split.used / span * self.chunk_bytes) if span > 0 else 0.0,
            **fracs,
            "load_bytes": s.load_tokens * token_bytes,
            "store_bytes": s.store_tokens * token_bytes,
            "load_time_s": s.load_time_s,
            "store_time_s": s.store_time_s,
        }
