"""A hybrid model's KV pool as each manager lays it out in one byte buffer, and the
small models the validator lays out that way.

The pool is one flat buffer of ``capacity`` bytes. A manager's *rows* (vLLM's KV
cache groups, Jenga's and the static partition's layer kinds, see
:mod:`fragsim.hybrid.manager`) each number their blocks, and every layer ``j`` of row
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
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from fragsim.hybrid.manager import HybridManager
from fragsim.kinds import rule_of
from fragsim.layers import STATE_KINDS, LayerSpec, StateShape

__all__ = ["Layout", "RowLayout", "layout_of", "miniature"]


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

    @property
    def layer_bytes(self) -> int:
        """One real layer's bytes in one block (K and V of its positions, or its state)."""
        if self.is_state:
            return self.layer_state_bytes
        return self.block_tokens * self.token_bytes // len(self.layer_base)

    def window_start(self, computed: torch.Tensor) -> torch.Tensor:
        """First position the next token reads, per entry of ``computed`` (the kind's rule)."""
        return rule_of(self.kind, self.window, self.chunk).skipped(computed)


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
