"""MLA decode attention (DeepSeek-V2/V3 multi-head latent attention) over a paged latent cache.

MLA caches one latent per token instead of per-head K and V; every head of a sequence
reads the same latent. One layer of the pool, paged as in :mod:`gpu_backend.kernels`::

    c_kv [num_slots, kv_lora_rank]   compressed K/V latent        one token per slot
    k_pe [num_slots, rope_dim]       the shared rotary key part
                                     (views of one [num_slots, kv_lora_rank + rope_dim]
                                      tensor work too: only the last dim must be contiguous)

    q_nope [batch, num_heads, qk_nope_dim]   q_pe [batch, num_heads, rope_dim]
    w_uk   [num_heads, qk_nope_dim, kv_lora_rank]    K_nope[h] = c_kv @ w_uk[h]^T
    w_uv   [num_heads, kv_lora_rank, v_head_dim]     V[h]      = c_kv @ w_uv[h]

Weight absorption moves the up-projections off the cache: scores need
``q_nope . (c w_uk^T) = (q_nope w_uk) . c``, so the query is projected into the latent
once per step, and the softmax-weighted latent is projected out once::

    q_lat = q_nope @ w_uk[h]                 [batch, num_heads, kv_lora_rank]   torch bmm
    s     = (q_lat . c_kv + q_pe . k_pe) * scale       scale = 1/sqrt(qk_nope_dim + rope_dim)
    o_lat = softmax(s) @ c_kv                [batch, num_heads, kv_lora_rank]   Triton
    out   = o_lat @ w_uv[h]                  [batch, num_heads, v_head_dim]     torch bmm

The Triton kernel does the part that reads the cache: a program holds ``BLOCK_H`` heads
of one sequence and reads each latent tile once for all of them, so the latent (the
score's K and the output's V at once) is read once per head block, not once per head.
With 16 or more heads the two products are ``tl.dot`` (an MQA-shaped [heads, tokens]
tile); fewer heads use broadcast sums. The online softmax, flash-decoding splits and
their merge are those of :mod:`gpu_backend.kernels`, over the latent width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from gpu_backend.kernels import (
    _INTERPRETED,
    _LOG2E,
    _MIN_DOT,
    SUPPORTED_DTYPES,
    _block_ids,
    _check_block_tables,
    _check_index,
    _combine_splits,
    _default_num_splits,
    _split_buffers,
    _split_range,
    _store_group,
)
from gpu_backend.kernels_window import (
    _DTYPE_NAMES,
    _TRITON_DTYPES,
    _aot_attrs,
    _aot_combine_variant,
    _aot_signature,
    _check_block_table_args,
)

# Heads per program: the fp32 latent accumulator [BLOCK_H, kv_lora_rank] lives in
# registers, so at 512 wide more than 16 heads spill on sm_90 (checked with ptxas).
_MAX_BLOCK_H = 16


# --------------------------------------------------------------------------- kernel


@triton.jit
def _fold_scores(s, v, valid, m_i, l_i, acc, qk_scale,
                 USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """:func:`gpu_backend.kernels._attend_tile` from scores already made: fold
    ``s [BLOCK_H, BLOCK_N]`` (unscaled) and ``v [BLOCK_N, BLOCK_R]`` into (m, l, acc)."""
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    # A tile always holds a valid token, so m_new is finite and alpha is 0 on the first.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if USE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    else:
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _latent_scores(q_lat, q_pe, c, pe, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """q_lat . c + q_pe . pe: [BLOCK_H, BLOCK_N] fp32."""
    if USE_DOT:
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(pe), acc=s, input_precision=DOT_PRECISION)
    else:
        s = tl.sum(q_lat.to(tl.float32)[:, None, :] * c.to(tl.float32)[None, :, :], axis=2)
        s += tl.sum(q_pe.to(tl.float32)[:, None, :] * pe.to(tl.float32)[None, :, :], axis=2)
    return s


@triton.jit
def _mla_decode_kernel(
    q_lat_ptr, q_pe_ptr, c_kv_ptr, k_pe_ptr, out_ptr, part_ptr, m_ptr, l_ptr,
    block_tables_ptr, seq_lens_ptr, qk_scale, num_heads, stride_bt, stride_cb, stride_pb,
    stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_cs, stride_ps, stride_ob, stride_oh,
    KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_IN_BLOCK: tl.constexpr,
):
    """Grid (batch, cdiv(num_heads, BLOCK_H), NUM_SPLITS); writes o_lat (or its partials).

    Per tile: c [BLOCK_N, BLOCK_R] and pe [BLOCK_N, BLOCK_P] are loaded once and serve
    as K (with q_lat, q_pe) and as V (c) for all BLOCK_H heads. Position ``p`` of block
    ``b`` is at ``b * stride_cb + (p % BLOCK_SIZE) * stride_cs`` (likewise for pe).
    """
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    heads = head_block * BLOCK_H + offs_h
    h_mask = heads < num_heads
    r_mask = offs_r < KV_LORA_RANK
    p_mask = offs_p < ROPE_DIM
    q_lat = tl.load(q_lat_ptr + seq * stride_qlb + heads[:, None] * stride_qlh + offs_r[None, :],
                    mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + seq * stride_qpb + heads[:, None] * stride_qph + offs_p[None, :],
                   mask=h_mask[:, None] & p_mask[None, :], other=0.0)

    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    start, end = _split_range(tl.load(seq_lens_ptr + seq), split, NUM_SPLITS, BLOCK_N)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    block_ids = _block_ids(table_ptr, start, start + offs_n, end, BLOCK_SIZE, TILE_IN_BLOCK)
    for tile in range(start, end, BLOCK_N):
        pos = tile + offs_n
        valid = pos < end
        within = pos % BLOCK_SIZE
        c = tl.load(c_kv_ptr + (block_ids * stride_cb + within * stride_cs)[:, None] + offs_r[None, :],
                    mask=valid[:, None] & r_mask[None, :], other=0.0)
        pe = tl.load(k_pe_ptr + (block_ids * stride_pb + within * stride_ps)[:, None] + offs_p[None, :],
                     mask=valid[:, None] & p_mask[None, :], other=0.0)
        block_ids = _block_ids(table_ptr, tile + BLOCK_N, pos + BLOCK_N, end, BLOCK_SIZE,
                               TILE_IN_BLOCK)
        s = _latent_scores(q_lat, q_pe, c, pe, USE_DOT, DOT_PRECISION)
        m_i, l_i, acc = _fold_scores(s, c, valid, m_i, l_i, acc, qk_scale, USE_DOT, DOT_PRECISION)
    _store_group(out_ptr, part_ptr, m_ptr, l_ptr, m_i, l_i, acc, seq, split, heads, h_mask,
                 offs_r, r_mask, stride_ob, stride_oh, num_heads, KV_LORA_RANK, NUM_SPLITS)


# --------------------------------------------------------------------------- wrapper


def mla_decode_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    block_h: int | None = None,
    use_dot: bool | None = None,
    num_warps: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """MLA decode attention with absorbed up-projections; returns (or fills ``out``)
    ``[batch, num_heads, v_head_dim]`` in q_nope's dtype.

    Shapes are in the module docstring; ``block_tables``, ``seq_lens`` and ``block_size``
    are those of :func:`gpu_backend.kernels.paged_decode_attention`. The absorption
    (``q_nope @ w_uk``) and the up-projection (``o_lat @ w_uv``) are torch batched matmuls
    in the input dtype; the Triton kernel reads the latent cache.

    Knobs: ``block_h`` heads per program (default all, at most 16; more heads re-read
    the latent once per head block), ``block_n`` tokens per tile (default 32 in fp16,
    16 in fp32 at a latent up to 512 wide), ``use_dot`` (default: 16 heads or more),
    ``num_warps`` (default 8), and ``num_splits``, ``validate``
    as in the paged kernel.
    """
    block_strides = (block_size * c_kv.stride(0), block_size * k_pe.stride(0))
    if c_kv.dim() == 3:
        # [num_blocks, block_size, width] views with any block stride (a hybrid pool's pages)
        if k_pe.dim() != 3 or c_kv.shape[:2] != k_pe.shape[:2] or c_kv.shape[1] != block_size:
            raise ValueError(f"3-d c_kv and k_pe must be [num_blocks, block_size={block_size}, "
                             f"width], got {tuple(c_kv.shape)} and {tuple(k_pe.shape)}")
        block_strides = (c_kv.stride(0), k_pe.stride(0))
        c_kv, k_pe = _per_slot(c_kv), _per_slot(k_pe)
    batch, num_heads, v_head_dim = _check_mla(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, out,
                                              seq_lens)
    _check_block_table_args(block_tables, block_size, batch, q_nope.device)
    max_len = block_tables.shape[1] * block_size
    if validate and batch > 0:
        max_len = _check_block_tables(block_tables, seq_lens, block_size, c_kv.shape[0])
    plan = _mla_plan(batch, num_heads, q_nope.shape[2], c_kv.shape[1], k_pe.shape[1],
                     q_nope.dtype, q_nope.device, scale, max_len, num_splits, block_n, block_h,
                     use_dot, num_warps)
    if out is None:
        out = q_nope.new_empty(batch, num_heads, v_head_dim)
    if batch == 0:
        return out
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [batch, heads, rank]
    o_lat = torch.empty_like(q_lat)
    part, m, l_s = _split_buffers(o_lat, plan.num_splits, o_lat)
    grid = (batch, triton.cdiv(num_heads, plan.meta["BLOCK_H"]), plan.num_splits)
    _mla_decode_kernel[grid](
        q_lat, q_pe, c_kv, k_pe, o_lat, part, m, l_s, block_tables, seq_lens,
        plan.qk_scale, num_heads, block_tables.stride(0), *block_strides,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        c_kv.stride(0), k_pe.stride(0), o_lat.stride(0), o_lat.stride(1),
        **_mla_meta(plan.meta, block_size), num_warps=plan.num_warps, num_stages=2,
    )
    _combine_splits(part, m, l_s, o_lat, plan.num_splits)
    out.copy_(torch.bmm(o_lat.transpose(0, 1), w_uv).transpose(0, 1))
    return out


def _per_slot(cache: torch.Tensor) -> torch.Tensor:
    """A ``[num_blocks, block_size, width]`` view as ``[num_blocks * block_size, width]`` rows
    for the checks; only its per-slot stride and shape are read (the kernel gets the
    block stride itself), so the rows need not be evenly spaced across blocks."""
    num_blocks, block_size, width = cache.shape
    return cache.as_strided((num_blocks * block_size, width), (cache.stride(1), cache.stride(2)))


@dataclass(frozen=True)
class _MlaPlan:
    qk_scale: float  # softmax scale times log2(e)
    num_splits: int
    num_warps: int
    meta: dict[str, Any]


def _mla_plan(batch: int, num_heads: int, qk_nope_dim: int, kv_lora_rank: int, rope_dim: int,
              dtype: torch.dtype, device: torch.device, scale: float | None,
              max_len: int | None, num_splits: int | None, block_n: int | None,
              block_h: int | None, use_dot: bool | None, num_warps: int | None) -> _MlaPlan:
    """Check the knobs and fill in their defaults (the checks of kernels._plan)."""
    if device.type == "cpu" and not _INTERPRETED:
        raise ValueError("CPU tensors run only through Triton's interpreter: set "
                         "TRITON_INTERPRET=1 before triton is first imported")
    scale = 1.0 / math.sqrt(qk_nope_dim + rope_dim) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    use_dot = num_heads >= _MIN_DOT if use_dot is None else use_dot
    floor = _MIN_DOT if use_dot else 1
    if block_h is None:
        block_h = min(triton.next_power_of_2(num_heads), _MAX_BLOCK_H)
    if block_h < 1 or block_h & (block_h - 1):
        raise ValueError(f"block_h must be a power of two, got {block_h}")
    block_r = max(triton.next_power_of_2(kv_lora_rank), floor)
    if block_n is None:
        # Latent tiles [block_n, 512] stay in registers beside the fp32 accumulator.
        block_n = 32 if block_r <= 512 and dtype == torch.float16 else 16
        if not use_dot:
            # The broadcast sums hold a [block_h, block_n, block_r] product.
            block_n = max(1, min(block_n, 8192 // (block_h * block_r)))
    if block_n < 1 or block_n & (block_n - 1) or (use_dot and block_n < _MIN_DOT):
        raise ValueError(f"block_n must be a power of two (>= {_MIN_DOT} with use_dot), "
                         f"got {block_n}")
    if num_splits is None:
        num_splits = _default_num_splits(device, batch * triton.cdiv(num_heads, block_h), max_len)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if num_warps is None:
        # The [BLOCK_H, 512] fp32 accumulator wants 8 warps: 16 heads x 32 tokens spill
        # on sm_90 at 4, and take ~126 registers at 8 (8 heads without dot: 168 -> 128).
        num_warps = 8
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two, got {num_warps}")
    meta = {"KV_LORA_RANK": kv_lora_rank, "ROPE_DIM": rope_dim,
            "BLOCK_H": max(block_h, floor), "BLOCK_R": block_r,
            "BLOCK_P": max(triton.next_power_of_2(rope_dim), floor), "BLOCK_N": block_n,
            "NUM_SPLITS": num_splits, "USE_DOT": use_dot,
            "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32"}
    return _MlaPlan(scale * _LOG2E, num_splits, num_warps, meta)


def _mla_meta(plan_meta: dict[str, Any], block_size: int) -> dict[str, Any]:
    return {**plan_meta, "BLOCK_SIZE": block_size,
            "TILE_IN_BLOCK": block_size % plan_meta["BLOCK_N"] == 0}


# --------------------------------------------------------------------------- validation


def _check_mla(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
               k_pe: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
               out: torch.Tensor | None, seq_lens: torch.Tensor) -> tuple[int, int, int]:
    """Shape/dtype/stride/device checks; returns (batch, num_heads, v_head_dim)."""
    if q_nope.dim() != 3:
        raise ValueError("q_nope must be [batch, num_heads, qk_nope_dim], "
                         f"got {tuple(q_nope.shape)}")
    batch, num_heads, qk_nope_dim = q_nope.shape
    if c_kv.dim() != 2:
        raise ValueError("c_kv must be [num_slots, kv_lora_rank] (one layer), "
                         f"got {tuple(c_kv.shape)}")
    num_slots, kv_lora_rank = c_kv.shape
    if k_pe.dim() != 2 or k_pe.shape[0] != num_slots or k_pe.shape[1] < 1:
        raise ValueError(f"k_pe must be [num_slots={num_slots}, rope_dim >= 1], "
                         f"got {tuple(k_pe.shape)}")
    rope_dim = k_pe.shape[1]
    expected = {
        "q_pe": (q_pe, (batch, num_heads, rope_dim), "[batch, num_heads, rope_dim]"),
        "w_uk": (w_uk, (num_heads, qk_nope_dim, kv_lora_rank),
                 "[num_heads, qk_nope_dim, kv_lora_rank]"),
    }
    for name, (t, shape, doc) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {doc} = {list(shape)}, got {list(t.shape)}")
    if w_uv.dim() != 3 or tuple(w_uv.shape[:2]) != (num_heads, kv_lora_rank):
        raise ValueError(f"w_uv must be [num_heads={num_heads}, kv_lora_rank={kv_lora_rank}, "
                         f"v_head_dim], got {tuple(w_uv.shape)}")
    v_head_dim = w_uv.shape[2]
    if q_nope.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got "
                         f"q_nope.dtype={q_nope.dtype}")
    read = {"q_pe": q_pe, "c_kv": c_kv, "k_pe": k_pe}  # by the kernel
    named = {**read, "w_uk": w_uk, "w_uv": w_uv, **({} if out is None else {"out": out})}
    for name, t in named.items():
        if t.dtype != q_nope.dtype:
            raise ValueError(f"{name}.dtype={t.dtype} must equal q_nope.dtype={q_nope.dtype}")
        if t.device != q_nope.device:
            raise ValueError(f"{name} is on {t.device}, q_nope on {q_nope.device}")
    if out is not None and tuple(out.shape) != (batch, num_heads, v_head_dim):
        raise ValueError(f"out shape {tuple(out.shape)} must be [batch, num_heads, v_head_dim]"
                         f" = {[batch, num_heads, v_head_dim]}")
    for name, t in read.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, "
                             f"got strides {t.stride()}")
    _check_index(seq_lens, "seq_lens", (batch,), q_nope.device)
    return batch, num_heads, v_head_dim


# --------------------------------------------------------------------------- ahead of time


def aot_variants() -> list[dict[str, Any]]:
    """The MLA kernel's variants for compiling ahead of time: DeepSeek-V2-Lite's shape
    (16 heads, kv_lora_rank 512, rope_dim 64, qk_nope_dim 128) in fp16 and fp32, and 8
    heads (the broadcast-sum path) in fp16 and fp32, block_size 16, 1 and 4 splits (plus the split
    merges over the latent). Constexprs come from :func:`_mla_plan`; ``attrs`` is as in
    :func:`gpu_backend.kernels_window.aot_variants`.
    """
    block_size = 16
    variants: list[dict[str, Any]] = []
    combines: dict[str, dict[str, Any]] = {}
    for num_heads, dtype, num_splits in ((16, torch.float16, 1), (16, torch.float16, 4),
                                         (16, torch.float32, 1), (8, torch.float16, 1),
                                         (8, torch.float32, 4)):
        plan = _mla_plan(1, num_heads, 128, 512, 64, dtype, torch.device("cuda"), None, None,
                         num_splits, None, None, None, None)
        constexprs = _mla_meta(plan.meta, block_size)
        elem = _TRITON_DTYPES[dtype]
        part = "*fp32" if num_splits > 1 else elem
        pointers = {"q_lat_ptr": elem, "q_pe_ptr": elem, "c_kv_ptr": elem, "k_pe_ptr": elem,
                    "out_ptr": elem, "part_ptr": part, "m_ptr": part, "l_ptr": part,
                    "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32"}
        signature = _aot_signature(_mla_decode_kernel, constexprs, pointers)
        name = (f"mla/{_DTYPE_NAMES[dtype]}/h{num_heads}/r512/p64/bs{block_size}"
                f"/bn{constexprs['BLOCK_N']}/s{num_splits}")
        variants.append({"name": name, "fn": _mla_decode_kernel, "signature": signature,
                         "constexprs": constexprs, "num_warps": plan.num_warps, "num_stages": 2,
                         "attrs": _aot_attrs(signature)})
        if num_splits > 1:
            combine = _aot_combine_variant(dtype, 512, num_splits)
            combines[combine["name"]] = combine
    return variants + list(combines.values())
