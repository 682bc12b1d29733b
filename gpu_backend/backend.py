"""Executes the engine's allocation decisions on a real KV pool, step by step.

The backend is an engine observer (``Engine(..., observer=backend)`` with exact
steps). It never decides a placement: after each step it reads the allocator's
placements and the engine's stored lengths and makes the device agree:

1. requests that no longer hold memory release their slots;
2. a request whose placement is new (admitted, or re-admitted after preemption)
   takes its slots; a grown one (paged) takes the new blocks' slots;
3. tokens stored since the last step are written (K/V of (request, position,
   layer)) through the slot mapping;
4. decode attention runs over the running batch with the Triton kernel of the
   layout (contiguous: base offset + length; paged: block table) and is compared
   with the PyTorch reference on K/V regenerated from scratch, not read from the
   pool, so a wrong slot fails;
5. the memory split is measured from the device tensors and compared exactly with
   the simulator's bookkeeping at the same instant.

Any disagreement raises :class:`ValidationError` naming the step, the request and,
where it applies, the position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fragsim.allocators import BlockTable, Extent
from gpu_backend.pool import KVPool, ValidationError, kv_values, query_values

__all__ = ["DeviceBackend", "StepRecord", "ValidationError"]


@dataclass
class _Tracked:
    slots: torch.Tensor      # slot of each owned position, in sequence order
    written: int             # positions stored on the device so far


@dataclass
class StepRecord:
    step: int
    time_s: float
    simulated: tuple[int, int, int, int]
    measured: tuple[int, int, int, int]
    simulated_largest: int
    measured_largest: int
    running: int


@dataclass
class DeviceBackend:
    pool: KVPool
    allocator: Any
    num_q_heads: int
    attention_every: int = 1           # run the attention and stored-K/V checks every N steps
    attention_layers: tuple[int, ...] = (0,)
    corrupt: Any = None                # test hook: callable(backend, engine) run before checks
    records: list[StepRecord] = field(default_factory=list)
    attention_checks: int = 0
    attention_failures: int = 0
    content_checks: int = 0
    max_abs_error: float = 0.0

    def __post_init__(self) -> None:
        self._tracked: dict[int, _Tracked] = {}
        self._step = 0
        cap = self.allocator.capacity
        if cap != self.pool.num_slots:
            raise ValueError(f"pool has {self.pool.num_slots} slots, allocator {cap}")
        self._top_blocks = _binary_decomposition(cap) if self.allocator.placement_name == "buddy" else []

    # ------------------------------------------------------------ observer

    def before_step(self, engine: Any, dt: float) -> None:
        """Nothing to do before a step: the device follows decisions once they took effect."""

    def after_step(self, engine: Any) -> None:
        self._step += 1
        live = {s.req: s for s in engine.live_sequences()}
        self._sync_ownership(live)
        self._write_tokens(live)
        if self.corrupt is not None:
            self.corrupt(self, engine)
        if self._step % self.attention_every == 0:
            self._check_contents(live)
            self._check_attention(live)
        self._compare_split(engine, len(live))

    # ------------------------------------------------------------ placement

    def _slots_of(self, req: int) -> torch.Tensor:
        place = self.allocator.placement(req)
        device = self.pool.device
        if isinstance(place, Extent):
            return torch.arange(place.offset, place.offset + place.length, device=device)
        if isinstance(place, BlockTable):
            blocks = torch.tensor(place.block_ids, dtype=torch.int64, device=device)
            within = torch.arange(place.block_size, device=device)
            return (blocks[:, None] * place.block_size + within[None, :]).flatten()
        raise TypeError(f"unknown placement {place!r}")

    def _sync_ownership(self, live: dict[int, Any]) -> None:
        for req in [r for r in self._tracked if r not in live]:
            self.pool.release(self._tracked.pop(req).slots)
        for req, seq in live.items():
            slots = self._slots_of(req)
            old = self._tracked.get(req)
            if old is not None and (len(slots) < len(old.slots)
                                    or not torch.equal(slots[: len(old.slots)], old.slots)):
                # Same request, a new placement: it was preempted and admitted again.
                self.pool.release(old.slots)
                old = None
            start = 0 if old is None else len(old.slots)
            if start < len(slots):
                new = slots[start:]
                positions = torch.arange(start, len(slots), device=self.pool.device)
                self.pool.assign(new, req, positions, seq.final)
            self._tracked[req] = _Tracked(slots, 0 if old is None else old.written)

    def _write_tokens(self, live: dict[int, Any]) -> None:
        for req, seq in live.items():
            t = self._tracked[req]
            if seq.filled < t.written:
                raise ValidationError(f"step {self._step}: request {req} shrank from "
                                      f"{t.written} to {seq.filled} stored tokens")
            if seq.filled > t.written:
                positions = torch.arange(t.written, seq.filled, device=self.pool.device)
                self.pool.write(t.slots[t.written: seq.filled], req, positions)
                t.written = seq.filled

    # ------------------------------------------------------------ checks

    def _check_contents(self, live: dict[int, Any]) -> None:
        for req in live:
            t = self._tracked[req]
            if t.written == 0:
                continue
            for layer in self.attention_layers:
                bad = self.pool.verify(t.slots[: t.written], req, layer)
                self.content_checks += 1
                if bad is not None:
                    slot = int(t.slots[bad].item())
                    raise ValidationError(
                        f"step {self._step}: request {req} position {bad} (slot {slot}, layer {layer}) "
                        f"holds the wrong K/V (slot owner on device: {int(self.pool.owner[slot].item())})")

    def _check_attention(self, live: dict[int, Any]) -> None:
        from gpu_backend import kernels
        from gpu_backend.reference import attend_one

        reqs = [r for r, s in live.items() if s.decoding and s.filled > 0]
        if not reqs:
            return
        pool, device = self.pool, self.pool.device
        lens = torch.tensor([live[r].filled for r in reqs], dtype=torch.int32, device=device)
        q = query_values(torch.tensor(reqs, device=device), self._step, self.num_q_heads,
                         pool.head_dim, pool.dtype)
        paged = self.allocator.placement_name == "paged"
        scale = pool.head_dim ** -0.5
        for layer in self.attention_layers:
            if paged:
                bs = self.allocator.block_size
                tables = [self.allocator.placement(r).block_ids for r in reqs]
                width = max(len(t) for t in tables)
                table = torch.zeros((len(reqs), width), dtype=torch.int32, device=device)
                for i, t in enumerate(tables):
                    table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
                out = kernels.paged_decode_attention(q, pool.k[layer], pool.v[layer], table, lens, bs, scale=scale)
            else:
                offsets = torch.tensor([self.allocator.placement(r).offset for r in reqs],
                                       dtype=torch.int32, device=device)
                out = kernels.contiguous_decode_attention(q, pool.k[layer], pool.v[layer], offsets, lens,
                                                          scale=scale)
            for i, req in enumerate(reqs):
                n = live[req].filled
                positions = torch.arange(n, device=device)
                rq = torch.full_like(positions, req)
                k = kv_values(rq, positions, layer, pool.num_kv_heads, pool.head_dim, pool.dtype, 0)
                v = kv_values(rq, positions, layer, pool.num_kv_heads, pool.head_dim, pool.dtype, 1)
                want = attend_one(q[i], k, v, scale).float()
                err = float((out[i].float() - want).abs().max().item())
                self.max_abs_error = max(self.max_abs_error, err)
                self.attention_checks += 1
                tol = 2e-2 if pool.dtype == torch.float16 else 1e-4
                if not err <= tol:
                    self.attention_failures += 1
                    raise ValidationError(
                        f"step {self._step}: attention of request {req} over {n} tokens (layer {layer}) "
                        f"differs from the reference by {err:.3g} (tolerance {tol})")

    def _measured_largest(self) -> int:
        a, pool = self.allocator, self.pool
        kind = a.placement_name
        if kind == "paged":
            return pool.free_blocks(a.block_size, a.num_blocks) * a.block_size
        if kind == "static":
            entries = [pool.largest_free_run(i * a.max_seq_len, (i + 1) * a.max_seq_len)
                       for i in range(a.num_entries)]
            return a.max_seq_len if any(e == a.max_seq_len for e in entries) else 0
        if kind == "buddy":
            return pool.largest_aligned_free(self._top_blocks)
        return pool.largest_free_run()

    def _compare_split(self, engine: Any, running: int) -> None:
        simulated = engine.memory_split()
        m = self.pool.measure()
        measured = (m.token_states, m.reservation, m.internal_fragmentation, m.free)
        largest_sim = self.allocator.largest_allocatable()
        largest_dev = self._measured_largest()
        self.records.append(StepRecord(self._step, engine.now, simulated, measured, largest_sim,
                                       largest_dev, running))
        if measured != simulated or largest_dev != largest_sim:
            raise ValidationError(
                f"step {self._step} (t={engine.now:.3f}s): simulated split {simulated}, largest "
                f"{largest_sim}; measured on device {measured}, largest {largest_dev}")


def _binary_decomposition(capacity: int) -> list[tuple[int, int]]:
    """Top-level buddy blocks: capacity's set bits, largest first, from offset 0."""
    out, offset = [], 0
    for bit in range(capacity.bit_length() - 1, -1, -1):
        size = 1 << bit
        if capacity & size:
            out.append((offset, size))
            offset += size
    return out
