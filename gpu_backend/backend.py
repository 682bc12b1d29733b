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

import numpy as np
import torch

from fragsim.allocators import BlockTable, Extent
from fragsim.engine_views import live_sequences, memory_split
from gpu_backend.pool import KVPool, ValidationError, kv_values, query_values

__all__ = ["DeviceBackend", "StepRecord", "ValidationError"]


@dataclass
class _Tracked:
    slots: torch.Tensor      # slot of each owned position, in sequence order
    written: int             # positions stored on the device so far
    key: tuple[int, ...]     # the placement on the host (:func:`_placement_key`)


def _placement_key(place: Any) -> tuple[int, ...]:
    """A placement as host integers: an extent's (offset, length) with a leading -1, a
    block table's block ids. A grown placement's key extends its old key."""
    if isinstance(place, Extent):
        return (-1, place.offset, place.length)
    if isinstance(place, BlockTable):
        return tuple(place.block_ids)
    raise TypeError(f"unknown placement {place!r}")


def _extends(new: tuple[int, ...], old: tuple[int, ...]) -> bool:
    if new[:1] == (-1,):   # an extent grows in place: same offset, no shorter
        return old[:2] == new[:2] and new[2] >= old[2]
    return new[: len(old)] == old


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
        live = {s.req: s for s in live_sequences(engine)}
        self._sync_ownership(live)
        self._write_tokens(live)
        if self.corrupt is not None:
            self.corrupt(self, engine)
        if self._step % self.attention_every == 0:
            self._check_contents(live)
            self._check_attention(live)
        self._compare_split(engine, len(live))

    # ------------------------------------------------------------ placement

    def _slots_of(self, place: Any) -> torch.Tensor:
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
            place = self.allocator.placement(req)
            key = _placement_key(place)
            old = self._tracked.get(req)
            if old is not None and old.key == key:
                continue   # most steps: the placement did not move (compared on the host)
            if old is not None and not _extends(key, old.key):
                # Same request, a new placement: it was preempted and admitted again.
                self.pool.release(old.slots)
                old = None
            slots = self._slots_of(place)
            start = 0 if old is None else len(old.slots)
            if start < len(slots):
                new = slots[start:]
                positions = torch.arange(start, len(slots), device=self.pool.device)
                self.pool.assign(new, req, positions, seq.final)
            self._tracked[req] = _Tracked(slots, 0 if old is None else old.written, key)

    def _write_tokens(self, live: dict[int, Any]) -> None:
        runs = []   # (request, first position to write, end)
        for req, seq in live.items():
            t = self._tracked[req]
            if seq.filled < t.written:
                raise ValidationError(f"step {self._step}: request {req} shrank from "
                                      f"{t.written} to {seq.filled} stored tokens")
            if seq.filled > t.written:
                runs.append((req, t.written, seq.filled))
        if runs:
            slots = torch.cat([self._tracked[r].slots[a:b] for r, a, b in runs])
            self.pool.write(slots, *self._tokens(runs))
            for r, _, b in runs:
                self._tracked[r].written = b

    def _tokens(self, runs: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(request, position) of every token of the runs ``(request, start, end)``, on
        the device, built on the host and copied once."""
        lengths = np.array([b - a for _, a, b in runs])
        reqs = np.repeat([r for r, _, _ in runs], lengths)
        ends = np.cumsum(lengths)
        positions = np.arange(ends[-1]) - np.repeat(ends - lengths - [a for _, a, _ in runs], lengths)
        device = self.pool.device
        return torch.from_numpy(reqs).to(device), torch.from_numpy(positions).to(device)

    # ------------------------------------------------------------ checks

    def _check_contents(self, live: dict[int, Any]) -> None:
        runs = [(r, 0, self._tracked[r].written) for r in live if self._tracked[r].written]
        if not runs:
            return
        slots = torch.cat([self._tracked[r].slots[:n] for r, _, n in runs])
        reqs, positions = self._tokens(runs)
        for layer in self.attention_layers:
            bad = self.pool.verify(slots, reqs, layer, positions)
            self.content_checks += len(runs)
            if bad is not None:
                req, position, slot = int(reqs[bad]), int(positions[bad]), int(slots[bad])
                raise ValidationError(
                    f"step {self._step}: request {req} position {position} (slot {slot}, layer {layer}) "
                    f"holds the wrong K/V (slot owner on device: {int(self.pool.owner[slot].item())})")

    def _check_attention(self, live: dict[int, Any]) -> None:
        from gpu_backend import kernels

        reqs = [r for r, s in live.items() if s.decoding and s.filled > 0]
        if not reqs:
            return
        pool, device = self.pool, self.pool.device
        filled = [live[r].filled for r in reqs]
        lens = torch.tensor(filled, dtype=torch.int32, device=device)
        q = query_values(torch.tensor(reqs, device=device), self._step, self.num_q_heads,
                         pool.head_dim, pool.dtype)
        token_reqs, positions = self._tokens([(r, 0, n) for r, n in zip(reqs, filled, strict=True)])
        paged = self.allocator.placement_name in ("paged", "vmm")
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
            self._compare_attention(out, q, token_reqs, positions, filled, layer,
                                    [f"request {r}" for r in reqs])

    def _compare_attention(self, out: torch.Tensor, q: torch.Tensor, ids: torch.Tensor,
                           positions: torch.Tensor, filled: list[int], layer: int,
                           names: list[str]) -> None:
        """The kernel's ``out`` against the reference over K/V regenerated for every token
        (``ids``, ``positions``: the runs of ``filled`` tokens back to back), not read from
        the pool, so a wrong slot fails; one device sync for the whole batch."""
        from gpu_backend.reference import attend_runs

        pool = self.pool
        k = kv_values(ids, positions, layer, pool.num_kv_heads, pool.head_dim, pool.dtype, 0)
        v = kv_values(ids, positions, layer, pool.num_kv_heads, pool.head_dim, pool.dtype, 1)
        want = attend_runs(q, k, v, filled, pool.head_dim ** -0.5).float()
        errors = (out.float() - want).abs().flatten(1).amax(1).tolist()
        tol = 2e-2 if pool.dtype == torch.float16 else 1e-4
        for name, n, err in zip(names, filled, errors, strict=True):
            self.max_abs_error = max(self.max_abs_error, err)
            self.attention_checks += 1
            if not err <= tol:
                self.attention_failures += 1
                raise ValidationError(
                    f"step {self._step}: attention of {name} over {n} tokens (layer {layer}) "
                    f"differs from the reference by {err:.3g} (tolerance {tol})")

    def _measured_largest(self) -> int:
        a, pool = self.allocator, self.pool
        kind = a.placement_name
        if kind in ("paged", "vmm"):
            return pool.free_blocks(a.block_size, a.num_blocks) * a.block_size
        if kind == "static":   # an entry is allocatable when all its slots are free
            entries = pool.free_mask()[: a.num_entries * a.max_seq_len].view(a.num_entries, a.max_seq_len)
            return a.max_seq_len if bool(entries.all(dim=1).any()) else 0
        if kind == "buddy":
            return pool.largest_aligned_free(self._top_blocks)
        return pool.largest_free_run()

    def _compare_split(self, engine: Any, running: int) -> None:
        simulated = memory_split(engine)
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


# ------------------------------------------------------------------ block sharing

@dataclass
class _Shared:
    """What the device knows of one sequence of a sharing run."""

    req: int
    epoch: int                 # the request's preemption count when it was placed
    slots: torch.Tensor        # slot of each owned position, in sequence order
    content: torch.Tensor      # content id of each owned position (whose K/V it holds)
    stored: int                # leading positions that hold their K/V on the device


@dataclass
class SharedDeviceBackend(DeviceBackend):
    """The device side of a run with block sharing (samples, beams, prefix caching: :mod:`fragsim.kv.sharing`).

    A slot may have several holders, so the device keeps a reference count per slot
    (``ref``, recomputed from every live block table each step) beside the pool's
    owner (one of the holders), position (the same for all of them, or it is an
    error) and final length (the largest of theirs: a slot is internal
    fragmentation only when no holder will ever fill it).

    What a position holds is a *content id*: a prompt position the request's own
    id, or, for a block the prefix cache keys, an id of that key (equal prefixes,
    equal K/V); a generated position the id of the sequence that generated it. A
    forked sequence inherits its parent's ids for the positions it shares; a cache
    hit finds the ids of the prompt that computed the block. Each step:

    1. ownership: holders and reference counts from the block tables; a slot that
       lost its last holder is released (its K/V stays: a freed cached block must
       still hold its prefix), a prefix-cache hit takes its slots *as stored*;
    2. every sequence writes the positions it produced itself;
    3. copy-on-write, on the device: a sequence whose block at index ``i`` is not
       the one it had (or, just forked, not its parent's) gets the old block's
       stored positions copied into the new one once they are all written (a
       sample's copy of the prompt's last block waits for the prompt); the copies
       so derived must be the allocator's own copy log, pair for pair;
    4. every position of every sequence must hold the K/V of its content id, and
       decode attention reads them through the block tables.

    A wrong reference count, a copy that did not happen, a write into a shared
    block or a stale cache hit therefore shows up as a wrong K/V or a split that
    differs from the simulation.
    """

    copies_done: int = 0
    copies_logged: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.allocator.log_copies = True  # the allocator says which blocks it copied
        self.ref = torch.zeros(self.pool.num_slots, dtype=torch.int64, device=self.pool.device)
        self._seqs: dict[int, _Shared] = {}
        # copies waiting for their source: (sequence, its epoch, src slot, dst slot, positions)
        self._pending: list[tuple[int, int, int, int, int]] = []
        self._content_ids: dict[int, int] = {}

    def after_step(self, engine: Any) -> None:
        self._step += 1
        live = {s.seq_id: s for s in live_sequences(engine)}
        forks = list(engine.fork_log or ())
        if engine.fork_log is not None:
            engine.fork_log.clear()
        logged = self.allocator.take_copies()
        derived = self._sync(engine, live, forks)
        if sorted(derived) != sorted(p for p in logged if self._holds_dst(p[1])):
            raise ValidationError(f"step {self._step}: copies from the block tables {sorted(derived)} "
                                  f"but the allocator logged {sorted(logged)}")
        self.copies_logged += len(logged)
        self._write(live)
        self._run_copies()
        if self.corrupt is not None:
            self.corrupt(self, engine)
        self._check_shared_contents(live)
        if self._step % self.attention_every == 0:
            self._check_shared_attention(live)
        self._compare_split(engine, len(live))

    # ------------------------------------------------------------ content ids

    def _content_of(self, engine: Any, req: int, seq: int, start: int, end: int) -> torch.Tensor:
        """Content ids of positions ``[start, end)`` that ``seq`` of ``req`` produces itself."""
        prompt = int(engine.requests.prompt[req])
        ids = torch.full((max(0, end - start),), seq, dtype=torch.int64)
        if start < prompt:
            ids[: min(end, prompt) - start] = req
            if engine.kv.prefix is not None:
                B = self.allocator.block_size
                keys = engine.kv.prefix.keys(req, prompt)
                for q in range(start, min(end, len(keys) * B)):
                    key = keys[q // B]
                    ids[q - start] = self._content_ids.setdefault(key, 1_000_000 + len(self._content_ids))
        return ids.to(self.pool.device)

    def _holds_dst(self, block: int) -> bool:
        B = self.allocator.block_size
        return bool(self.ref[block * B].item() > 0)

    # ------------------------------------------------------------ ownership

    def _sync(self, engine: Any, live: dict[int, Any], forks: list[tuple[int, int, int]]
              ) -> list[tuple[int, int]]:
        B, device = self.allocator.block_size, self.pool.device
        old = self._seqs
        fork_of = {child: (parent, shared) for parent, child, shared in forks}
        new: dict[int, _Shared] = {}
        copies: list[tuple[int, int]] = []
        # Slots whose stored K/V survives the step: a sequence kept them, or a cache hit found them.
        keep = torch.zeros(self.pool.num_slots, dtype=torch.bool, device=device)
        hits: list[torch.Tensor] = []

        def cow(seq: int, epoch: int, before: torch.Tensor, after: torch.Tensor, history: int) -> None:
            """Blocks of ``before`` replaced in ``after`` are copies of their stored part."""
            for i in range(min(len(before), len(after)) // B):
                src, dst = int(before[i * B].item()) // B, int(after[i * B].item()) // B
                if src != dst:
                    copies.append((src, dst))
                    positions = min(B, history - i * B)
                    if positions > 0:
                        self._pending.append((seq, epoch, src * B, dst * B, positions))

        # Sequences placed earlier first: a fork's parent is known before its children.
        for seq in sorted(live, key=lambda s: (s in fork_of, s)):
            info = live[seq]
            slots = self._slots_of(self.allocator.placement(seq))
            epoch = int(engine.requests.preemptions[info.req])
            was = old.get(seq)
            if was is not None and was.epoch == epoch:
                cow(seq, epoch, was.slots, slots, was.stored)
                same = min(len(was.slots), len(slots))
                kept = was.slots[:same] == slots[:same]
                keep[slots[:same][kept]] = True
                content = torch.cat([was.content[: len(slots)],
                                     self._content_of(engine, info.req, seq, len(was.content), len(slots))])
                new[seq] = _Shared(info.req, epoch, slots, content, was.stored)
            elif seq in fork_of:
                parent, shared = fork_of[seq]
                continuing = parent in old and old[parent].epoch == epoch
                source = old[parent] if continuing else new[parent]
                inherited = source.slots[: -(-shared // B) * B]
                cow(seq, epoch, inherited, slots, shared)
                if continuing:  # (a parent placed this step has stored nothing yet)
                    same = min(len(inherited), len(slots))
                    keep[slots[:same][inherited[:same] == slots[:same]]] = True
                content = torch.cat([source.content[:shared],
                                     self._content_of(engine, info.req, seq, shared, len(slots))])
                new[seq] = _Shared(info.req, epoch, slots, content, shared)
            else:  # admitted (again): the prefix cache's positions are there already
                content = self._content_of(engine, info.req, seq, 0, len(slots))
                new[seq] = _Shared(info.req, epoch, slots, content, info.cached)
                hits.append(slots[: info.cached])
        self._seqs = new
        pool = self.pool
        if new:
            every = torch.cat([s.slots for s in new.values()])
            positions = torch.cat([torch.arange(len(s.slots), device=device) for s in new.values()])
            finals = torch.cat([torch.full((len(s.slots),), live[q].final, dtype=torch.int64, device=device)
                                for q, s in new.items()])
            owners = torch.cat([torch.full((len(s.slots),), s.req, dtype=torch.int64, device=device)
                                for s in new.values()])
        else:
            every = positions = finals = owners = torch.zeros(0, dtype=torch.int64, device=device)
        ref = torch.bincount(every, minlength=pool.num_slots)
        released = (self.ref > 0) & (ref == 0)
        pool.owner[released] = -1
        pool.position[released] = -1
        pool.final[released] = 0
        for hit in hits:
            keep[hit] = True
        # New to every holder (taken, copied into, or its holder readmitted): nothing stored yet.
        pool.written[released | ((ref > 0) & ~keep)] = False
        low = torch.full_like(ref, 1 << 40).scatter_reduce(0, every, positions, "amin")
        high = torch.full_like(ref, -1).scatter_reduce(0, every, positions, "amax")
        clash = (ref > 0) & (low != high)
        if bool(clash.any()):
            slot = int(torch.nonzero(clash)[0].item())
            raise ValidationError(f"step {self._step}: slot {slot} is held at positions "
                                  f"{int(low[slot])} and {int(high[slot])}")
        pool.owner[every] = owners
        pool.position[every] = positions
        pool.final.zero_()
        pool.final.scatter_reduce_(0, every, finals, "amax")
        self.ref = ref
        for hit in hits:
            pool.written[hit] = True  # a cache hit: stored by whoever computed it
        return copies

    def _write(self, live: dict[int, Any]) -> None:
        pool = self.pool
        for seq, s in self._seqs.items():
            filled = live[seq].filled
            if filled < s.stored:
                if live[seq].decoding:
                    raise ValidationError(f"step {self._step}: sequence {seq} shrank from {s.stored} "
                                          f"to {filled} stored tokens")
                continue  # a prefilling group's sample: its prompt is its parent's to store
            if filled > s.stored:
                positions = torch.arange(s.stored, filled, device=pool.device)
                slots = s.slots[s.stored: filled]
                ids = s.content[s.stored: filled]
                for layer in range(pool.num_layers):
                    pool.k[layer, slots] = kv_values(ids, positions, layer, pool.num_kv_heads,
                                                     pool.head_dim, pool.dtype, 0)
                    pool.v[layer, slots] = kv_values(ids, positions, layer, pool.num_kv_heads,
                                                     pool.head_dim, pool.dtype, 1)
                pool.written[slots] = True
                s.stored = filled

    def _run_copies(self) -> None:
        """Copy-on-write on the device, once the source's positions are all stored."""
        pool, waiting = self.pool, []
        for seq, epoch, src, dst, positions in self._pending:
            s = self._seqs.get(seq)
            if s is None or s.epoch != epoch or not bool((s.slots == dst).any()):
                continue  # its sequence is gone (preempted, maybe in the step that copied)
            if not bool(pool.written[src: src + positions].all()):
                waiting.append((seq, epoch, src, dst, positions))
                continue
            pool.k[:, dst: dst + positions] = pool.k[:, src: src + positions]
            pool.v[:, dst: dst + positions] = pool.v[:, src: src + positions]
            pool.written[dst: dst + positions] = True
            self.copies_done += 1
        self._pending = waiting

    # ------------------------------------------------------------ checks

    def _check_shared_contents(self, live: dict[int, Any]) -> None:
        pool = self.pool
        seqs = [(seq, s, live[seq].filled) for seq, s in self._seqs.items() if live[seq].filled]
        if not seqs:
            return
        slots = torch.cat([s.slots[:n] for _, s, n in seqs])
        ids = torch.cat([s.content[:n] for _, s, n in seqs])
        _, positions = self._tokens([(seq, 0, n) for seq, _, n in seqs])
        for layer in self.attention_layers:
            want_k = kv_values(ids, positions, layer, pool.num_kv_heads, pool.head_dim, pool.dtype, 0)
            want_v = kv_values(ids, positions, layer, pool.num_kv_heads, pool.head_dim, pool.dtype, 1)
            bad = ((pool.k[layer, slots] != want_k) | (pool.v[layer, slots] != want_v)
                   | ~pool.written[slots][:, None, None]).flatten(1).any(1)
            self.content_checks += len(seqs)
            if bool(bad.any()):
                first = int(torch.nonzero(bad)[0].item())
                i = int(np.searchsorted(np.cumsum([n for _, _, n in seqs]), first, side="right"))
                seq, s, _ = seqs[i]
                at, slot = int(positions[first]), int(slots[first])
                raise ValidationError(
                    f"step {self._step}: sequence {seq} (request {s.req}) position {at} "
                    f"(slot {slot}, layer {layer}, {int(self.ref[slot])} holders) "
                    "holds the wrong K/V")

    def _check_shared_attention(self, live: dict[int, Any]) -> None:
        from gpu_backend import kernels

        seqs = [q for q, s in live.items() if s.decoding and s.filled > 0]
        if not seqs:
            return
        pool, device, B = self.pool, self.pool.device, self.allocator.block_size
        filled = [live[q].filled for q in seqs]
        lens = torch.tensor(filled, dtype=torch.int32, device=device)
        q = query_values(torch.tensor(seqs, device=device), self._step, self.num_q_heads,
                         pool.head_dim, pool.dtype)
        tables = [self.allocator.placement(s).block_ids for s in seqs]
        table = torch.zeros((len(seqs), max(len(t) for t in tables)), dtype=torch.int32, device=device)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        ids = torch.cat([self._seqs[seq].content[:n] for seq, n in zip(seqs, filled, strict=True)])
        _, positions = self._tokens([(seq, 0, n) for seq, n in zip(seqs, filled, strict=True)])
        scale = pool.head_dim ** -0.5
        for layer in self.attention_layers:
            out = kernels.paged_decode_attention(q, pool.k[layer], pool.v[layer], table, lens, B, scale=scale)
            self._compare_attention(out, q, ids, positions, filled, layer,
                                    [f"sequence {seq}" for seq in seqs])
