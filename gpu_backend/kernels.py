"""Decode attention over the KV pool with Triton: contiguous and paged (block-table) layouts.

One decode step: each sequence has one query token that attends to every token it
has stored. One layer of the pool is read at a time::

    k_cache, v_cache: [num_slots, num_kv_heads, head_dim]   one token per slot
    q, out:           [batch, num_q_heads, head_dim]        one query token per sequence

    contiguous (static / contiguous / buddy allocators): sequence i owns a run of slots

        slot:   0    1    2    3    4    5    6    7    8    9
              [ .  | a0 | a1 | a2 | .  | .  | b0 | b1 | b2 | b3 ]   seq_offsets = [1, 6]
                                                                  seq_lens    = [3, 4]

    paged (block_size = 4): position p of sequence i sits in slot
    block_tables[i, p // block_size] * block_size + p % block_size

        block:      0                 1                 2
              [ b4 b5 .  .  | a0 a1 a2 .  | b0 b1 b2 b3 ]   block_tables = [[1, -1],
                                                                            [2,  0]]
                                                          seq_lens     = [3, 6]

GQA: query head ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)``. One program
serves the whole group of query heads that share a kv head, so K/V are read once per
kv head; it walks its sequence in tiles of ``BLOCK_N`` tokens with an online softmax
(running max and sum in fp32, base-2 exponentials). With ``num_splits > 1``
(flash-decoding) the context is cut into chunks handled by separate programs that
write partial results, merged by :func:`_combine_splits_kernel`; that keeps the GPU
busy when batch × kv heads is below the number of SMs.

:mod:`gpu_backend.reference` holds the plain PyTorch references the kernels are
tested against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

SUPPORTED_DTYPES = (torch.float16, torch.float32)
_LOG2E = 1.4426950408889634
# tl.dot needs every operand dimension to be at least 16 on NVIDIA GPUs.
_MIN_DOT = 16
# A split pays for its partial-result traffic only with at least this many tokens.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 16


# --------------------------------------------------------------------------- kernels


@triton.jit
def _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale,
                 USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one tile into the running (max, sum, acc) of a query group.

    q: [BLOCK_G, BLOCK_D]; k, v: [BLOCK_N, BLOCK_D]; valid: [BLOCK_N];
    m_i, l_i: [BLOCK_G] (log2 domain); acc: [BLOCK_G, BLOCK_D] fp32.
    """
    if USE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    elif q.shape[0] == 1:
        # One query head (MHA): plain 2-D products. The 3-D form with a size-1 axis
        # compiles to ~2.5x the registers on sm_90 (255 with spills vs 95 at BLOCK_N=64).
        s = tl.sum(q.to(tl.float32) * k.to(tl.float32), axis=1)[None, :]
    else:
        s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    # A tile always holds a valid token, so m_new is finite and alpha is 0 on the first.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if USE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    elif q.shape[0] == 1:
        pv = tl.sum(tl.trans(p) * v.to(tl.float32), axis=0)[None, :]
    else:
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _split_range(seq_len, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Token range [start, end) of one split: whole tiles, trailing splits may be empty."""
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    return start, tl.minimum(start + chunk, seq_len)


@triton.jit
def _store_group(out_ptr, part_ptr, m_ptr, l_ptr, m_i, l_i, acc, seq, split, q_heads,
                 g_mask, offs_d, d_mask, stride_ob, stride_oh, num_q_heads,
                 HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Write the output (one split) or this split's partial (m, l, acc), fp32."""
    mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o = acc / l_i[:, None]
        o_ptrs = out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Partials: m, l [batch, num_q_heads, NUM_SPLITS]; acc [..., HEAD_DIM].
        row = (seq * num_q_heads + q_heads) * NUM_SPLITS + split
        tl.store(m_ptr + row, m_i, mask=g_mask)
        tl.store(l_ptr + row, l_i, mask=g_mask)
        tl.store(part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask)


@triton.jit
def _contiguous_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, m_ptr, l_ptr, seq_offsets_ptr, seq_lens_ptr,
    qk_scale, num_q_heads,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (batch, num_kv_heads, NUM_SPLITS); sequence ``seq`` reads slots offset + [0, len)."""
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

    base = tl.load(seq_offsets_ptr + seq).to(tl.int64)
    start, end = _split_range(tl.load(seq_lens_ptr + seq), split, NUM_SPLITS, BLOCK_N)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(start, end, BLOCK_N):
        pos = tile + offs_n
        valid = pos < end
        slots = base + pos
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale,
                                     USE_DOT, DOT_PRECISION)
    _store_group(out_ptr, part_ptr, m_ptr, l_ptr, m_i, l_i, acc, seq, split, q_heads,
                 g_mask, offs_d, d_mask, stride_ob, stride_oh, num_q_heads, HEAD_DIM, NUM_SPLITS)


@triton.jit
def _block_ids(table_ptr, tile, pos, end, BLOCK_SIZE: tl.constexpr, TILE_IN_BLOCK: tl.constexpr):
    """Block ids of the tile starting at ``tile`` (one id, or one per token); int64."""
    if TILE_IN_BLOCK:
        ids = tl.load(table_ptr + tile // BLOCK_SIZE, mask=tile < end, other=0)
    else:
        ids = tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos < end, other=0)
    return ids.to(tl.int64)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, m_ptr, l_ptr, block_tables_ptr, seq_lens_ptr,
    qk_scale, num_q_heads, stride_bt,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_IN_BLOCK: tl.constexpr,
):
    """Grid (batch, num_kv_heads, NUM_SPLITS); the tile loop walks the block table.

    TILE_IN_BLOCK (BLOCK_N divides block_size): a tile lies inside one block, so one
    block id is loaded per tile; otherwise a tile spans several blocks and each token
    looks its block id up (repeated ids hit the cache).
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
    start, end = _split_range(tl.load(seq_lens_ptr + seq), split, NUM_SPLITS, BLOCK_N)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    block_ids = _block_ids(table_ptr, start, start + offs_n, end, BLOCK_SIZE, TILE_IN_BLOCK)
    for tile in range(start, end, BLOCK_N):
        pos = tile + offs_n
        valid = pos < end
        slots = block_ids * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        # Look the next tile's blocks up now: the lookup overlaps this tile's K/V loads
        # instead of adding a dependent round trip before the next ones.
        block_ids = _block_ids(table_ptr, tile + BLOCK_N, pos + BLOCK_N, end, BLOCK_SIZE,
                               TILE_IN_BLOCK)
        m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale,
                                     USE_DOT, DOT_PRECISION)
    _store_group(out_ptr, part_ptr, m_ptr, l_ptr, m_i, l_i, acc, seq, split, q_heads,
                 g_mask, offs_d, d_mask, stride_ob, stride_oh, num_q_heads, HEAD_DIM, NUM_SPLITS)


@triton.jit
def _combine_splits_kernel(part_ptr, m_ptr, l_ptr, out_ptr, stride_ob, stride_oh,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Grid (batch, num_q_heads): merge the splits' partials (empty splits have m = -inf)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    row = (seq * tl.num_programs(1) + head) * NUM_SPLITS + offs_s
    m = tl.load(m_ptr + row, mask=s_mask, other=float("-inf"))
    l_s = tl.load(l_ptr + row, mask=s_mask, other=0.0)
    acc = tl.load(part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))  # split 0 is never empty, so the max is finite
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=d_mask)


# With TRITON_INTERPRET=1 set before triton's import, kernels run on CPU tensors.
_INTERPRETED = isinstance(_contiguous_decode_kernel, InterpretedFunction)


# --------------------------------------------------------------------------- wrappers


def contiguous_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_offsets: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    use_dot: bool | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    validate: bool = True,
) -> torch.Tensor:
    """Decode attention where sequence i holds slots ``seq_offsets[i] + [0, seq_lens[i])``.

    Shapes: ``q [batch, num_q_heads, head_dim]``, ``k_cache, v_cache [num_slots,
    num_kv_heads, head_dim]``, ``seq_offsets, seq_lens int32 [batch]``. Returns (or
    fills ``out``) ``[batch, num_q_heads, head_dim]`` in q's dtype.

    Tuning knobs: ``num_splits`` context splits per sequence (flash-decoding; default
    1 off CUDA, on CUDA enough to fill the SMs when batch × kv heads is small),
    ``block_n`` tokens per tile (default 128 with one query head per kv head and
    head_dim <= 128, else 64; for head_dim > 128, 32, or 16 in fp32),
    ``use_dot`` tensor-core ``tl.dot`` over the query group (default: when the group
    has more than one head), ``num_warps``, ``num_stages`` (software-pipelined tile
    loads in flight). ``validate=False`` skips the checks that
    read index values (lengths >= 1, slots in range), which cost a device sync.
    """
    batch, num_q_heads, num_kv_heads = _check_qkv(q, k_cache, v_cache, out, seq_lens)
    _check_index(seq_offsets, "seq_offsets", (batch,), q.device)
    max_len = None
    if validate and batch > 0:
        stats = torch.stack([seq_lens.max(), seq_lens.min(), seq_offsets.min(),
                             (seq_offsets.long() + seq_lens).max()]).tolist()
        max_len, min_len, min_offset, max_end = (int(x) for x in stats)
        _check_lens(min_len)
        if min_offset < 0 or max_end > k_cache.shape[0]:
            raise ValueError(
                f"seq_offsets + seq_lens must lie in [0, num_slots={k_cache.shape[0]}], got "
                f"offsets from {min_offset} and ends up to {max_end}")
    block_n = _dense_block_n(q, num_kv_heads, block_n, use_dot)
    plan = _plan(q, num_kv_heads, scale, max_len, num_splits, block_n, use_dot, num_warps)
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    part, m, l_s = _split_buffers(q, plan.num_splits, out)
    _contiguous_decode_kernel[(batch, num_kv_heads, plan.num_splits)](
        q, k_cache, v_cache, out, part, m, l_s, seq_offsets, seq_lens,
        plan.qk_scale, num_q_heads, *_strides(q, k_cache, v_cache, out),
        **plan.meta, num_warps=plan.num_warps, num_stages=num_stages,
    )
    _combine_splits(part, m, l_s, out, plan.num_splits)
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    use_dot: bool | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    validate: bool = True,
) -> torch.Tensor:
    """Decode attention through block tables: position p of sequence i is in slot
    ``block_tables[i, p // block_size] * block_size + p % block_size``.

    Shapes: ``q [batch, num_q_heads, head_dim]``, ``k_cache, v_cache [num_slots,
    num_kv_heads, head_dim]``, ``block_tables int32 [batch, max_blocks_per_seq]``
    (entries past a sequence's blocks are padding and never read), ``seq_lens int32
    [batch]``. Any ``block_size >= 1`` works; powers of two make the index arithmetic
    shifts and, when ``block_n`` divides ``block_size``, one block-id load per tile.
    The knobs are those of :func:`contiguous_decode_attention`.
    """
    batch, num_q_heads, num_kv_heads = _check_qkv(q, k_cache, v_cache, out, seq_lens)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must have shape [batch={batch}, max_blocks_per_seq], "
                         f"got {tuple(block_tables.shape)}")
    _check_index(block_tables, "block_tables", tuple(block_tables.shape), q.device)
    if block_tables.stride(1) != 1:
        raise ValueError(f"block_tables rows must be contiguous, got strides {block_tables.stride()}")
    max_len = block_tables.shape[1] * block_size
    if validate and batch > 0:
        max_len = _check_block_tables(block_tables, seq_lens, block_size, k_cache.shape[0])
    block_n = _dense_block_n(q, num_kv_heads, block_n, use_dot)
    plan = _plan(q, num_kv_heads, scale, max_len, num_splits, block_n, use_dot, num_warps)
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    part, m, l_s = _split_buffers(q, plan.num_splits, out)
    _paged_decode_kernel[(batch, num_kv_heads, plan.num_splits)](
        q, k_cache, v_cache, out, part, m, l_s, block_tables, seq_lens,
        plan.qk_scale, num_q_heads, block_tables.stride(0), *_strides(q, k_cache, v_cache, out),
        **plan.meta, BLOCK_SIZE=block_size, TILE_IN_BLOCK=block_size % plan.meta["BLOCK_N"] == 0,
        num_warps=plan.num_warps, num_stages=num_stages,
    )
    _combine_splits(part, m, l_s, out, plan.num_splits)
    return out


@dataclass(frozen=True)
class _Plan:
    """Launch parameters shared by both layouts; ``meta`` holds the kernels' constexprs."""

    qk_scale: float  # softmax scale times log2(e): the kernels use exp2
    num_splits: int
    num_warps: int
    meta: dict[str, Any]


def _plan(q: torch.Tensor, num_kv_heads: int, scale: float | None, max_len: int | None,
          num_splits: int | None, block_n: int | None, use_dot: bool | None,
          num_warps: int) -> _Plan:
    """Check the tuning knobs and fill in their defaults."""
    batch, num_q_heads, head_dim = q.shape
    if q.device.type == "cpu" and not _INTERPRETED:
        raise ValueError("CPU tensors run only through Triton's interpreter: set "
                         "TRITON_INTERPRET=1 before triton is first imported")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    group = num_q_heads // num_kv_heads
    use_dot = group > 1 if use_dot is None else use_dot
    block_d = triton.next_power_of_2(head_dim)
    block_g = triton.next_power_of_2(group)
    if use_dot:
        block_d, block_g = max(block_d, _MIN_DOT), max(block_g, _MIN_DOT)
    if block_n is None:
        # Largest tiles that build without register spills for sm_90 (checked with ptxas).
        block_n = 64 if block_d <= 128 else (32 if q.element_size() == 2 else 16)
    if block_n < 1 or block_n & (block_n - 1) or (use_dot and block_n < _MIN_DOT):
        raise ValueError(f"block_n must be a power of two (>= {_MIN_DOT} with use_dot), "
                         f"got {block_n}")
    if num_splits is None:
        num_splits = _default_num_splits(q.device, batch * num_kv_heads, max_len)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two, got {num_warps}")
    meta = {"GROUP": group, "HEAD_DIM": head_dim, "BLOCK_G": block_g, "BLOCK_D": block_d,
            "BLOCK_N": block_n, "NUM_SPLITS": num_splits, "USE_DOT": use_dot,
            # fp32 caches stay fp32 in tl.dot; tf32 would cost ~3 decimal digits.
            "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32"}
    return _Plan(scale * _LOG2E, num_splits, num_warps, meta)


def _dense_block_n(q: torch.Tensor, num_kv_heads: int, block_n: int | None,
                   use_dot: bool | None) -> int | None:
    """The contiguous and paged kernels' tile when none is given: 128 tokens where one
    query head reads each kv head without ``tl.dot`` and head_dim <= 128, else
    :func:`_plan`'s default. NOTE: measured on an H200 at batch 64 x 2048, llama-2-7b
    heads, fp16: 3,961 GB/s contiguous and 2,838 paged at 128 against 2,341 and 2,254
    at 64; paged at 16 x 8192 is 3% slower (benchmarks/gpu_reports/h200-2026-12-04,
    ``kernel_sweep.json``). No spill on sm_80 or sm_90 (``python -m gpu_backend.aot``)."""
    mha = q.shape[1] == num_kv_heads and not use_dot
    if block_n is None and mha and q.shape[2] <= 128:
        return 128
    return block_n


def _default_num_splits(device: torch.device, programs: int, max_len: int | None) -> int:
    """Split only on CUDA, when batch × kv heads leaves SMs idle and contexts are long."""
    if device.type != "cuda" or programs == 0:   # an empty batch launches nothing
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= num_sms:
        return 1
    splits = min(triton.cdiv(2 * num_sms, programs), _MAX_SPLITS)
    if max_len is not None:
        splits = min(splits, triton.cdiv(max_len, _MIN_TOKENS_PER_SPLIT))
    return max(splits, 1)


def _strides(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             out: torch.Tensor) -> tuple[int, ...]:
    return (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1))


def _split_buffers(q: torch.Tensor, num_splits: int,
                   out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 partials (acc, m, l) for split-K; with one split the kernel never touches them."""
    if num_splits == 1:
        return out, out, out
    batch, num_q_heads, head_dim = q.shape
    part = torch.empty(batch, num_q_heads, num_splits, head_dim, device=q.device,
                       dtype=torch.float32)
    m = torch.empty(batch, num_q_heads, num_splits, device=q.device, dtype=torch.float32)
    return part, m, torch.empty_like(m)


def _combine_splits(part: torch.Tensor, m: torch.Tensor, l_s: torch.Tensor, out: torch.Tensor,
                    num_splits: int) -> None:
    if num_splits == 1:
        return
    batch, num_q_heads, head_dim = out.shape
    _combine_splits_kernel[(batch, num_q_heads)](
        part, m, l_s, out, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4)


# --------------------------------------------------------------------------- validation


def _check_qkv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor | None, seq_lens: torch.Tensor) -> tuple[int, int, int]:
    """Shape/dtype/stride/device checks shared by both layouts; returns
    (batch, num_q_heads, num_kv_heads)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, num_q_heads, head_dim], got {tuple(q.shape)}")
    if k_cache.dim() != 3:
        raise ValueError("k_cache must be [num_slots, num_kv_heads, head_dim] (one layer), "
                         f"got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape "
                         f"{tuple(k_cache.shape)}")
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim:
        raise ValueError(f"head_dim differs: q has {head_dim}, k_cache has {k_cache.shape[2]}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of "
                         f"num_kv_heads={num_kv_heads}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got q.dtype={q.dtype}")
    named = {"k_cache": k_cache, "v_cache": v_cache, "out": out}
    for name, t in named.items():
        if t is not None and t.dtype != q.dtype:
            raise ValueError(f"{name}.dtype={t.dtype} must equal q.dtype={q.dtype}")
    if out is not None and out.shape != q.shape:
        raise ValueError(f"out shape {tuple(out.shape)} must equal q shape {tuple(q.shape)}")
    for name, t in {"q": q, **named}.items():
        if t is None:
            continue
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (head_dim), "
                             f"got strides {t.stride()}")
    _check_index(seq_lens, "seq_lens", (batch,), q.device)
    return batch, num_q_heads, num_kv_heads


def _check_index(t: torch.Tensor, name: str, shape: tuple[int, ...], device: torch.device) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q on {device}")


def _check_lens(min_len: int) -> None:
    if min_len < 1:
        raise ValueError(f"every seq_lens entry must be >= 1, got a minimum of {min_len}")


def _check_block_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                        num_slots: int) -> int:
    """Check the used block-table entries point inside the pool; returns max(seq_lens)."""
    lens = seq_lens.long()
    first = torch.arange(block_tables.shape[1], device=lens.device) * block_size
    tokens_in_block = (lens[:, None] - first[None, :]).clamp(0, block_size)
    used = tokens_in_block > 0
    last_slot = block_tables.long() * block_size + tokens_in_block - 1
    bad_ids = (used & ((block_tables < 0) | (last_slot >= num_slots))).sum()
    max_len, min_len, num_bad = (
        int(x) for x in torch.stack([lens.max(), lens.min(), bad_ids]).tolist())
    _check_lens(min_len)
    if max_len > block_tables.shape[1] * block_size:
        raise ValueError(f"seq_lens up to {max_len} need more than block_tables.shape[1]="
                         f"{block_tables.shape[1]} blocks of {block_size}")
    if num_bad:
        raise ValueError(f"{num_bad} used block_tables entries point outside the pool "
                         f"(num_slots={num_slots}, block_size={block_size})")
    return max_len
