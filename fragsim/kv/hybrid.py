"""The engine's KV side over a hybrid KV manager (:mod:`fragsim.hybrid`), in bytes.

The manager knows which blocks each sequence holds per group and where they are;
this side speaks the engine's protocol (:mod:`fragsim.kv.protocol`) over it:
admission (with a prefix hit where the manager caches), growth to a sequence's
room, stretches, and the byte split recorded per group and category
(:class:`~fragsim.hybrid.split.SplitRecorder`), as the sums the split is linear in
where it is (:class:`~fragsim.hybrid.basis.SplitBasis`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fragsim.engine_config import EngineConfig
from fragsim.hybrid.groups import CATEGORIES, FREE, INTERNAL, OUT_OF_WINDOW, PADDING, TOKEN
from fragsim.hybrid.manager import HybridManager, kind_of_groups
from fragsim.hybrid.split import SplitRecorder
from fragsim.kv.protocol import Admitted, Hit, LiveView, Rows, StretchMemory
from fragsim.metrics import Recorder
from fragsim.prefix import PrefixKeys

HELD_ELSEWHERE = [INTERNAL, PADDING, OUT_OF_WINDOW]
RESERVATION = CATEGORIES.index("reservation")


class HybridPrefix:
    """The engine's prefix cache over a caching hybrid manager: keys, hits, hit rates."""

    def __init__(self, manager: Any, keys: PrefixKeys) -> None:
        self.m, self._keys = manager, keys
        self.queries = 0
        self.by_kind: dict[str, int] = {}

    def keys(self, req: int, prompt_len: int) -> list[int]:
        return self._keys.keys(req, prompt_len)

    def lookup(self, req: int, prompt_len: int, context: int) -> Hit:
        hit = self.m.lookup(self._keys.keys(req, prompt_len), context - 1)
        return Hit(hit.tokens, hit)

    def count(self, hit: Hit, context: int) -> None:
        self.queries += context
        for kind, tokens in hit.detail.by_kind.items():
            self.by_kind[kind] = self.by_kind.get(kind, 0) + tokens

    def cache(self, req: int, prompt_len: int, computed: int) -> None:
        blocks = min(computed, prompt_len) // self.m.block_size
        if blocks:
            self.m.cache_blocks(req, self._keys.keys(req, prompt_len)[:blocks])

    def forget(self, req: int) -> None:
        self._keys.forget(req)

    def summary(self) -> dict[str, Any]:
        q = self.queries
        return {kind: {"prefix_cache_hit_rate": hits / q if q else 0.0} for kind, hits in self.by_kind.items()}


class HybridKV:
    """A hybrid manager behind the engine's KV-manager protocol (bytes)."""

    unit = "bytes"
    grows_on_demand = True
    shared_slots = 0
    free_probe = None
    backs_off = True

    def __init__(self, manager: HybridManager, resolution_s: float | None,
                 prefix_keys: PrefixKeys | None = None) -> None:
        self.alloc = manager
        self.manager = manager
        self.name = manager.name
        self.capacity = int(manager.capacity)
        self.block_size = manager.block_size
        self.prefix = HybridPrefix(manager, prefix_keys) if prefix_keys is not None else None
        self._finals = np.zeros(0, dtype=np.int64)
        self._sums = manager.sums if manager.split_is_linear else None
        self._largest_is_free = manager.largest_is_free
        self.split_rec = SplitRecorder(manager.labels, kind_of_groups(manager.rows), manager.capacity,
                                       resolution_s, manager.split_basis() if self._sums is not None else None)

    def validate(self, config: EngineConfig) -> None:
        if config.num_samples > 1 or config.beam_width > 1:
            raise ValueError("block sharing (samples, beams) is not modelled for "
                             "the hybrid KV managers yet")
        if config.prefix_caching and self.prefix is None:
            raise ValueError(f"prefix caching is modelled for vllm-hybrid only, not {self.name}")
        if config.preemption != "recompute":
            raise ValueError("the hybrid KV managers preempt by recompute only (--preemption recompute)")
        if config.batching != "continuous":
            raise ValueError("the hybrid KV managers need continuous batching")

    def fits_alone(self, prompt: np.ndarray, output: np.ndarray, width: int) -> np.ndarray:
        final = prompt + output
        fits = {int(n): self.manager.fits_empty(int(n)) for n in np.unique(final).tolist()}
        return np.array([fits[int(x)] for x in final], dtype=bool)

    def admission_tokens(self, prompt: int, output: int, context: int) -> int:
        return context + 1

    def _bind(self, seq: int, final: int) -> None:
        if seq >= len(self._finals):
            grown = np.zeros(max(seq + 1, 2 * len(self._finals), 64), dtype=np.int64)
            grown[: len(self._finals)] = self._finals
            self._finals = grown
            self.manager.bind_finals(grown)
        self._finals[seq] = final

    def admit(self, seqs: Sequence[int], tokens: int, final: int, prompt: int,
              hit: Hit | None, external: int = 0) -> Admitted | None:
        (seq,) = seqs
        self._bind(seq, final)
        m = self.manager
        room = m._allocate(seq, tokens, external=external) if hit is None \
            else m._allocate(seq, tokens, hit.detail, prompt)
        if room is None:
            return None
        if hit is not None:
            assert self.prefix is not None
            self.prefix.count(hit, tokens - 1)
        return Admitted((room,))

    def blocked_by_fragmentation(self, tokens: int) -> bool:
        return self.manager.num_free() >= self.manager.rounded(tokens)

    def room(self, seq: int) -> int:
        return self.manager.num_owned(seq)

    def grow(self, seq: int, target: int) -> int | None:
        m = self.manager
        return m._extend_owned(seq, target - m.num_requested(seq))

    def grow_many(self, seqs: list[int], targets: list[int], rooms: Sequence[int],
                  finals: Sequence[int]) -> list[int] | None:
        return self.manager.grow_many(seqs, targets)

    def free(self, seq: int) -> int:
        m = self.manager
        return sum(n * r.block_bytes for n, r in zip(m.free(seq), m.rows, strict=True))

    def stretch(self, rows: Rows, k: int, head_tokens: int | None, stalled: bool) -> StretchMemory:
        m = self.manager
        seqs = rows.seqs.copy()
        k, splits, largest, used, last = m.stretch(seqs, rows.reqs, rows.filled, k, head_tokens,
                                                   first_step_first=stalled, owned=rows.rooms)
        if k <= 0:
            return StretchMemory(0)
        rooms = rows.rooms.copy()
        touched = np.flatnonzero(last >= 0)
        if len(touched):
            rooms[touched] = m.owned_many(seqs[touched])
        return StretchMemory(k, rooms, {"splits": splits, "largest": largest, "used": used})

    def current_split(self, live: LiveView) -> np.ndarray:
        return self.manager.split(live.seqs(), live.computed(), live.receiving())

    def held_units(self, held: dict[int, int], live: LiveView) -> tuple[int, int]:
        """(tokens the sequences ``held`` store, bytes of token states only they hold);
        ``held``: each sequence kept past its request's end, and its stored length."""
        return sum(held.values()), self.manager.held_only_bytes(held, live.seqs(), live.computed())

    def keep(self, seq: int, computed: int) -> None:
        """A finished sequence stays for its KV to be read elsewhere, from ``computed``
        tokens on: the blocks before what that reading needs go back."""
        self.manager.release_skipped(seq, computed)

    def moved(self, seq: int, first: int, last: int) -> tuple[int, dict[str, int]]:
        """(bytes of one GPU, data bytes per layer kind of one GPU) that positions
        ``[first, last)`` of ``seq`` take where it is placed: what a transfer fills."""
        by_kind = self.manager.moved_bytes(seq, first, last)
        return sum(by_kind.values()), by_kind

    def record(self, rec: Recorder, now: float, dt: float, stored: int, live: LiveView,
               running: int, waiting: int) -> None:
        m = self.manager
        if self._sums is None:
            split = self.current_split(live)
            free = int(split[:, FREE].sum())
            rec.record(now, dt, int(split[:, TOKEN].sum()), m.capacity - free,
                       int(split[:, HELD_ELSEWHERE].sum()), m.largest_allocatable(), running, waiting)
            self.split_rec.record(now, dt, split, m.num_used_blocks())
            return
        sums, token, free, elsewhere = self._sums(live.computed() if m.reads_windows else None, stored,
                                                  receiving=live.receiving() if m.reads_windows else None)
        rec.record(now, dt, token, m.capacity - free, elsewhere,
                   free if self._largest_is_free else m.largest_allocatable(), running, waiting)
        self.split_rec.record_sums(now, dt, sums, m.num_used_blocks())

    def record_steps(self, rec: Recorder, memory: StretchMemory, now: float, dts: np.ndarray,
                     stored: np.ndarray, running: int, waiting: np.ndarray) -> None:
        splits, largest, used = (memory.per_step[key] for key in ("splits", "largest", "used"))
        per_category = splits.sum(axis=1)
        free = per_category[:, FREE]
        all_free = self._largest_is_free or bool((largest == free).all())
        rec.record_steps(now, dts, per_category[:, TOKEN], self.manager.capacity - free,
                         per_category[:, INTERNAL] + per_category[:, PADDING] + per_category[:, OUT_OF_WINDOW],
                         None if all_free else largest, running, waiting)
        self.split_rec.record_steps(now, dts, splits, used, per_category.sum(axis=1))

    def split(self, stored: int, live: LiveView) -> tuple[int, int, int, int]:
        split = self.current_split(live)
        return (int(split[:, TOKEN].sum()), int(split[:, RESERVATION].sum()),
                int(split[:, HELD_ELSEWHERE].sum()), int(split[:, FREE].sum()))

    def check(self, live: LiveView) -> None:
        """The split adds up to the pool with no negative part, and the manager's own
        checks (tests add a position-by-position oracle through ``engine.checks``)."""
        m = self.manager
        split = m.split(live.seqs(), live.computed(), live.receiving())
        assert int(split.sum()) == m.capacity and int(split.min()) >= 0, f"broken byte split:\n{split}"
        if m.split_is_linear:
            m.sums(live.computed(), int(live.computed().sum()), receiving=live.receiving())  # checks the parts
        m.check()

    def summary(self) -> dict[str, Any]:
        if self.prefix is not None:
            self.split_rec.extra_by_kind = self.prefix.summary()
        return {**self.split_rec.summary(),
                "num_prefix_cache_evictions": int(getattr(self.manager.pool, "num_evictions", 0))}

    def timeseries(self) -> dict[str, np.ndarray]:
        return self.split_rec.timeseries()

    def sample_units(self, filled: dict[int, int]) -> np.ndarray:
        return self.manager.unit_rows()

    def address_map(self, times: list[float], rows: list[np.ndarray]) -> dict[str, Any]:
        unit = self.manager.pool.unit_name
        return {"time_s": np.array(times), "row": np.vstack(rows),
                "kinds": self.manager.unit_kinds, "unit": unit}
