"""Decode attention over one row of a hybrid pool, by the row's kind.

The validator asks what the next token of each decoding request reads: every
stored position for full attention, the last ``window − 1`` stored positions for
a sliding window of ``window`` (the new token is the window's last), the stored
part of the current chunk for chunked local attention. K and V are views
``[num_ids, block_tokens, kv_heads, head_dim]`` of the pool (:meth:`HybridPool.kv`),
whose block stride is the layout's page stride.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_backend.reference import attend_one


def windowed(row: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor,
             lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [batch, q_heads, head_dim]`` over the stored positions each next token reads."""
    out = torch.empty_like(q)
    B = row.block_tokens
    for i, n in enumerate(lens.tolist()):
        start = int(row.window_start(torch.tensor(n)).item())
        positions = torch.arange(start, n, device=q.device)
        ids = tables[i].long()[torch.div(positions, B, rounding_mode="floor")]
        off = positions % B
        out[i] = attend_one(q[i], k[ids, off], v[ids, off], scale)
    return out


def mla_check(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    raise NotImplementedError("MLA rows are not validated on the device yet")
