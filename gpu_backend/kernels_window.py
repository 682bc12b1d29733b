"""Paged decode attention restricted to a window: sliding windows and chunked local attention.

A sequence of length L has its query at position L - 1 and attends to [lo, L)::

    full       lo = 0
    sliding    lo = max(0, L - W)            the last W positions, the query's own included
    chunked    lo = ((L - 1) // C) * C       its own chunk of C positions (Llama 4)

    L = 11, block_size = 4, W = 6 (sliding): lo = 5

        position:  0  1  2  3 | 4  5  6  7 | 8  9  10
        attended:  .  .  .  . | .  x  x  x | x  x  x
        entry:     table[0]   | table[1]   | table[2]
                   freed: -1 or reused, never read

    chunked, C = 8: lo = 8, so table[0] and table[1] are never read

Hybrid allocators free the blocks that lie wholly before ``lo`` and reuse them for
other sequences, so their block-table entries may be -1 or point at someone else's
tokens. The kernel computes ``lo`` itself from ``seq_lens`` and reads no table entry
of a block that ends at or before it. Tiles stay aligned to multiples of ``BLOCK_N``
(so a tile still lies in one block when ``BLOCK_N`` divides ``block_size``): the first
tile starts at ``lo`` rounded down and masks the positions before ``lo``::

    sliding above, BLOCK_N = 4:  tiles [4, 8) (position 4 masked), [8, 12);
                                 flash-decoding splits cut [4, L), not [0, L)

One kernel serves the three kinds through the ``WINDOW_KIND`` constexpr; everything
else (GQA groups, the online softmax, flash-decoding splits and their merge, the shape
checks and the tuning plan) is that of :mod:`gpu_backend.kernels`.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import triton
import triton.language as tl

from fragsim.kinds import rule_of
from gpu_backend.kernels import (
    _attend_tile,
    _check_index,
    _check_lens,
    _check_qkv,
    _combine_splits,
    _combine_splits_kernel,
    _Plan,
    _plan,
    _split_buffers,
    _store_group,
    _strides,
)

FULL, SLIDING, CHUNKED = 0, 1, 2
_KIND_NAMES = {FULL: "full", SLIDING: "sliding", CHUNKED: "chunked"}


# --------------------------------------------------------------------------- kernel


@triton.jit
def _window_start(seq_len, window, chunk, WINDOW_KIND: tl.constexpr):
    """First position the query at ``seq_len - 1`` attends to."""
    if WINDOW_KIND == 1:
        lo = tl.maximum(seq_len - window, 0)
    elif WINDOW_KIND == 2:
        lo = ((seq_len - 1) // chunk) * chunk
    else:
        lo = seq_len * 0
    return lo


@triton.jit
def _window_split_range(lo, seq_len, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tile range [start, end) of one split of [lo rounded down to BLOCK_N, seq_len).

    Split 0 always holds ``lo``; trailing splits may be empty.
    """
    first = (lo // BLOCK_N) * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * chunk
    return start, tl.minimum(start + chunk, seq_len)


@triton.jit
def _window_block_ids(table_ptr, tile, pos, lo, end, BLOCK_SIZE: tl.constexpr,
                      TILE_IN_BLOCK: tl.constexpr):
    """Block ids of the tile at ``tile``; entries of positions outside [lo, end) are not read.

    With TILE_IN_BLOCK the tile's one block holds ``max(tile, lo)`` (tiles are aligned
    to BLOCK_N, which divides BLOCK_SIZE), so it is inside the window.
    """
    if TILE_IN_BLOCK:
        ids = tl.load(table_ptr + tile // BLOCK_SIZE, mask=tile < end, other=0)
    else:
        ids = tl.load(table_ptr + pos // BLOCK_SIZE, mask=(pos >= lo) & (pos < end), other=0)
    return ids.to(tl.int64)


@triton.jit
def _window_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, m_ptr, l_ptr, block_tables_ptr, seq_lens_ptr,
    qk_scale, num_q_heads, stride_bt, stride_kb, stride_vb, window, chunk,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_IN_BLOCK: tl.constexpr,
    WINDOW_KIND: tl.constexpr, BLOCK_STRIDED: tl.constexpr,
):
    """Grid (batch, num_kv_heads, NUM_SPLITS); WINDOW_KIND 0 full, 1 sliding, 2 chunked.

    ``window`` (sliding) and ``chunk`` (chunked) are read only by their kind. With
    BLOCK_STRIDED, position ``p`` of block ``b`` is at ``b * stride_kb + (p % BLOCK_SIZE)
    * stride_ks`` (a hybrid pool's pages, ``stride_kb`` the page stride); without, at slot
    ``b * BLOCK_SIZE + p % BLOCK_SIZE`` of a flat cache (fewer live 64-bit offsets: the
    fp32 d128 tiles spill on sm_90 with the strided form).
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q_heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = _window_start(seq_len, window, chunk, WINDOW_KIND)
    start, end = _window_split_range(lo, seq_len, split, NUM_SPLITS, BLOCK_N)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    block_ids = _window_block_ids(table_ptr, start, start + offs_n, lo, end, BLOCK_SIZE,
                                  TILE_IN_BLOCK)
    for tile in range(start, end, BLOCK_N):
        pos = tile + offs_n
        valid = (pos >= lo) & (pos < end)
        if BLOCK_STRIDED:
            within = pos % BLOCK_SIZE
            k_rows = block_ids * stride_kb + within * stride_ks
            v_rows = block_ids * stride_vb + within * stride_vs
        else:
            slots = block_ids * BLOCK_SIZE + pos % BLOCK_SIZE
            k_rows = slots * stride_ks
            v_rows = slots * stride_vs
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + k_rows[:, None] + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + v_rows[:, None] + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        # Prefetch the next tile's ids (see _paged_decode_kernel); it is past lo already.
        block_ids = _window_block_ids(table_ptr, tile + BLOCK_N, pos + BLOCK_N, lo, end,
                                      BLOCK_SIZE, TILE_IN_BLOCK)
        m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale,
                                     USE_DOT, DOT_PRECISION)
    _store_group(out_ptr, part_ptr, m_ptr, l_ptr, m_i, l_i, acc, seq, split, q_heads,
                 g_mask, offs_d, d_mask, stride_ob, stride_oh, num_q_heads, HEAD_DIM, NUM_SPLITS)


# --------------------------------------------------------------------------- wrappers


def sliding_window_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    window: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    use_dot: bool | None = None,
    num_warps: int = 4,
    validate: bool = True,
) -> torch.Tensor:
    """Paged decode attention over the last ``window`` positions: [max(0, L - window), L).

    Shapes and knobs are those of :func:`gpu_backend.kernels.paged_decode_attention`;
    block-table entries of blocks wholly before the window may hold anything (-1, or a
    block since given to another sequence). The caches may also be ``[num_blocks,
    block_size, kv_heads, head_dim]`` views with any block stride (the pages of a
    hybrid pool, :meth:`gpu_backend.hybrid_pool.HybridPool.kv`).
    """
    _check_span("window", window)
    return windowed_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, block_size,
                                     SLIDING, window, scale, out, num_splits=num_splits,
                                     block_n=block_n, use_dot=use_dot, num_warps=num_warps,
                                     validate=validate)


def chunked_local_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    chunk: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    use_dot: bool | None = None,
    num_warps: int = 4,
    validate: bool = True,
) -> torch.Tensor:
    """Paged decode attention within the query's chunk: [((L - 1) // chunk) * chunk, L).

    As :func:`sliding_window_decode_attention`, with Llama 4's chunked local attention.
    """
    _check_span("chunk", chunk)
    return windowed_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, block_size,
                                     CHUNKED, chunk, scale, out, num_splits=num_splits,
                                     block_n=block_n, use_dot=use_dot, num_warps=num_warps,
                                     validate=validate)


def windowed_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    kind: int,
    span: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    use_dot: bool | None = None,
    num_warps: int = 4,
    validate: bool = True,
) -> torch.Tensor:
    """The kernel for any kind: ``FULL`` (``span`` ignored), ``SLIDING`` (``span`` = window)
    or ``CHUNKED`` (``span`` = chunk)."""
    if kind not in _KIND_NAMES:
        raise ValueError(f"kind must be one of {sorted(_KIND_NAMES)} (full, sliding, chunked), "
                         f"got {kind!r}")
    if kind != FULL:
        _check_span("window" if kind == SLIDING else "chunk", span)
    k_flat, v_flat, num_slots, block_strides = _paged_caches(k_cache, v_cache, block_size)
    batch, num_q_heads, num_kv_heads = _check_qkv(q, k_flat, v_flat, out, seq_lens)
    _check_block_table_args(block_tables, block_size, batch, q.device)
    max_len = block_tables.shape[1] * block_size
    if validate and batch > 0:
        max_len = _check_window_block_tables(block_tables, seq_lens, block_size,
                                            num_slots, kind, span)
    plan = _window_plan(q, num_kv_heads, scale, _attended_len(kind, span, max_len), num_splits,
                        block_n, use_dot, num_warps)
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    part, m, l_s = _split_buffers(q, plan.num_splits, out)
    # The kind's unused size is 1 (never read).
    window = span if kind == SLIDING else 1
    chunk = span if kind == CHUNKED else 1
    _window_decode_kernel[(batch, num_kv_heads, plan.num_splits)](
        q, k_cache, v_cache, out, part, m, l_s, block_tables, seq_lens,
        plan.qk_scale, num_q_heads, block_tables.stride(0), *block_strides, window, chunk,
        *_strides_4d(q, k_cache, v_cache, out),
        **_window_meta(plan.meta, block_size, kind, k_cache.dim() == 4), num_warps=plan.num_warps,
        num_stages=2,
    )
    _combine_splits(part, m, l_s, out, plan.num_splits)
    return out


def _paged_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor, int, tuple[int, int]]:
    """A cache as ``[num_slots, kv_heads, head_dim]`` (block ``b`` holds slots ``b * block_size
    ..``) or as ``[num_blocks, block_size, kv_heads, head_dim]`` with any block stride
    (a page of a hybrid pool, K and V side by side). Returns per-slot views for the
    shape checks, the number of slots, and the block strides of K and V."""
    if k_cache.dim() != 4:
        return k_cache, v_cache, k_cache.shape[0], (block_size * k_cache.stride(0),
                                                    block_size * v_cache.stride(0))
    if v_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape "
                         f"{tuple(k_cache.shape)}")
    if k_cache.shape[1] != block_size:
        raise ValueError(f"a 4-d k_cache must be [num_blocks, block_size={block_size}, kv_heads, "
                         f"head_dim], got {tuple(k_cache.shape)}")
    # Slot 0 of every block: the per-position strides and shapes the checks read.
    return (k_cache[:, 0], v_cache[:, 0], k_cache.shape[0] * block_size,
            (k_cache.stride(0), v_cache.stride(0)))


def _strides_4d(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                out: torch.Tensor) -> tuple[int, ...]:
    """The per-slot strides of a 3-d or 4-d cache, as :func:`_strides` orders them."""
    if k_cache.dim() != 4:
        return _strides(q, k_cache, v_cache, out)
    return (q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1))


def _window_plan(q: torch.Tensor, num_kv_heads: int, scale: float | None, max_len: int | None,
                 num_splits: int | None, block_n: int | None, use_dot: bool | None,
                 num_warps: int) -> _Plan:
    """:func:`gpu_backend.kernels._plan`, with 32-token tiles for fp32 ``tl.dot`` at
    head_dim > 64: its 64-token default spills ~270 bytes on sm_80 there (ptxas)."""
    group = q.shape[1] // num_kv_heads
    dot = group > 1 if use_dot is None else use_dot
    if block_n is None and dot and q.dtype == torch.float32 and q.shape[2] > 64:
        block_n = 32
    return _plan(q, num_kv_heads, scale, max_len, num_splits, block_n, use_dot, num_warps)


def _window_meta(plan_meta: dict, block_size: int, kind: int, strided: bool = False) -> dict:
    """The kernel's constexprs: the plan's, plus the paging and window ones (``strided``:
    the caches are 4-d page views)."""
    return {**plan_meta, "BLOCK_SIZE": block_size,
            "TILE_IN_BLOCK": block_size % plan_meta["BLOCK_N"] == 0, "WINDOW_KIND": kind,
            "BLOCK_STRIDED": strided}


def _attended_len(kind: int, span: int, max_len: int | None) -> int | None:
    """Most positions one query attends to (for the default split count)."""
    if kind == FULL or max_len is None:
        return max_len
    return min(span, max_len)


# --------------------------------------------------------------------------- validation


def _check_span(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_block_table_args(block_tables: torch.Tensor, block_size: int, batch: int,
                           device: torch.device) -> None:
    """Shape, dtype, device and stride checks of a block table (no values read)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must have shape [batch={batch}, max_blocks_per_seq], "
                         f"got {tuple(block_tables.shape)}")
    _check_index(block_tables, "block_tables", tuple(block_tables.shape), device)
    if block_tables.stride(1) != 1:
        raise ValueError(f"block_tables rows must be contiguous, got strides {block_tables.stride()}")


def _window_starts(seq_lens: torch.Tensor, kind: int, span: int) -> torch.Tensor:
    """Per sequence, the first attended position (int64), as the kernel computes it."""
    rule = rule_of(_KIND_NAMES[kind], window=span, chunk=span)
    return rule.skipped(seq_lens.long() - 1)


def _check_window_block_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                              block_size: int, num_slots: int, kind: int, span: int) -> int:
    """Check the entries of blocks that overlap each window point inside the pool.

    Entries of blocks wholly before the window, or past the sequence, are not checked
    (the kernel never reads them). Returns max(seq_lens).
    """
    lens = seq_lens.long()
    first = torch.arange(block_tables.shape[1], device=lens.device) * block_size
    tokens_in_block = (lens[:, None] - first[None, :]).clamp(0, block_size)
    in_window = (tokens_in_block > 0) & (first[None, :] + block_size
                                         > _window_starts(seq_lens, kind, span)[:, None])
    last_slot = block_tables.long() * block_size + tokens_in_block - 1
    bad = in_window & ((block_tables < 0) | (last_slot >= num_slots))
    max_len, min_len, num_bad = (
        int(x) for x in torch.stack([lens.max(), lens.min(), bad.sum()]).tolist())
    _check_lens(min_len)
    if max_len > block_tables.shape[1] * block_size:
        raise ValueError(f"seq_lens up to {max_len} need more than block_tables.shape[1]="
                         f"{block_tables.shape[1]} blocks of {block_size}")
    if num_bad:
        seq, col = (int(x) for x in bad.nonzero()[0].tolist())
        raise ValueError(
            f"{num_bad} block_tables entries inside the {_KIND_NAMES[kind]} window point "
            f"outside the pool, first block_tables[{seq}, {col}]={int(block_tables[seq, col])}: "
            f"ids must be >= 0 with id * block_size + tokens used <= num_slots={num_slots} "
            f"(block_size={block_size})")
    return max_len


# --------------------------------------------------------------------------- ahead of time


def _aot_signature(fn: Any, constexprs: dict[str, Any], pointers: dict[str, str]) -> dict[str, str]:
    """Triton types of every argument of ``fn`` in order: the given pointer types,
    ``constexpr`` for the constexprs, ``fp32`` for ``qk_scale`` and ``i32`` for the rest
    (sizes and strides)."""
    return {name: "constexpr" if name in constexprs else pointers.get(
        name, "fp32" if name == "qk_scale" else "i32") for name in fn.arg_names}


def _aot_attrs(signature: dict[str, str]) -> dict[tuple[int, ...], list[list[Any]]]:
    """The divisibility a JIT launch of these shapes specialises on: tensors 16-byte
    aligned (torch allocations are) and strides multiples of 16 elements (head dims of
    64 and up); ``stride_bt`` (max blocks per sequence) and the sizes are left open.

    Without these hints the loads are not vectorised and the d128 tiles spill on sm_90.
    Pass as ``ASTSource(fn, signature, constexprs, attrs=attrs)``.
    """
    return {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(signature.items())
            if ty.startswith("*") or (name.startswith("stride_") and name != "stride_bt")}


def _aot_combine_variant(dtype: torch.dtype, head_dim: int, num_splits: int) -> dict[str, Any]:
    """The split merge the wrappers launch after a ``num_splits > 1`` kernel."""
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": triton.next_power_of_2(head_dim),
                  "NUM_SPLITS": num_splits, "BLOCK_S": triton.next_power_of_2(num_splits)}
    pointers = {"part_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32",
                "out_ptr": _TRITON_DTYPES[dtype]}
    signature = _aot_signature(_combine_splits_kernel, constexprs, pointers)
    return {"name": f"combine/{_DTYPE_NAMES[dtype]}/d{head_dim}/s{num_splits}",
            "fn": _combine_splits_kernel, "signature": signature, "constexprs": constexprs,
            "num_warps": 4, "num_stages": 3,  # the launch's default
            "attrs": _aot_attrs(signature)}


def aot_variants() -> list[dict[str, Any]]:
    """The windowed kernel's variants the validator and benchmarks launch, for compiling
    ahead of time: fp16/fp32, head_dim 64/128, GQA group 1/8, block_size 16, 1 and 4
    splits, sliding and chunked over flat caches (plus the split merges). The launches
    over a hybrid pool's pages are recorded from their callers
    (:mod:`gpu_backend.aot_launches`).

    Each entry: ``name``, ``fn`` (the ``@triton.jit`` function), ``signature`` (a Triton
    type for every argument in order, ``constexpr`` for the constexprs), ``constexprs``,
    ``num_warps``, ``num_stages``, and ``attrs`` (see :func:`_aot_attrs`). The constexprs
    come from the wrappers' own planning (:func:`_window_plan` with its default tile
    sizes and 4 warps); with one split the partial buffers are the output,
    as the wrappers pass them.
    """
    block_size, num_warps = 16, 4
    variants: list[dict[str, Any]] = []
    combines: dict[str, dict[str, Any]] = {}
    for kind, dtype, head_dim, group, num_splits in itertools.product(
            (SLIDING, CHUNKED), (torch.float16, torch.float32), (64, 128), (1, 8), (1, 4)):
        q = torch.empty(1, group, head_dim, dtype=dtype, device="meta")
        plan = _window_plan(q, 1, None, None, num_splits, None, None, num_warps)
        constexprs = _window_meta(plan.meta, block_size, kind)
        elem = _TRITON_DTYPES[dtype]
        part = "*fp32" if num_splits > 1 else elem
        pointers = {"q_ptr": elem, "k_ptr": elem, "v_ptr": elem, "out_ptr": elem,
                    "part_ptr": part, "m_ptr": part, "l_ptr": part,
                    "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32"}
        name = (f"{_KIND_NAMES[kind]}/{_DTYPE_NAMES[dtype]}/g{group}/d{head_dim}/bs{block_size}"
                f"/bn{constexprs['BLOCK_N']}/s{num_splits}")
        signature = _aot_signature(_window_decode_kernel, constexprs, pointers)
        variants.append({"name": name, "fn": _window_decode_kernel, "signature": signature,
                         "constexprs": constexprs, "num_warps": plan.num_warps, "num_stages": 2,
                         "attrs": _aot_attrs(signature)})
        if num_splits > 1:
            combine = _aot_combine_variant(dtype, head_dim, num_splits)
            combines[combine["name"]] = combine
    return variants + list(combines.values())


_TRITON_DTYPES = {torch.float16: "*fp16", torch.float32: "*fp32"}
_DTYPE_NAMES = {torch.float16: "fp16", torch.float32: "fp32"}
