"""Plain PyTorch decode attention, the ground truth for :mod:`gpu_backend.kernels`.

Clarity over speed: one sequence at a time, gather its K/V into a dense
``[seq_len, num_kv_heads, head_dim]`` tensor, then textbook softmax attention in fp32::

    k_cache [num_slots, kv_heads, head_dim] --gather--> k [seq_len, kv_heads, head_dim]
    q[i]    [q_heads, head_dim]  x  k (kv head h // group)  ->  scores [q_heads, seq_len]
    softmax(scores * scale) @ v                              ->  out[i] [q_heads, head_dim]

The layouts are those documented in :mod:`gpu_backend.kernels`.
"""

from __future__ import annotations

import math

import torch


def gather_contiguous(cache: torch.Tensor, offset: int, seq_len: int) -> torch.Tensor:
    """K or V of one sequence stored in slots ``offset .. offset + seq_len - 1``."""
    return cache[offset : offset + seq_len]


def paged_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Slot of each position ``0 .. seq_len - 1`` of one sequence (int64)."""
    positions = torch.arange(seq_len, device=block_table.device)
    blocks = block_table.long()[positions // block_size]
    return blocks * block_size + positions % block_size


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                 block_size: int) -> torch.Tensor:
    """K or V of one sequence through its block-table row ``block_table [max_blocks]``."""
    return cache[paged_slots(block_table, seq_len, block_size)]


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token ``q [q_heads, head_dim]`` over ``k, v [seq_len, kv_heads, head_dim]``."""
    group = q.shape[0] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [seq_len, q_heads, head_dim]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,shd->hs", q.float(), k) * scale
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("hs,shd->hd", weights, v).to(q.dtype)


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
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        k = gather_paged(k_cache, block_tables[i], seq_len, block_size)
        v = gather_paged(v_cache, block_tables[i], seq_len, block_size)
        out[i] = attend_one(q[i], k, v, scale)
    return out
