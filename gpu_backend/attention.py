"""Decode attention over one row of a hybrid pool, through the row kind's Triton kernel.

The validator asks what the next token of each decoding request reads of what is
stored: every stored position for full attention and MLA, the last ``window − 1``
stored positions for a sliding window of ``window`` (the new token is the window's
last), the stored part of the current chunk for chunked local attention. So a
request with ``f`` stored tokens runs the kernels with ``seq_len = f`` and::

    full      kind FULL                  reads [0, f)
    sliding   kind SLIDING, window − 1   reads [f − window + 1, f)
    chunked   kind CHUNKED, chunk        reads [f // chunk · chunk, f)   (f not a multiple)

K and V are views ``[num_ids, block_tokens, kv_heads, head_dim]`` of the pool
(:meth:`~gpu_backend.hybrid_pool.HybridPool.kv`), whose block stride is the
layout's page stride; the kernels take it as it is. Block-table entries of blocks
a window freed are −1: the kernels never read them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gpu_backend.kernels_mla import mla_decode_attention
from gpu_backend.kernels_window import CHUNKED, FULL, SLIDING, windowed_decode_attention
from gpu_backend.pool import kv_values, query_values
from gpu_backend.reference import mla_decode_attention_ref

#: the MLA miniature's query and value head widths (its latent is the row's)
MLA_NOPE_DIM = MLA_V_DIM = 16


def windowed(row: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor,
             lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [batch, q_heads, head_dim]`` over the stored positions each next token reads."""
    if row.kind == "sliding":
        kind, span = SLIDING, row.window - 1
    elif row.kind == "chunked":
        kind, span = CHUNKED, row.chunk
    else:
        kind, span = FULL, 1
    return windowed_decode_attention(q, k, v, tables, lens, row.block_tokens, kind, span, scale)


def _mla_weights(layer: int, heads: int, rank: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic up-projections of one MLA layer (K: ``[heads, nope, rank]``, V:
    ``[heads, rank, v_dim]``), scaled so the scores stay of order one."""
    gen = torch.Generator().manual_seed(1000 + layer)
    w_uk = torch.randn(heads, MLA_NOPE_DIM, rank, generator=gen) / math.sqrt(rank)
    w_uv = torch.randn(heads, rank, MLA_V_DIM, generator=gen) / math.sqrt(rank)
    return w_uk.to(device, dtype), w_uv.to(device, dtype)


def mla_check(latent: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, reqs: torch.Tensor,
              step: int, row: Any, layer: int, heads: int, rope_dim: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode over the pool's latent ``[num_ids, block_tokens, 1, rank + rope]`` through
    the Triton kernel, and the naive reference (up-projected K and V) on latents
    regenerated from scratch; returns (kernel, reference) ``[batch, heads, v_dim]``."""
    device = latent.device
    width = latent.shape[-1]
    rank = width - rope_dim
    w_uk, w_uv = _mla_weights(layer, heads, rank, dtype, device)
    q = query_values(reqs, step, heads, MLA_NOPE_DIM + rope_dim, dtype)
    q_nope, q_pe = q[..., :MLA_NOPE_DIM].contiguous(), q[..., MLA_NOPE_DIM:].contiguous()
    flat = latent[:, :, 0, :]
    got = mla_decode_attention(q_nope, q_pe, flat[..., :rank], flat[..., rank:], w_uk, w_uv, tables,
                               lens, row.block_tokens)
    # The reference reads latents regenerated per request, one slot a position.
    parts, table_rows, offset = [], [], 0
    n_max = int(lens.max().item())
    for req, n in zip(reqs.tolist(), lens.tolist(), strict=True):
        positions = torch.arange(n, device=device)
        parts.append(kv_values(torch.full_like(positions, req), positions, layer, 1, width, dtype, 0)[:, 0])
        ids = torch.full((n_max,), -1, dtype=torch.int32, device=device)
        ids[:n] = torch.arange(offset, offset + n, dtype=torch.int32, device=device)
        table_rows.append(ids)
        offset += n
    cache = torch.cat(parts)
    want = mla_decode_attention_ref(q_nope, q_pe, cache[:, :rank], cache[:, rank:], w_uk, w_uv,
                                    torch.stack(table_rows), lens, 1)
    return got, want
