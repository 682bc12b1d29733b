"""A hybrid manager's decisions executed on a real pool, step by step.

The observer of a hybrid run (:class:`~fragsim.engine.Engine` over :class:`~fragsim.kv.hybrid.HybridKV`, exact steps).
After every step it reads each live sequence's blocks per row from the manager
(``placement``: the held blocks in logical order, leading freed blocks left out)
and makes the device agree:

1. blocks a sequence no longer holds go back (a window that moved on, a finished
   or preempted request); blocks it newly holds are taken, with their logical
   index (an id held twice is an error naming both requests);
2. every attention row writes the K/V of each newly computed position into every
   one of its layers, through the row's layout (:mod:`gpu_backend.hybrid_layout`);
   a state row checks that its block still holds the state of the length it last
   wrote (a read: a neighbour's free or a reused block must not have touched it),
   then writes the state of the new length;
3. every held, written position of every live request must hold its own K/V
   (checked every ``attention_every`` steps), and decode attention runs over what
   the next token of each decoding request will read: all of it for full and MLA
   rows, its window for sliding rows, its chunk for chunked rows, through block
   tables whose freed leading entries are −1, against a PyTorch reference on K/V
   regenerated from scratch;
4. the byte split measured from the device tensors, per row and category, must
   equal the manager's at that instant.

Any disagreement raises :class:`ValidationError` naming the step, the request and,
where it applies, the row, the layer and the position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fragsim.engine_views import live_sequences
from fragsim.hybrid.groups import CATEGORIES
from gpu_backend.hybrid_pool import HybridPool
from gpu_backend.pool import ValidationError, kv_values, query_values

__all__ = ["HybridDeviceBackend", "HybridStepRecord"]


@dataclass
class HybridStepRecord:
    step: int
    time_s: float
    simulated: np.ndarray    # [rows + pool, categories] bytes
    measured: np.ndarray
    running: int


@dataclass
class _Seq:
    epoch: int                         # the request's preemption count when placed
    ids: list[dict[int, int]]          # per row: block id -> logical index
    computed: int = 0                  # positions written
    state_len: int = -1                # length whose state the state rows hold


@dataclass
class HybridDeviceBackend:
    pool: HybridPool
    manager: Any
    num_q_heads_per_kv: int = 2
    attention_every: int = 1
    corrupt: Any = None                # test hook: callable(backend, engine) run before checks
    records: list[HybridStepRecord] = field(default_factory=list)
    attention_checks: int = 0
    content_checks: int = 0
    state_checks: int = 0
    window_reuses: int = 0             # blocks freed by a window and taken again while running
    max_abs_error: float = 0.0

    def __post_init__(self) -> None:
        self._seqs: dict[int, _Seq] = {}
        self._step = 0
        self._window_freed: set[tuple[int, int]] = set()

    # ------------------------------------------------------------ observer

    def before_step(self, engine: Any, dt: float) -> None:
        """The device follows the decisions once they took effect."""

    def after_step(self, engine: Any) -> None:
        self._step += 1
        live = {s.req: s for s in live_sequences(engine)}
        self._sync(engine, live)
        self._write(live)
        if self.corrupt is not None:
            self.corrupt(self, engine)
        if self._step % self.attention_every == 0:
            self._check_contents(live)
            self._check_attention(live)
        self._compare_split(engine, len(live))

    # ------------------------------------------------------------ ownership

    def _sync(self, engine: Any, live: dict[int, Any]) -> None:
        """Blocks given back first, then blocks taken: in one step a block may go from one
        request (its window moved on) to another."""
        pool, m, dev = self.pool, self.manager, self.pool.device
        for req in [r for r in self._seqs if r not in live]:
            self._drop(req)
        takes: list[tuple[int, int, dict[int, int], dict[int, int]]] = []
        for req, s in live.items():
            epoch = int(engine.requests.preemptions[req])
            old = self._seqs.get(req)
            if old is not None and old.epoch != epoch:
                self._drop(req)         # preempted and placed again since the last step
                old = None
            placement = m.placement(s.seq_id)
            q = m.num_requested(s.seq_id)
            if old is None:
                old = self._seqs[req] = _Seq(epoch, [{} for _ in placement])
            pool.set_request(req, s.filled, s.final)
            for r, (row, ids) in enumerate(zip(pool.layout.rows, placement, strict=True)):
                lo = 0 if row.is_state else -(-q // row.block_tokens) - len(ids)
                want = {b: lo + k for k, b in enumerate(ids)}
                have = old.ids[r]
                gone = [b for b, i in have.items() if want.get(b) != i]
                if gone:
                    pool.give_back(r, torch.tensor(gone, dtype=torch.int64, device=dev))
                    if row.kind in ("sliding", "chunked"):
                        self._window_freed.update((r, b) for b in gone)
                    for b in gone:
                        del have[b]
                if len(want) > len(have) or any(b not in have for b in want):
                    takes.append((req, r, want, have))
        for req, r, want, have in takes:
            new = [b for b in want if b not in have]
            self.window_reuses += sum((r, b) in self._window_freed for b in new)
            pool.take(r, torch.tensor(new, dtype=torch.int64, device=dev), req,
                      torch.tensor([want[b] for b in new], dtype=torch.int64, device=dev))
            have.update((b, want[b]) for b in new)

    def _drop(self, req: int) -> None:
        seq = self._seqs.pop(req)
        for r, have in enumerate(seq.ids):
            if have:
                self.pool.give_back(r, torch.tensor(list(have), dtype=torch.int64, device=self.pool.device))
        seq.computed, seq.state_len = 0, -1

    def _block_of(self, req: int, r: int) -> torch.Tensor:
        """Block id of each logical block index of ``req`` in row ``r`` (−1: not held)."""
        have = self._seqs[req].ids[r]
        top = max(have.values(), default=-1) + 1
        table = torch.full((max(top, 1),), -1, dtype=torch.int64)
        for b, i in have.items():
            table[i] = b
        return table.to(self.pool.device)

    # ------------------------------------------------------------ writes

    def _write(self, live: dict[int, Any]) -> None:
        pool = self.pool
        for req, s in live.items():
            seq = self._seqs[req]
            if s.filled < seq.computed:
                raise ValidationError(f"step {self._step}: request {req} shrank from {seq.computed} "
                                      f"to {s.filled} computed tokens")
            for r, row in enumerate(pool.layout.rows):
                if row.is_state:
                    self._step_state(req, r, s.filled, seq)
                    continue
                if s.filled == seq.computed:
                    continue
                # Only positions still held are written: a prefill longer than the
                # window never stores what its blocks already gave back.
                positions = torch.arange(seq.computed, s.filled, device=pool.device)
                blocks = self._block_of(req, r)
                index = torch.div(positions, row.block_tokens, rounding_mode="floor")
                inside = index < len(blocks)
                ids = torch.where(inside, blocks[index.clamp_max(len(blocks) - 1)], -1)
                keep = ids >= 0
                if bool(keep.any()):
                    pool.write_tokens(r, req, ids[keep], positions[keep])
            if any(row.is_state for row in pool.layout.rows):
                seq.state_len = s.filled
            seq.computed = s.filled

    def _step_state(self, req: int, r: int, filled: int, seq: _Seq) -> None:
        pool = self.pool
        held = list(seq.ids[r])
        if len(held) != 1:
            raise ValidationError(f"step {self._step}: request {req} holds {len(held)} blocks of "
                                  f"state row {pool.layout.rows[r].label}, not 1")
        block = held[0]
        if int(pool.state_len[r][block].item()) >= 0:
            self.state_checks += 1
            bad = pool.state_is_intact(r, req, block, seq.state_len)
            if bad is not None:
                raise ValidationError(
                    f"step {self._step}: request {req}'s state (layer {bad}, block {block} of "
                    f"{pool.layout.rows[r].label}) is not the state of its {seq.state_len} tokens")
        pool.write_state(r, req, block, filled)

    # ------------------------------------------------------------ checks

    def _check_contents(self, live: dict[int, Any]) -> None:
        pool = self.pool
        for req in live:
            seq = self._seqs[req]
            for r, row in enumerate(pool.layout.rows):
                if row.is_state or not seq.ids[r]:
                    continue
                ids = torch.tensor(list(seq.ids[r]), dtype=torch.int64, device=pool.device)
                idx = torch.tensor(list(seq.ids[r].values()), dtype=torch.int64, device=pool.device)
                pos = (idx[:, None] * row.block_tokens
                       + torch.arange(row.block_tokens, device=pool.device)[None, :]).flatten()
                blk = ids[:, None].expand(-1, row.block_tokens).flatten()
                stored = pos < seq.computed
                if not bool(stored.any()):
                    continue
                self.content_checks += 1
                bad = pool.first_wrong_token(r, req, blk[stored], pos[stored])
                if bad is not None:
                    position, layer = bad
                    block = int(blk[stored][(pos[stored] == position).nonzero()[0]].item())
                    raise ValidationError(
                        f"step {self._step}: request {req} position {position} ({row.label}, layer "
                        f"{layer}, block {block}) holds the wrong K/V")

    def _check_attention(self, live: dict[int, Any]) -> None:
        pool = self.pool
        reqs = [r for r, s in live.items() if s.decoding and s.filled > 0]
        if not reqs:
            return
        for r, row in enumerate(pool.layout.rows):
            if row.is_state:
                continue
            lens = [live[q].filled for q in reqs]
            starts = [int(row.window_start(torch.tensor(n)).item()) for n in lens]
            batch = [(q, n, s0) for q, n, s0 in zip(reqs, lens, starts, strict=True) if s0 < n]
            if batch:
                self._attend_row(r, batch)

    def _attend_row(self, r: int, batch: list[tuple[int, int, int]]) -> None:
        """Attention of the next token of each ``(req, stored, window start)`` over the
        stored positions it reads, through the row's first layer, against the reference."""
        from gpu_backend import attention
        from gpu_backend.reference import attend_one

        pool, row, dev = self.pool, self.pool.layout.rows[r], self.pool.device
        layer = row.layer_ids[0]
        rows = [self._block_of(req, r) for req, _, _ in batch]
        tables = torch.full((len(batch), max(len(t) for t in rows)), -1, dtype=torch.int32, device=dev)
        for i, t in enumerate(rows):
            tables[i, : len(t)] = t.to(torch.int32)
        lens = torch.tensor([n for _, n, _ in batch], dtype=torch.int32, device=dev)
        reqs = torch.tensor([req for req, _, _ in batch], device=dev)
        k, v = pool.kv(r, 0)
        tol = 2e-2 if pool.dtype == torch.float16 else 1e-4
        if row.kind == "mla":
            out, want = attention.mla_check(k, tables, lens, reqs, self._step, row, layer,
                                            self.num_q_heads_per_kv, row.rope_dim, pool.dtype)
        else:
            query = query_values(reqs, self._step, row.kv_heads * self.num_q_heads_per_kv, row.head_dim,
                                 pool.dtype)
            scale = 1.0 / math.sqrt(row.head_dim)
            assert v is not None
            out = attention.windowed(row, query, k, v, tables, lens, scale)
            want = torch.empty_like(out)
            for i, (req, n, s0) in enumerate(batch):
                positions = torch.arange(s0, n, device=dev)
                rq = torch.full_like(positions, req)
                kk = kv_values(rq, positions, layer, row.kv_heads, row.head_dim, pool.dtype, 0)
                vv = kv_values(rq, positions, layer, row.kv_heads, row.head_dim, pool.dtype, 1)
                want[i] = attend_one(query[i], kk, vv, scale)
        for i, (req, n, s0) in enumerate(batch):
            err = float((out[i].float() - want[i].float()).abs().max().item())
            self.max_abs_error = max(self.max_abs_error, err)
            self.attention_checks += 1
            if not err <= tol:
                raise ValidationError(
                    f"step {self._step}: attention of request {req} over positions [{s0}, {n}) "
                    f"({row.label}, layer {layer}) differs from the reference by {err:.3g} (tolerance {tol})")

    def _compare_split(self, engine: Any, running: int) -> None:
        simulated = np.asarray(engine.kv.current_split(engine), dtype=np.int64)
        measured = self.pool.measure().cpu().numpy()
        self.records.append(HybridStepRecord(self._step, engine.now, simulated, measured, running))
        if not np.array_equal(simulated, measured):
            labels = list(self.manager.labels)
            diffs = [f"{labels[i]} {CATEGORIES[c]}: simulated {int(simulated[i, c]):,}, "
                     f"measured {int(measured[i, c]):,}"
                     for i, c in zip(*np.nonzero(simulated != measured), strict=True)]
            raise ValidationError(f"step {self._step} (t={engine.now:.3f}s): the byte split differs: "
                                  + "; ".join(diffs[:6]))
