"""The serving engine over a hybrid KV manager.

:class:`HybridEngine` is :class:`fragsim.engine.Engine` with a
:class:`~fragsim.hybrid.base.HybridManager` as its allocator. Scheduling is the
engine's own (same steps, same admission, growth and recompute preemption); what
changes is what a sequence meets and what is recorded:

* a decoding sequence calls the manager whenever its next token takes a block
  *or* frees one: the manager's ``num_owned`` is the longest requested length that
  moves no block, so window frees happen at the step vLLM makes them;
* prompt blocks are all taken at admission, as the dense engine does; window frees
  begin at the first decode step;
* each step records the manager's byte split per row and category
  (:class:`~fragsim.hybrid.split.SplitRecorder`) beside the engine's usual
  recorder, which gets the pool-wide totals in bytes.

Stretches keep working: window frees and block takes fall at steps known from
each sequence's length, so a stretch runs between them in a few numpy calls, takes
and frees blocks at those steps in exact-mode order, and stops before a step whose
blocks might not all be free (which then runs exactly, preempting if it must) and,
when requests wait, before a step that frees blocks (an admission may follow).

Not yet for hybrid runs: block sharing (samples, beams, prefix caching), swap
preemption and request-level batching.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np

from fragsim import stretch
from fragsim.allocators import Allocator
from fragsim.costmodel import CostModel
from fragsim.engine import Engine, EngineConfig
from fragsim.hybrid.base import (
    CATEGORIES,
    FREE,
    INTERNAL,
    OUT_OF_WINDOW,
    PADDING,
    TOKEN,
    HybridManager,
    kind_of_rows,
)
from fragsim.hybrid.split import SplitRecorder

_HELD_ELSEWHERE = [INTERNAL, PADDING, OUT_OF_WINDOW]


class HybridEngine(Engine):
    """Replays ``trace`` against a hybrid KV manager; call :meth:`run` once."""

    def __init__(self, trace: object, manager: HybridManager, cost_model: CostModel,
                 config: EngineConfig, progress: Callable[[int], None] | None = None,
                 observer: Any = None) -> None:
        if config.sharing:
            raise ValueError("block sharing (samples, beams, prefix caching) is not modelled for "
                             "the hybrid KV managers yet")
        if config.preemption != "recompute":
            raise ValueError("the hybrid KV managers preempt by recompute only (--preemption recompute)")
        if config.batching != "continuous":
            raise ValueError("the hybrid KV managers need continuous batching")
        self.manager = manager
        # The manager keeps the Allocator protocol in token units; only its placements
        # differ (block ids per row), and the engine does not read them.
        super().__init__(trace, cast(Allocator, manager), cost_model, config, progress=progress,
                         observer=observer)
        manager.bind_finals(self.final)
        self.split_rec = SplitRecorder(manager.labels, kind_of_rows(manager.rows), manager.capacity,
                                       config.timeseries_resolution_s)

    # ------------------------------------------------------------------ setup

    def _fits_alone(self, needs: np.ndarray) -> dict[int, bool]:
        return {int(n): self.manager.fits_empty(int(n)) for n in needs.tolist()}

    def _take(self, req: int, owned: int, delta: int = 1) -> None:
        """The manager keeps the bytes; the engine's slot totals are not used."""

    # ----------------------------------------------------------- address maps

    def _sample_address_map(self) -> None:
        """Which row holds each unit of the pool now (−1: free), binned to
        ``address_map_bins`` (a bin shows the row of its first unit)."""
        units = self.manager.unit_rows()
        bins = min(len(units), self.cfg.address_map_bins)
        self._map_times.append(self.now)
        self._map_rows.append(units[(np.arange(bins) * len(units)) // bins])
        self._map_next = self.now + (self.cfg.address_map_interval_s or 1.0)

    def address_map(self) -> dict[str, Any] | None:
        """Sampled units: ``time_s`` [T], ``row`` [T, bins] (the row index, −1 free),
        ``kinds`` (what each row index holds), ``unit`` (blocks, slots or large pages)."""
        if not self._map_times:
            return None
        unit = {"jenga": "large page", "static-partition": "block (pool per kind)",
                "paged-uniform": "block, then state slot"}.get(self.manager.placement_name, "block")
        return {"time_s": np.array(self._map_times), "row": np.vstack(self._map_rows),
                "kinds": self.manager.unit_kinds, "unit": unit}

    # -------------------------------------------------------------- recording

    def _live(self) -> tuple[np.ndarray, np.ndarray]:
        """Sequence ids and computed lengths of everything holding memory now."""
        b, n = self.batch, self.batch.n
        seqs = b.seq[:n]
        computed = b.offset[:n] + self.g
        if self.prefilling:
            seqs = np.concatenate((seqs, [p.req for p in self.prefilling]))
            computed = np.concatenate((computed, [p.done for p in self.prefilling]))
        return seqs.astype(np.int64), computed.astype(np.int64)

    def _record_split(self, dt: float, split: np.ndarray, running: int, waiting: int) -> None:
        m = self.manager
        free = int(split[:, FREE].sum())
        self.rec.record(self.now, dt, int(split[:, TOKEN].sum()), m.capacity - free,
                        int(split[:, _HELD_ELSEWHERE].sum()), m.largest_allocatable(), running, waiting)
        self.split_rec.record(self.now, dt, split, m.num_used_blocks())

    def _record_step(self, dt: float, decode_context: int) -> None:
        seqs, computed = self._live()
        self._record_split(dt, self.manager.split(seqs, computed), self._num_running(),
                           len(self.waiting) + len(self.swapped))

    def _record_idle(self, dt: float) -> None:
        none = np.zeros(0, dtype=np.int64)
        self._record_split(dt, self.manager.split(none, none), 0, len(self.waiting))

    def memory_split(self) -> tuple[int, int, int, int]:
        """(token_states, reservation, everything else held, free) in bytes, now."""
        seqs, computed = self._live()
        split = self.manager.split(seqs, computed)
        return (int(split[:, TOKEN].sum()), int(split[:, CATEGORIES.index("reservation")].sum()),
                int(split[:, _HELD_ELSEWHERE].sum()), int(split[:, FREE].sum()))

    def _check(self) -> None:
        """The fast split against one rebuilt from every sequence's blocks; the
        engine's thresholds against the manager's; the manager's own invariants."""
        m, b = self.manager, self.batch
        seqs, computed = self._live()
        fast, slow = m.split(seqs, computed), m.split_slow(seqs, computed)
        assert (fast == slow).all(), f"split drifted at t={self.now}:\n{fast}\n!=\n{slow}"
        assert int(fast.sum()) == m.capacity
        for row in range(b.n):
            seq = int(b.seq[row])
            assert m.num_owned(seq) == b.owned[row], (seq, m.num_owned(seq), int(b.owned[row]))
            assert m.num_requested(seq) == b.requested[row]
        m.check()

    def _grow_decoders(self) -> None:
        """Room for this step's token in every decoding sequence: all at once when the
        free memory holds every block taken (the order then changes nothing), else
        row by row, preempting as the engine does."""
        b, m = self.batch, self.manager
        n = b.n
        if n:
            rows = np.flatnonzero(b.offset[:n] + (self.g + 1) > b.owned[:n])
            if len(rows):
                if len(rows) <= 4:   # a few rows: the scalar path is cheaper than numpy's
                    super()._grow_decoders()
                    return
                rows = rows[np.argsort(b.req[rows], kind="stable")]
                row_seqs, targets = b.seq[rows], b.offset[rows] + (self.g + 1)
                moves = m.moves_many(row_seqs, targets)
                if not m.can_take_all(moves[-1]):
                    super()._grow_decoders()
                    return
                m.advance_many(row_seqs, targets, moves)
                b.requested[rows] = targets
                b.owned[rows] = m.owned_many(row_seqs)

    # ------------------------------------------------------------- stretches

    def _head_tokens(self) -> int | None:
        """Tokens the queue's head would ask for if the batch limits let it in (None:
        nothing waits, or the limits keep it out whatever memory frees)."""
        if not self.waiting or self._num_running() >= self.cfg.max_num_seqs \
                or self.batch.n >= self.cfg.num_batched_tokens:
            return None
        head = self.waiting[0]
        return int(self.prompt[head] + self.generated[head]) + 1

    def _jump(self) -> float:
        """A stretch of decode steps, blocks taken and freed at the steps they move."""
        run = stretch.plan(self)
        if run is None:
            return 0.0
        b, m = self.batch, self.manager
        n = b.n
        filled0 = b.offset[:n] + self.g
        m_seqs = b.seq[:n].copy()
        k, splits, largest, used, last = m.stretch(m_seqs, b.req[:n], filled0, run.k, self._head_tokens())
        if k <= 0:
            return 0.0
        touched = np.flatnonzero(last >= 0)
        if len(touched):
            b.requested[touched] = last[touched]
            b.owned[touched] = m.owned_many(m_seqs[touched])
        free = splits[:, :, FREE].sum(axis=1)
        dts = run.dts[:k]
        self.rec.record_steps(self.now, dts, splits[:, :, TOKEN].sum(axis=1), m.capacity - free,
                              splits[:, :, _HELD_ELSEWHERE].sum(axis=(1, 2)), largest, n,
                              stretch.waiting_counts(self, run, k))
        self.split_rec.record_steps(self.now, dts, splits, used)
        return stretch.advance(self, run, k)
