"""A hybrid model's KV pool in real memory, laid out the way each manager lays it.

The pool is one flat buffer of ``capacity`` bytes. A manager's *rows* (vLLM's KV
cache groups, Jenga's and the static partition's layer kinds, see
:mod:`fragsim.hybrid.base`) each number their blocks, and every layer ``j`` of row
``r`` finds block ``b`` at one byte address::

    address(r, j, b) = layer_base[r][j] + b * block_stride[r]

    manager           layer_base[r][j]                         block_stride[r]
    vllm-hybrid       j * num_blocks * page                    page
                      (layer slot j: one buffer shared by layer j of every group,
                       indexed by block id; a shorter group leaves its slots empty)
    jenga             j * layer_bytes[r]                       small page of r
                      (small page s sits at s * small: large page s // per, slot s % per)
    static-partition  region[r] + j * layer_bytes[r]           block of r
    paged-uniform     attention: offset of r in the uniform    uniform block
                      block + j * layer_bytes[r]
                      state: after the blocks, slot * state slot

One layer's page::

    attention   K [block_tokens, kv_heads, head_dim] then V [block_tokens, kv_heads, head_dim]
    mla         latent [block_tokens, kv_lora_rank + rope_dim]
    state       the layer's state bytes (conv, then SSM), then the page's padding

So K of one layer is a strided view ``[num_blocks, block_tokens, kv_heads,
head_dim]`` of the buffer whose block stride is the page stride, not
``block_tokens`` slots: the kernels take that stride.

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

from dataclasses import dataclass, replace
from typing import Any

import torch

from fragsim.hybrid.base import (
    CATEGORIES,
    FREE,
    INTERNAL,
    OUT_OF_WINDOW,
    PADDING,
    RESERVATION,
    TOKEN,
    HybridManager,
)
from fragsim.layers import STATE_KINDS, LayerSpec, StateShape
from gpu_backend.pool import ValidationError, kv_values

__all__ = ["HybridPool", "RowLayout", "ValidationError", "layout_of", "miniature", "state_bytes_values"]


# ------------------------------------------------------------------ a small model

def miniature(model: Any, *, num_layers: int | None = None, kv_heads: int = 2, head_dim: int = 16,
              scale: float = 1.0, dtype_bytes: int = 2, kv_lora_rank: int = 32,
              rope_dim: int = 8) -> Any:
    """``model`` with the same pattern of layer kinds, small enough for a test pool.

    The first ``num_layers`` layers are kept (default: the shortest prefix that holds
    every kind of the model, so each kind is on the device); attention layers get
    ``kv_heads × head_dim``, MLA a ``kv_lora_rank + rope_dim`` latent, Mamba and
    linear-attention states a few kilobytes of the same variant, and windows and
    chunks are multiplied by ``scale`` (the validator scales lengths by it too).
    """
    import dataclasses

    layers = model.layer_specs
    if num_layers is None:
        kinds = {la.label() for la in layers}
        seen: set[str] = set()
        num_layers = 0
        for la in layers:
            num_layers += 1
            seen.add(la.label())
            if seen == kinds:
                break
    if not 1 <= num_layers <= len(layers):
        raise ValueError(f"num_layers must be in [1, {len(layers)}] for {model.name}, got {num_layers}")
    small = tuple(_small_layer(la, kv_heads, head_dim, scale, kv_lora_rank, rope_dim)
                  for la in layers[:num_layers])
    small = tuple(la if la.kind != "shared" or (la.target or 0) < num_layers
                  else replace(la, target=0) for la in small)
    return dataclasses.replace(model, name=f"{model.name} (miniature)", num_layers=num_layers,
                               num_kv_heads=kv_heads, head_dim=head_dim, layers=small,
                               dtype_bytes=dtype_bytes, kv_cache_dtype="auto",
                               max_position_embeddings=max(16, int(model.max_position_embeddings * scale)))


def _small_layer(la: LayerSpec, kv_heads: int, head_dim: int, scale: float, rank: int,
                 rope: int) -> LayerSpec:
    if la.kind in ("full", "sliding", "chunked"):
        window = None if la.window is None else max(2, round(la.window * scale))
        chunk = None if la.chunk is None else max(2, round(la.chunk * scale))
        return replace(la, num_kv_heads=kv_heads, head_dim=head_dim, window=window, chunk=chunk)
    if la.kind == "mla":
        return replace(la, kv_lora_rank=rank, qk_rope_head_dim=rope)
    if la.kind in STATE_KINDS and la.state is not None:
        s = la.state
        small: dict[str, StateShape] = {
            "mamba1": replace(s, intermediate_size=16, state_size=8),
            "mamba2": replace(s, intermediate_size=32, state_size=16, n_groups=1, num_heads=4, head_dim=8),
            "gdn": replace(s, num_heads=2, head_dim=8, num_v_heads=2, v_head_dim=8),
        }
        return replace(la, state=small[s.variant])
    return la


# ------------------------------------------------------------------ layouts

@dataclass(frozen=True)
class RowLayout:
    """Where one row's layers live in the buffer, and what their pages hold."""

    kind: str
    label: str
    num_ids: int                    # block ids the row draws from: 0 .. num_ids − 1
    block_tokens: int               # attention: positions per block (state rows: 0)
    block_stride: int               # bytes between block b and b + 1 of one layer
    layer_base: tuple[int, ...]     # per real layer: the byte address of its block 0
    layer_ids: tuple[int, ...]      # per real layer: a number of its own (values depend on it)
    token_bytes: int                # bytes one position costs the row (all its layers)
    state_bytes: int                # state rows: one sequence's state bytes (all its layers)
    padding_per_block: int          # bytes of a held block no real layer uses
    window: int | None = None
    chunk: int | None = None
    kv_heads: int = 0
    head_dim: int = 0               # attention: head_dim; mla: kv_lora_rank + rope_dim
    rope_dim: int = 0               # mla: the rotary part of the latent

    @property
    def is_state(self) -> bool:
        return self.kind in STATE_KINDS

    @property
    def layer_state_bytes(self) -> int:
        return self.state_bytes // len(self.layer_base)

    def window_start(self, computed: torch.Tensor) -> torch.Tensor:
        """First position the next token reads, per entry of ``computed``."""
        if self.kind == "sliding":
            assert self.window is not None
            return (computed - self.window + 1).clamp_min(0)
        if self.kind == "chunked":
            assert self.chunk is not None
            return torch.div(computed, self.chunk, rounding_mode="floor") * self.chunk
        return torch.zeros_like(computed)


@dataclass(frozen=True)
class Layout:
    """Every row's place in a ``capacity``-byte buffer, and the manager's own units."""

    manager: str
    capacity: int
    rows: tuple[RowLayout, ...]
    fixed_padding: int              # bytes in no unit at all (vLLM's null block, remainders)
    extra: dict[str, Any]           # what the free-memory rule of the manager needs


def layout_of(manager: HybridManager, model: Any, tp: int = 1) -> Layout:
    """The byte layout of ``manager``'s pool for ``model``'s layers on one rank."""
    name = manager.placement_name
    specs = _layers_by_row(manager, model)
    rows: list[RowLayout] = []
    extra: dict[str, Any] = {}
    if name == "vllm-hybrid":
        plan = manager.plan  # type: ignore[attr-defined]
        page = plan.page_size_bytes
        n = plan.num_gpu_blocks
        for row, g, layers in zip(manager.rows, plan.groups, specs, strict=True):
            if g.page.page_size_bytes != page:
                raise ValueError(f"group {row.label}: page of {g.page.page_size_bytes} bytes, "
                                 f"the pool's is {page}")
            rows.append(_row(row, layers, n, page, tuple(j * n * page for j in range(len(layers))), model))
        fixed = manager.capacity - (n - 1) * plan.bytes_per_block
        extra = {"num_blocks": n, "bytes_per_block": plan.bytes_per_block}
    elif name == "jenga":
        per = manager.per_large  # type: ignore[attr-defined]
        for row, p, layers in zip(manager.rows, per, specs, strict=True):
            n = manager.num_large * p  # type: ignore[attr-defined]
            lb = _layer_bytes(row)
            rows.append(_row(row, layers, n, row.block_bytes, tuple(j * lb for j in range(len(layers))), model))
        fixed = manager.capacity - manager.num_large * manager.large_page_bytes  # type: ignore[attr-defined]
        extra = {"num_large": manager.num_large, "large": manager.large_page_bytes,  # type: ignore[attr-defined]
                 "per_large": list(per)}
    elif name == "static-partition":
        region = 0
        for row, n, layers in zip(manager.rows, manager.num_blocks, specs, strict=True):  # type: ignore[attr-defined]
            lb = _layer_bytes(row)
            rows.append(_row(row, layers, n, row.block_bytes,
                             tuple(region + j * lb for j in range(len(layers))), model))
            region += n * row.block_bytes
        fixed = manager.capacity - region
    elif name == "paged-uniform":
        m: Any = manager
        uniform, n_blocks = m.uniform_block_bytes, m.num_blocks
        att_off, state_off = 0, n_blocks * uniform
        for row, layers in zip(manager.rows, specs, strict=True):
            lb = _layer_bytes(row)
            if row.is_state:
                rows.append(_row(row, layers, m.num_state_slots, m.state_slot_bytes,
                                 tuple(state_off + j * lb for j in range(len(layers))), model))
                state_off += row.block_bytes
            else:
                rows.append(_row(row, layers, n_blocks, uniform,
                                 tuple(att_off + j * lb for j in range(len(layers))), model))
                att_off += row.block_bytes
        fixed = manager.capacity - n_blocks * uniform - m.num_state_slots * m.state_slot_bytes
        extra = {"num_blocks": n_blocks, "uniform": uniform, "num_state_slots": m.num_state_slots}
    else:
        raise ValueError(f"no device layout for manager {manager.name!r} ({name})")
    return Layout(name, manager.capacity, tuple(rows), fixed, extra)


def _layers_by_row(manager: HybridManager, model: Any) -> list[list[tuple[int, LayerSpec]]]:
    """The model's (index, layer) pairs each row holds, in row order."""
    specs = model.layer_specs
    if manager.placement_name == "vllm-hybrid":
        return [[(i, specs[i]) for i in g.layers] for g in manager.plan.groups]  # type: ignore[attr-defined]
    by_label: dict[str, list[tuple[int, LayerSpec]]] = {}
    for i, la in enumerate(specs):
        if la.kind != "shared":
            by_label.setdefault(la.label(), []).append((i, la))
    out = []
    for row in manager.rows:
        layers = by_label.get(row.label)
        if layers is None or len(layers) != row.num_layers:
            raise ValueError(f"row {row.label!r}: the model has no {row.num_layers} layers of that kind")
        out.append(layers)
    return out


def _layer_bytes(row: Any) -> int:
    """One real layer's bytes in one block of ``row``."""
    if row.is_state:
        return row.state_bytes // row.num_layers
    return row.block_tokens * (row.token_bytes // row.num_layers)


def _row(row: Any, layers: list[tuple[int, LayerSpec]], num_ids: int, stride: int,
         bases: tuple[int, ...], model: Any) -> RowLayout:
    first = layers[0][1]
    width = first.head_size() if first.kind == "mla" else first.head_dim
    return RowLayout(kind=row.kind, label=row.label, num_ids=num_ids, block_tokens=row.block_tokens,
                     block_stride=stride, layer_base=bases, layer_ids=tuple(i for i, _ in layers),
                     token_bytes=row.token_bytes, state_bytes=row.state_bytes,
                     padding_per_block=row.padding_per_block, window=row.window, chunk=row.chunk,
                     kv_heads=first.num_kv_heads if first.kind != "mla" else 1, head_dim=width,
                     rope_dim=first.qk_rope_head_dim)


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
                top = base + (row.num_ids - 1) * row.block_stride + _layer_bytes_of(row, self.elt)
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


def _layer_bytes_of(row: RowLayout, elt: int) -> int:
    if row.is_state:
        return row.layer_state_bytes
    return row.block_tokens * row.token_bytes // len(row.layer_base)
