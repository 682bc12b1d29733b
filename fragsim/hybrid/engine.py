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

Stretches span block moves: window frees and block takes fall at steps known from
each sequence's length (its next threshold, ``num_owned``), so a stretch follows
each moving sequence from threshold to threshold, takes and frees blocks at those
steps in exact-mode order, records every step's split from the manager's kept sums
plus their changes, and stops before a step whose blocks might not all be free
(which then runs exactly, preempting if it must) and, when requests wait, before a
step that frees blocks (an admission may follow).

Prefix caching (``prefix_caching``, ``vllm-hybrid`` only,
:mod:`fragsim.hybrid.vllm_prefix`) follows the dense
:class:`~fragsim.sharing.SharingEngine`: at admission the manager is asked for the
hit (each kind's own rule, reconciled as vLLM does) and prefill starts after it;
the computed full prompt blocks get their keys at the end of the step that
computed them; the counters and summary keys are the dense ones, and each kind's
own hit rate goes to its ``by_kind`` entry.

Not yet for hybrid runs: parallel samples and beams, swap preemption and
request-level batching.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np

from fragsim import stretch
from fragsim.allocators import Allocator
from fragsim.costmodel import CostModel
from fragsim.engine import (
    _BLOCK_BATCH,
    _BLOCK_CAP,
    _BLOCK_FRAG,
    RUNNING,
    Engine,
    EngineConfig,
    _Prefill,
)
from fragsim.hybrid.base import HybridManager
from fragsim.hybrid.kv import HybridKV
from fragsim.prefix import PrefixKeys


class HybridEngine(Engine):
    """Replays ``trace`` against a hybrid KV manager; call :meth:`run` once."""

    kv: HybridKV

    def __init__(self, trace: object, manager: HybridManager, cost_model: CostModel,
                 config: EngineConfig, progress: Callable[[int], None] | None = None,
                 observer: Any = None) -> None:
        if config.num_samples > 1 or config.beam_width > 1:
            raise ValueError("block sharing (samples, beams) is not modelled for "
                             "the hybrid KV managers yet")
        if config.prefix_caching and not getattr(manager, "prefix_caching", False):
            raise ValueError(f"prefix caching is modelled for vllm-hybrid only, not {manager.name}")
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
        self.split_rec = self.kv.split_rec
        # The recorder's free bytes are the split's free column, the manager's own free
        # bytes: a probe of the manager would compare them with themselves every step.
        self.rec.free_probe = None
        self._batched_growth = type(manager).advance_many is HybridManager.advance_many
        # Under memory pressure stretches stall (their first step might not fit) in long
        # runs: after n stalls in a row the next min(2^(n-1), 16) chances are stepped
        # exactly without trying (a single step is always exact; only speed changes), and
        # the next stretch tries its first step alone first.
        self._stalls = 0
        self._skip_stretches = 0
        self.prefix = PrefixKeys(trace, manager.block_size) if config.prefix_caching else None  # type: ignore[arg-type]
        self.num_prefix_hits_by_kind: dict[str, int] = {}  # each kind's own hit, on its own

    # ------------------------------------------------------------------ setup

    def _fits_alone(self, needs: np.ndarray) -> dict[int, bool]:
        return {int(n): self.manager.fits_empty(int(n)) for n in needs.tolist()}

    def _make_kv(self, allocator: Allocator) -> HybridKV:  # type: ignore[override]
        """The manager keeps the bytes; its split is asked of the sequences live now."""
        return HybridKV(self.manager, self.cfg.timeseries_resolution_s, self._live, self._computed)

    # --------------------------------------------------------- prefix caching

    def _admit(self) -> bool:
        """FCFS as the plain engine, each admission starting after its prefix-cache hit."""
        if self.prefix is None:
            return super()._admit()
        cfg, m = self.cfg, self.manager
        while self.waiting:
            req = self.waiting[0]
            if self._num_running() >= cfg.max_num_seqs or self._budget <= 0:
                self._mark_blocked(req, _BLOCK_BATCH)
                return True
            prompt = int(self.prompt[req])
            context = prompt + int(self.generated[req])
            keys = self.prefix.keys(req, prompt)
            hit = m.lookup(keys, context - 1)  # type: ignore[attr-defined]
            need = context + 1
            if m.allocate(req, need, hit, prompt) is None:  # type: ignore[call-arg]
                frag = m.num_free() >= m.rounded(need)
                self._mark_blocked(req, _BLOCK_FRAG if frag else _BLOCK_CAP)
                return True
            self.waiting.popleft()
            self.status[req] = RUNNING
            done = hit.tokens
            p = _Prefill(req, context, done, m.num_owned(req), need, cached=done)
            self.prefilling.append(p)
            chunk = min(self._budget, context - done)
            self._chunks.append((p, chunk))
            self._budget -= chunk
            self.num_prefix_queries += context
            self.num_prefix_hits += done
            for kind, tokens in hit.by_kind.items():
                self.num_prefix_hits_by_kind[kind] = self.num_prefix_hits_by_kind.get(kind, 0) + tokens
        return True

    def _end_step(self) -> None:
        """Computed full prompt blocks get their keys before anything completes."""
        if self.prefix is not None:
            B = self.manager.block_size
            for p, chunk in self._chunks:
                prompt = int(self.prompt[p.req])
                computed = min(p.done + chunk, prompt) // B
                if computed:
                    self.manager.cache_blocks(p.req, self.prefix.keys(p.req, prompt)[:computed])  # type: ignore[attr-defined]
        super()._end_step()

    def _finish(self, req: int) -> None:
        super()._finish(req)
        if self.prefix is not None:
            self.prefix.forget(req)

    def run(self) -> Engine:
        super().run()
        if self.prefix is not None:
            q = self.num_prefix_queries
            self.split_rec.extra_by_kind = {
                kind: {"prefix_cache_hit_rate": hits / q if q else 0.0}
                for kind, hits in self.num_prefix_hits_by_kind.items()}
        return self

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
        if self.prefilling:
            seqs = np.concatenate((seqs, [p.req for p in self.prefilling]))
        return seqs.astype(np.int64, copy=False), self._computed()

    def _computed(self) -> np.ndarray:
        """:meth:`_live`'s computed lengths alone."""
        computed = self.batch.offset[:self.batch.n] + self.g
        if self.prefilling:
            computed = np.concatenate((computed, [p.done for p in self.prefilling]))
        return computed.astype(np.int64, copy=False)

    def _check(self) -> None:
        """The engine's thresholds against the manager's, then the KV manager's check: the
        fast split against one rebuilt from every sequence's blocks, the manager's own
        invariants."""
        m, b = self.manager, self.batch
        for row in range(b.n):
            assert m.num_requested(int(b.seq[row])) == b.requested[row]
            assert m.num_owned(int(b.seq[row])) == b.owned[row], "the engine's growth threshold is not the manager's"
        # The record's token count stands for Σ computed in the split.
        token_states = b.offset_sum() + b.n * self.g + sum(p.done for p in self.prefilling)
        assert int(self._computed().sum()) == token_states, "token count and computed lengths differ"
        super()._check()

    def _grow_decoders(self) -> None:
        """Room for this step's token in every decoding sequence: all at once when the
        free memory holds every block taken (the order then changes nothing), else
        row by row, preempting as the engine does."""
        b, m = self.batch, self.manager
        n = b.n
        if n:
            rows = np.flatnonzero(b.offset[:n] + (self.g + 1) > b.owned[:n])
            if len(rows):
                if len(rows) > 1:
                    rows = rows[np.argsort(b.req[rows], kind="stable")]
                targets = b.offset[rows] + (self.g + 1)
                if self._batched_growth:
                    owned = m.grow_many(b.seq[rows], targets)
                    if owned is None:
                        super()._grow_decoders()
                        return
                    b.requested[rows] = targets
                    b.owned[rows] = owned
                    return
                # A manager that stands for its batched growth by its own advance_many (one
                # that records operations) is driven through it.
                row_seqs = b.seq[rows]
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
        if self._skip_stretches:
            self._skip_stretches -= 1
            return 0.0
        run = stretch.plan(self)
        if run is None:
            return 0.0
        b, m = self.batch, self.manager
        n = b.n
        filled0 = b.offset[:n] + self.g
        m_seqs = b.seq[:n].copy()
        k, splits, largest, used, last = m.stretch(m_seqs, b.req[:n], filled0, run.k, self._head_tokens(),
                                                   first_step_first=self._stalls > 0, owned=b.owned[:n])
        if k <= 0:
            self._stalls += 1
            self._skip_stretches = min(1 << (self._stalls - 1), 16)
            return 0.0
        self._stalls = 0
        touched = np.flatnonzero(last >= 0)
        if len(touched):
            b.requested[touched] = last[touched]
            b.owned[touched] = m.owned_many(m_seqs[touched])
        self.kv.record_steps(self.rec, self.now, run.dts[:k], splits, largest, used, n,
                             stretch.waiting_counts(self, run, k))
        return stretch.advance(self, run, k)
