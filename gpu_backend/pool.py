"""A KV pool of real tensors, with the bookkeeping kept on the device too.

::

    k, v      [num_layers, num_slots, num_kv_heads, head_dim]   the KV cache itself
    owner     [num_slots]  request id holding the slot, -1 when free
    position  [num_slots]  position of the slot in its request's sequence, -1 when free
    final     [num_slots]  final length (prompt + output) of the owning request
    written   [num_slots]  True once that position's K/V has been stored

Every stored value is a deterministic function of (request, position, layer)
(:func:`kv_values`), so any slot can be checked against a regenerated value and an
overlap, a stale block or a lost write shows up as a wrong number. The measured
memory split (:meth:`KVPool.measure`) comes from these tensors by torch
reductions, never from the simulator's own counters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class ValidationError(AssertionError):
    """The device disagrees with the simulator (or with itself)."""


def kv_values(req: torch.Tensor, position: torch.Tensor, layer: int, num_kv_heads: int,
              head_dim: int, dtype: torch.dtype, which: int) -> torch.Tensor:
    """K (``which=0``) or V (``which=1``) of tokens ``(req[i], position[i])`` at ``layer``.

    Values lie in [-1, 1] and differ between any two (request, position) pairs of a
    run, so a slot holding someone else's token fails the comparison.
    """
    lanes = torch.arange(num_kv_heads * head_dim, device=req.device, dtype=torch.float64)
    seed = (req.to(torch.float64) * 7919.0 + position.to(torch.float64) * 1.618033988749
            + layer * 104.729 + which * 0.5)
    out = torch.sin(seed[:, None] * (1.0 + lanes * 0.0137) + lanes * 0.31)
    return out.reshape(-1, num_kv_heads, head_dim).to(dtype)


def query_values(req: torch.Tensor, step: int, num_q_heads: int, head_dim: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """A decode query per request for a given step, deterministic as well."""
    lanes = torch.arange(num_q_heads * head_dim, device=req.device, dtype=torch.float64)
    seed = req.to(torch.float64) * 3.3 + step * 0.071
    return torch.cos(seed[:, None] + lanes * 0.173).reshape(-1, num_q_heads, head_dim).to(dtype)


@dataclass(frozen=True)
class MeasuredSplit:
    token_states: int
    reservation: int
    internal_fragmentation: int
    free: int
    owned: int


class KVPool:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device: str | torch.device = "cpu") -> None:
        if min(num_layers, num_slots, num_kv_heads, head_dim) < 1:
            raise ValueError("num_layers, num_slots, num_kv_heads and head_dim must all be >= 1")
        if dtype not in (torch.float16, torch.float32):
            raise ValueError(f"dtype must be float16 or float32, got {dtype}")
        self.num_layers, self.num_slots = num_layers, num_slots
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.device = torch.device(device)
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.owner = torch.full((num_slots,), -1, dtype=torch.int64, device=self.device)
        self.position = torch.full((num_slots,), -1, dtype=torch.int64, device=self.device)
        self.final = torch.zeros(num_slots, dtype=torch.int64, device=self.device)
        self.written = torch.zeros(num_slots, dtype=torch.bool, device=self.device)

    def assign(self, slots: torch.Tensor, req: int, positions: torch.Tensor, final: int) -> None:
        """Hand ``slots`` to ``req`` for ``positions``; they must be free."""
        if bool((self.owner[slots] >= 0).any()):
            taken = int(slots[self.owner[slots] >= 0][:1].item())
            raise ValidationError(f"request {req}: slot {taken} is already owned by "
                                 f"request {self.owner[taken].item()}")
        self.owner[slots] = req
        self.position[slots] = positions
        self.final[slots] = final
        self.written[slots] = False

    def release(self, slots: torch.Tensor) -> None:
        self.owner[slots] = -1
        self.position[slots] = -1
        self.final[slots] = 0
        self.written[slots] = False

    def write(self, slots: torch.Tensor, req: int | torch.Tensor, positions: torch.Tensor) -> None:
        """Store the K/V of ``req`` (one request, or one per slot) at ``positions`` into
        ``slots`` (all layers)."""
        reqs = torch.full_like(positions, req) if isinstance(req, int) else req
        wrong = self.owner[slots] != reqs
        if bool(wrong.any()):
            at = int(torch.nonzero(wrong)[0].item())
            bad = int(slots[at].item())
            raise ValidationError(f"request {int(reqs[at])}: writing slot {bad} owned by "
                                  f"{self.owner[bad].item()}")
        for layer in range(self.num_layers):
            self.k[layer, slots] = kv_values(reqs, positions, layer, self.num_kv_heads,
                                             self.head_dim, self.dtype, 0)
            self.v[layer, slots] = kv_values(reqs, positions, layer, self.num_kv_heads,
                                             self.head_dim, self.dtype, 1)
        self.written[slots] = True

    def verify(self, slots: torch.Tensor, req: int | torch.Tensor, layer: int,
               positions: torch.Tensor | None = None) -> int | None:
        """Index of the first slot whose stored K or V differs from the value regenerated
        for (request, position), or None. One request: its positions are 0, 1, ... unless
        given; many (one per slot): ``positions`` too."""
        if positions is None:
            positions = torch.arange(len(slots), device=self.device)
        reqs = torch.full_like(positions, req) if isinstance(req, int) else req
        want_k = kv_values(reqs, positions, layer, self.num_kv_heads, self.head_dim, self.dtype, 0)
        want_v = kv_values(reqs, positions, layer, self.num_kv_heads, self.head_dim, self.dtype, 1)
        bad = ((self.k[layer, slots] != want_k) | (self.v[layer, slots] != want_v)).flatten(1).any(1)
        if bool(bad.any()):
            return int(torch.nonzero(bad)[0].item())
        return None

    def measure(self) -> MeasuredSplit:
        """The four-way split, from the device tensors alone."""
        owned_mask = self.owner >= 0
        owned, written, internal = (int(x) for x in torch.stack([
            owned_mask.sum(), self.written.sum(),
            (owned_mask & (self.position >= self.final)).sum()]).tolist())   # one device sync
        return MeasuredSplit(written, owned - written - internal, internal, self.num_slots - owned, owned)

    def free_mask(self) -> torch.Tensor:
        return self.owner < 0

    def largest_free_run(self, start: int = 0, end: int | None = None) -> int:
        """Longest run of consecutive free slots in ``[start, end)``."""
        free = self.free_mask()[start:end].to(torch.int64)
        if free.numel() == 0 or not bool(free.any()):
            return 0
        # Index of the last non-free slot at or before each position; run = i - that.
        idx = torch.arange(free.numel(), device=free.device)
        last_taken = torch.where(free == 0, idx, torch.full_like(idx, -1)).cummax(0).values
        return int((idx - last_taken).max().item())

    def largest_aligned_free(self, top_blocks: list[tuple[int, int]]) -> int:
        """Largest power-of-two block, aligned to its size inside a top-level block, all free."""
        free = self.free_mask()
        best = 0
        for offset, size in top_blocks:
            order_size = size
            while order_size >= 1 and order_size > best:
                view = free[offset: offset + size].reshape(size // order_size, order_size)
                if bool(view.all(dim=1).any()):
                    best = order_size
                    break
                order_size //= 2
        return best

    def free_blocks(self, block_size: int, num_blocks: int) -> int:
        view = self.free_mask()[: num_blocks * block_size].reshape(num_blocks, block_size)
        return int(view.all(dim=1).sum().item())
