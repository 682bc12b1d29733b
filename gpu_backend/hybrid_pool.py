"""A hybrid model's KV pool in real memory, and what the device knows of it.

The buffer is laid out by :mod:`gpu_backend.hybrid_layout` (vLLM's per-layer buffers,
Jenga's large pages, a pool per kind, paged-uniform's blocks then state slots).
What the device knows is kept on the device: per row and block id the owning
request (−1 free) and the block's logical index in the request, per position
whether its K/V was written, per state block the length whose state it holds.
:meth:`HybridPool.measure` rebuilds the manager's byte split, per row and
category, from those tensors alone (torch reductions; the layout gives only the
bytes a position, a state and a page cost).

Stored values are deterministic functions of (request, position, layer), and a
state of (request, computed length, layer), so any read can be checked against a
regenerated value.
"""

from __future__ import annotations

import torch

from fragsim.hybrid.groups import (
    CATEGORIES,
    FREE,
    INTERNAL,
    OUT_OF_WINDOW,
    PADDING,
    RESERVATION,
    TOKEN,
)
from gpu_backend.hybrid_layout import Layout
from gpu_backend.pool import ValidationError, kv_values

__all__ = ["HybridPool", "ValidationError", "state_bytes_values"]


# ------------------------------------------------------------------ values

def state_bytes_values(req: int, length: int, layer: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """The state bytes of ``req`` after ``length`` computed tokens at ``layer``: a state
    changes with every token, so a stale one (or another request's) differs."""
    lanes = torch.arange(nbytes, device=device, dtype=torch.int64)
    return ((lanes * 29 + req * 7919 + length * 104729 + layer * 131) % 251).to(torch.uint8)


# ------------------------------------------------------------------ the pool

class HybridPool:
    """The buffer, per-layer views into it, and the device's own bookkeeping."""

    def __init__(self, layout: Layout, dtype: torch.dtype = torch.float16,
                 device: str | torch.device = "cpu") -> None:
        if dtype not in (torch.float16, torch.float32):
            raise ValueError(f"dtype must be float16 or float32, got {dtype}")
        self.layout, self.dtype, self.device = layout, dtype, torch.device(device)
        self.elt = torch.tensor([], dtype=dtype).element_size()
        self.raw = torch.zeros(layout.capacity, dtype=torch.uint8, device=self.device)
        self._elems = self.raw[: layout.capacity // self.elt * self.elt].view(dtype)
        n_rows = len(layout.rows)
        self.owner = [torch.full((r.num_ids,), -1, dtype=torch.int64, device=self.device)
                      for r in layout.rows]
        self.index = [torch.full((r.num_ids,), -1, dtype=torch.int64, device=self.device)
                      for r in layout.rows]
        self.written = [torch.zeros((r.num_ids, max(1, r.block_tokens)), dtype=torch.bool, device=self.device)
                        for r in layout.rows]
        self.state_len = [torch.full((r.num_ids,), -1, dtype=torch.int64, device=self.device)
                          for r in layout.rows]
        self.req_computed = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.req_final = torch.zeros(0, dtype=torch.int64, device=self.device)
        assert n_rows == len(self.owner)
        for r, row in enumerate(layout.rows):
            for base in row.layer_base:
                if base % self.elt or row.block_stride % self.elt:
                    raise ValueError(f"row {row.label!r}: layer at byte {base}, stride {row.block_stride} "
                                     f"are not multiples of the {self.elt}-byte element")
                top = base + (row.num_ids - 1) * row.block_stride + row.layer_bytes
                if row.num_ids and top > layout.capacity:
                    raise ValueError(f"row {row.label!r} (layer at {base}) ends at byte {top} past the "
                                     f"{layout.capacity}-byte pool")
            del r

    # ------------------------------------------------------------ views

    def kv(self, r: int, j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K and V of layer ``j`` of attention row ``r`` as ``[num_ids, block_tokens,
        kv_heads, head_dim]`` views of the buffer (MLA: the latent ``[num_ids,
        block_tokens, 1, width]`` and None)."""
        row = self.layout.rows[r]
        if row.is_state:
            raise ValueError(f"row {row.label!r} holds states, not K/V")
        e = self.elt
        base, stride = row.layer_base[j] // e, row.block_stride // e
        per_pos = row.kv_heads * row.head_dim
        shape = (row.num_ids, row.block_tokens, row.kv_heads, row.head_dim)
        strides = (stride, per_pos, row.head_dim, 1)
        k = self._elems.as_strided(shape, strides, base)
        if row.kind == "mla":
            return k, None
        v = self._elems.as_strided(shape, strides, base + row.block_tokens * per_pos)
        return k, v

    def state(self, r: int, j: int, block: int) -> torch.Tensor:
        """The bytes of layer ``j``'s state in block ``block`` of state row ``r``."""
        row = self.layout.rows[r]
        start = row.layer_base[j] + block * row.block_stride
        return self.raw[start: start + row.layer_state_bytes]

    # ------------------------------------------------------------ ownership

    def set_request(self, req: int, computed: int, final: int) -> None:
        if req >= len(self.req_computed):
            size = max(req + 1, 2 * len(self.req_computed), 64)
            for name in ("req_computed", "req_final"):
                old = getattr(self, name)
                new = torch.zeros(size, dtype=torch.int64, device=self.device)
                new[: len(old)] = old
                setattr(self, name, new)
        self.req_computed[req] = computed
        self.req_final[req] = final

    def take(self, r: int, ids: torch.Tensor, req: int, indices: torch.Tensor) -> None:
        """Blocks ``ids`` of row ``r`` go to ``req`` as its blocks ``indices``; they must be free."""
        taken = self.owner[r][ids] >= 0
        if bool(taken.any()):
            bad = int(ids[taken][0].item())
            raise ValidationError(f"request {req}: block {bad} of {self.layout.rows[r].label} is already "
                                  f"held by request {int(self.owner[r][bad].item())}")
        self.owner[r][ids] = req
        self.index[r][ids] = indices
        self.written[r][ids] = False
        self.state_len[r][ids] = -1

    def give_back(self, r: int, ids: torch.Tensor) -> None:
        """Blocks go back; what they hold stays in memory until someone writes over it."""
        self.owner[r][ids] = -1
        self.index[r][ids] = -1
        self.written[r][ids] = False
        self.state_len[r][ids] = -1

    # ------------------------------------------------------------ writes and reads

    def write_tokens(self, r: int, req: int, ids: torch.Tensor, positions: torch.Tensor) -> None:
        """K/V of ``req`` at ``positions`` (held in blocks ``ids[p // B]``... given per
        position) into every layer of attention row ``r``."""
        row = self.layout.rows[r]
        B = row.block_tokens
        off = positions % B
        bad = self.owner[r][ids] != req
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0].item())
            raise ValidationError(f"request {req}: writing position {int(positions[i])} into block "
                                  f"{int(ids[i])} of {row.label} held by {int(self.owner[r][ids[i]])}")
        reqs = torch.full_like(positions, req)
        for j, layer in enumerate(row.layer_ids):
            k, v = self.kv(r, j)
            k[ids, off] = kv_values(reqs, positions, layer, row.kv_heads, row.head_dim, self.dtype, 0)
            if v is not None:
                v[ids, off] = kv_values(reqs, positions, layer, row.kv_heads, row.head_dim, self.dtype, 1)
        self.written[r][ids, off] = True

    def first_wrong_token(self, r: int, req: int, ids: torch.Tensor,
                          positions: torch.Tensor) -> tuple[int, int] | None:
        """(position, layer) of the first position whose K/V (any layer) differs from
        its regenerated value, or None."""
        row = self.layout.rows[r]
        off = positions % row.block_tokens
        reqs = torch.full_like(positions, req)
        for j, layer in enumerate(row.layer_ids):
            k, v = self.kv(r, j)
            bad = (k[ids, off] != kv_values(reqs, positions, layer, row.kv_heads, row.head_dim,
                                            self.dtype, 0)).flatten(1).any(1)
            if v is not None:
                bad |= (v[ids, off] != kv_values(reqs, positions, layer, row.kv_heads, row.head_dim,
                                                 self.dtype, 1)).flatten(1).any(1)
            if bool(bad.any()):
                return int(positions[torch.nonzero(bad)[0]].item()), layer
        return None

    def write_state(self, r: int, req: int, block: int, length: int) -> None:
        row = self.layout.rows[r]
        for j, layer in enumerate(row.layer_ids):
            self.state(r, j, block).copy_(state_bytes_values(req, length, layer, row.layer_state_bytes,
                                                             self.device))
        self.state_len[r][block] = length

    def state_is_intact(self, r: int, req: int, block: int, length: int) -> int | None:
        """None when every layer's state equals the regenerated one, else the layer."""
        row = self.layout.rows[r]
        for j, layer in enumerate(row.layer_ids):
            want = state_bytes_values(req, length, layer, row.layer_state_bytes, self.device)
            if not torch.equal(self.state(r, j, block), want):
                return layer
        return None

    # ------------------------------------------------------------ the split

    def measure(self) -> torch.Tensor:
        """``[rows + pool, categories]`` bytes, from the device's tensors alone."""
        lay = self.layout
        out = torch.zeros((len(lay.rows) + 1, len(CATEGORIES)), dtype=torch.int64, device=self.device)
        held_counts = []
        for r, row in enumerate(lay.rows):
            held = self.owner[r] >= 0
            n_held = held.sum()
            held_counts.append(n_held)
            out[r, PADDING] = n_held * row.padding_per_block
            if row.is_state:
                out[r, TOKEN] = n_held * row.state_bytes
                continue
            B = row.block_tokens
            owners = self.owner[r][held]
            pos = self.index[r][held][:, None] * B + torch.arange(B, device=self.device)[None, :]
            written = self.written[r][held]
            computed = self.req_computed[owners][:, None]
            final = self.req_final[owners][:, None]
            start = row.window_start(computed)
            tb = row.token_bytes
            out[r, TOKEN] = (written & (pos >= start)).sum() * tb
            out[r, OUT_OF_WINDOW] = (written & (pos < start)).sum() * tb
            out[r, RESERVATION] = (~written & (pos < final)).sum() * tb
            out[r, INTERNAL] = (~written & (pos >= final)).sum() * tb
        out[:, FREE] = self._free_bytes(held_counts)
        out[-1, PADDING] += lay.fixed_padding
        return out

    def _free_bytes(self, held: list[torch.Tensor]) -> torch.Tensor:
        lay, ex = self.layout, self.layout.extra
        free = torch.zeros(len(lay.rows) + 1, dtype=torch.int64, device=self.device)
        if lay.manager == "vllm-hybrid":
            # One id space for every group; block 0 is the null block.
            used = torch.zeros(ex["num_blocks"], dtype=torch.bool, device=self.device)
            for owner in self.owner:
                used |= owner >= 0
            free[-1] = (ex["num_blocks"] - 1 - used[1:].sum()) * ex["bytes_per_block"]
        elif lay.manager == "jenga":
            carved = torch.zeros(ex["num_large"], dtype=torch.bool, device=self.device)
            for r, (row, per) in enumerate(zip(lay.rows, ex["per_large"], strict=True)):
                mine = (self.owner[r] >= 0).view(ex["num_large"], per).any(dim=1)
                free[r] = (mine.sum() * per - held[r]) * row.block_stride
                carved |= mine
            free[-1] = (ex["num_large"] - carved.sum()) * ex["large"]
        elif lay.manager == "static-partition":
            for r, row in enumerate(lay.rows):
                free[r] = (row.num_ids - held[r]) * row.block_stride
        elif lay.manager == "paged-uniform":
            used = torch.zeros(ex["num_blocks"], dtype=torch.bool, device=self.device)
            for r, row in enumerate(lay.rows):
                if row.is_state:
                    free[r] = (row.num_ids - held[r]) * (row.state_bytes + row.padding_per_block)
                else:
                    used |= self.owner[r] >= 0
            free[-1] = (ex["num_blocks"] - used.sum()) * ex["uniform"]
        return free
