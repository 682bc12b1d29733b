"""Plain PyTorch decode attention, the ground truth for :mod:`gpu_backend.kernels`,
:mod:`gpu_backend.kernels_window` and :mod:`gpu_backend.kernels_mla`.

Clarity over speed: one sequence at a time, gather its K/V into a dense
``[seq_len, num_kv_heads, head_dim]`` tensor, then textbook softmax attention in fp32::

    k_cache [num_slots, kv_heads, head_dim] --gather--> k [seq_len, kv_heads, head_dim]
    q[i]    [q_heads, head_dim]  x  k (kv head h // group)  ->  scores [q_heads, seq_len]
    softmax(scores * scale) @ v                              ->  out[i] [q_heads, head_dim]

The layouts are those documented in :mod:`gpu_backend.kernels`. The windowed references
gather only the window's positions; the MLA reference materialises per-head K and V from
the latent instead of absorbing the up-projections, so the kernel's algebra is checked too.
"""

from __future__ import annotations

import itertools
import math

import torch

from fragsim.kinds import rule_of


def gather_contiguous(cache: torch.Tensor, offset: int, seq_len: int) -> torch.Tensor:
    """K or V of one sequence stored in slots ``offset .. offset + seq_len - 1``."""
    return cache[offset : offset + seq_len]


def paged_slots(block_table: torch.Tensor, seq_len: int, block_size: int,
                start: int = 0) -> torch.Tensor:
    """Slot of each position ``start .. seq_len - 1`` of one sequence (int64); table
    entries of blocks before ``start`` are not read."""
    positions = torch.arange(start, seq_len, device=block_table.device)
    blocks = block_table.long()[positions // block_size]
    return blocks * block_size + positions % block_size


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                 block_size: int, start: int = 0) -> torch.Tensor:
    """K or V of positions ``start .. seq_len - 1`` of one sequence through its block-table
    row ``block_table [max_blocks]``."""
    return cache[paged_slots(block_table, seq_len, block_size, start)]


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token ``q [q_heads, head_dim]`` over ``k, v [seq_len, kv_heads, head_dim]``."""
    group = q.shape[0] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [seq_len, q_heads, head_dim]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,shd->hs", q.float(), k) * scale
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("hs,shd->hd", weights, v).to(q.dtype)


def attend_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
                scale: float, max_elements: int = 1 << 26) -> torch.Tensor:
    """:func:`attend_one` for many sequences at once: ``q [batch, q_heads, head_dim]``,
    sequence ``i`` over its run of ``lens[i]`` tokens in ``k, v [sum(lens), kv_heads,
    head_dim]`` (the runs back to back, in order). Runs are padded to the longest and
    masked; sequences go in chunks of at most ``max_elements`` padded K elements."""
    batch, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    out = torch.empty_like(q)
    starts = [0, *itertools.accumulate(lens)]
    i = 0
    while i < batch:
        longest, j = lens[i], i + 1
        while j < batch and (j + 1 - i) * max(longest, lens[j]) * q_heads * head_dim <= max_elements:
            longest, j = max(longest, lens[j]), j + 1
        first = torch.tensor(starts[i:j], device=q.device)
        offsets = torch.arange(longest, device=q.device)
        valid = offsets[None, :] < torch.tensor(lens[i:j], device=q.device)[:, None]
        index = torch.where(valid, first[:, None] + offsets[None, :], 0)   # [chunk, longest]
        kk, vv = k[index].float(), v[index].float()                         # [chunk, n, kv, d]
        qq = q[i:j].float().view(j - i, kv_heads, group, head_dim)
        scores = torch.einsum("bkgd,bnkd->bkgn", qq, kk) * scale
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out[i:j] = torch.einsum("bkgn,bnkd->bkgd", weights, vv).reshape(j - i, q_heads, head_dim).to(q.dtype)
        i = j
    return out


def contiguous_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_offsets: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Reference for :func:`gpu_backend.kernels.contiguous_decode_attention`."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.empty_like(q)
    for i, (offset, seq_len) in enumerate(zip(seq_offsets.tolist(), seq_lens.tolist(),
                                              strict=True)):
        k = gather_contiguous(k_cache, offset, seq_len)
        v = gather_contiguous(v_cache, offset, seq_len)
        out[i] = attend_one(q[i], k, v, scale)
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Reference for :func:`gpu_backend.kernels.paged_decode_attention`."""
    return _windowed_ref(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, None, None)


# --------------------------------------------------------------------------- windows


def window_start(seq_len: int, window: int | None = None, chunk: int | None = None) -> int:
    """First position attended by the query at ``seq_len - 1``: sliding (the last
    ``window`` positions), chunked (its own chunk of ``chunk``) or full (neither given):
    what the kind's rule skips once ``seq_len - 1`` positions are computed."""
    kind = "sliding" if window is not None else "chunked" if chunk is not None else "full"
    return int(rule_of(kind, window, chunk).skipped(seq_len - 1))


def _windowed_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                  scale: float | None, window: int | None, chunk: int | None) -> torch.Tensor:
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        start = window_start(seq_len, window, chunk)
        k = gather_paged(k_cache, block_tables[i], seq_len, block_size, start)
        v = gather_paged(v_cache, block_tables[i], seq_len, block_size, start)
        out[i] = attend_one(q[i], k, v, scale)
    return out


def sliding_window_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    window: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Reference for :func:`gpu_backend.kernels_window.sliding_window_decode_attention`:
    positions [max(0, L - window), L)."""
    return _windowed_ref(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale,
                         window, None)


def chunked_local_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    chunk: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Reference for :func:`gpu_backend.kernels_window.chunked_local_decode_attention`:
    positions [((L - 1) // chunk) * chunk, L)."""
    return _windowed_ref(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale,
                         None, chunk)


# --------------------------------------------------------------------------- MLA


def mla_decode_attention_ref(
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
) -> torch.Tensor:
    """Reference for :func:`gpu_backend.kernels_mla.mla_decode_attention`, without absorption.

    Per sequence, the per-head keys and values are materialised from the latent, then
    textbook attention in fp32::

        c [L, kv_lora_rank], pe [L, rope_dim]           gathered through the block table
        K[h] = [c @ w_uk[h]^T | pe]   [L, qk_nope_dim + rope_dim]
        V[h] =  c @ w_uv[h]           [L, v_head_dim]
        out[i, h] = softmax([q_nope | q_pe][i, h] . K[h]^T * scale) @ V[h]
    """
    scale = 1.0 / math.sqrt(q_nope.shape[-1] + q_pe.shape[-1]) if scale is None else scale
    num_heads = q_nope.shape[1]
    out = q_nope.new_empty(q_nope.shape[0], num_heads, w_uv.shape[-1])
    w_uk, w_uv = w_uk.float(), w_uv.float()
    for i, seq_len in enumerate(seq_lens.tolist()):
        slots = paged_slots(block_tables[i], seq_len, block_size)
        c, pe = c_kv[slots].float(), k_pe[slots].float()
        k_nope = torch.einsum("sr,hdr->hsd", c, w_uk)
        k = torch.cat([k_nope, pe.expand(num_heads, -1, -1)], dim=-1)
        v = torch.einsum("sr,hrv->hsv", c, w_uv)
        q = torch.cat([q_nope[i].float(), q_pe[i].float()], dim=-1)  # [heads, nope + rope]
        weights = torch.softmax(torch.einsum("hd,hsd->hs", q, k) * scale, dim=-1)
        out[i] = torch.einsum("hs,hsv->hv", weights, v).to(out.dtype)
    return out
