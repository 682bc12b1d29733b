"""Paged growth over a stretch of decode steps: the blocks each step takes, in the
order exact steps take them.

A row needs a new block at the start of step ``j`` when ``filled + j + 1`` first
exceeds what it owns, i.e. at ``j0 = owned − filled``, then every ``B`` steps. The
stretch stops before the first step whose blocks would not all be free.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fragsim.kv.protocol import Rows, StretchMemory


def grow(kv: Any, rows: Rows, k: int) -> StretchMemory:
    """``k`` steps of paged growth of ``rows`` (or fewer): their blocks taken, and per
    step the slots owned and internally fragmented (``kv``: a :class:`DenseKV`)."""
    B = kv.block_size
    owned = rows.rooms
    j0 = owned - rows.filled
    if k <= B:
        return _one_block_each(kv, rows, j0, k)
    n = len(owned)
    count = np.where(j0 < k, (k - j0 + B - 1) // B, 0)
    total = int(count.sum())
    if total == 0:
        return _unchanged(kv, k, None)
    at = np.repeat(np.arange(n), count)
    within = np.arange(total) - np.repeat(np.cumsum(count) - count, count)
    step = j0[at] + B * within
    cum = np.cumsum(np.bincount(step, minlength=k))
    free_blocks = (kv.capacity - kv.physical) // B
    over = np.flatnonzero(cum > free_blocks)
    if len(over):
        k = int(over[0])
        if k == 0:
            return StretchMemory(0)
        keep = step < k
        at, within, step = at[keep], within[keep], step[keep]
    order = np.lexsort((rows.reqs[at], step))
    final = rows.finals[at]
    old = owned[at] + B * within
    d_internal = np.maximum(0, old + B - final) - np.maximum(0, old - final)
    owned_steps = kv.owned_total + B * np.cumsum(np.bincount(step, minlength=k))[:k]
    internal_steps = kv.internal_total + np.cumsum(
        np.bincount(step, weights=d_internal, minlength=k)).astype(np.int64)[:k]
    # The blocks in exact-mode order: step by step, rows in request order within a step;
    # each grows the row to one past what it owned.
    if not kv.extend_all(rows.seqs[at[order]].tolist(), (old[order] + 1).tolist()):
        raise AssertionError("paged growth failed inside a stretch that had room for it")
    rooms = owned + B * np.bincount(at, minlength=n)
    kv.owned_total, kv.internal_total = int(owned_steps[-1]), int(internal_steps[-1])
    return StretchMemory(k, rooms, {"owned": owned_steps, "internal": internal_steps})


def _one_block_each(kv: Any, rows: Rows, j0: np.ndarray, k: int) -> StretchMemory:
    """:func:`grow` over at most ``B`` steps, where no row takes a second block: the
    rows that take one, in exact-mode order (by step, then by request), and the
    per-step sums in plain ints.

    NOTE: a short stretch grows a few rows; plain ints here instead of the general
    path's dozen numpy calls make the dense peer configuration (``benchmarks/sim_speed.py
    --peer``) about 1.14x faster: its engine run, in one process, 7 rounds alternating
    this path with :func:`grow` less its ``k <= B`` branch, took 5.3 s against 6.1 s
    (medians; the pairs' ratio 1.02-1.23, median 1.14, on a shared machine), with the
    same steps, events, split and finish times."""
    B = kv.block_size
    owned_total, internal_total = kv.owned_total, kv.internal_total
    moving = (j0 < k).nonzero()[0]
    if len(moving) == 0:
        return _unchanged(kv, k, None)
    step = j0[moving]
    free_blocks = (kv.capacity - kv.physical) // B
    if len(moving) > free_blocks:
        # The first step whose blocks are not all free: the one the (free + 1)-th block
        # in step order falls in. The stretch stops before it.
        k = int(np.sort(step)[free_blocks])
        if k == 0:
            return StretchMemory(0)
        keep = step < k
        moving, step = moving[keep], step[keep]
    order = np.lexsort((rows.reqs[moving], step))
    moving, step = moving[order], step[order]
    owned = rows.rooms[moving].tolist()
    blocks, internal = [0] * k, [0] * k
    for j, held, final in zip(step.tolist(), owned, rows.finals[moving].tolist(), strict=True):
        blocks[j] += 1
        if held + B > final:  # the new block's tail is never filled: internal fragmentation
            internal[j] += held + B - final - (held - final if held > final else 0)
    if not kv.extend_all(rows.seqs[moving].tolist(), [held + 1 for held in owned]):
        raise AssertionError("paged growth failed inside a stretch that had room for it")
    rooms = rows.rooms.copy()
    rooms[moving] += B
    owned_steps, internal_steps = [], []
    for j in range(k):
        owned_total += B * blocks[j]
        internal_total += internal[j]
        owned_steps.append(owned_total)
        internal_steps.append(internal_total)
    kv.owned_total, kv.internal_total = owned_total, internal_total
    return StretchMemory(k, rooms, {"owned": np.array(owned_steps, dtype=np.int64),
                                    "internal": np.array(internal_steps, dtype=np.int64)})


def _unchanged(kv: Any, k: int, rooms: np.ndarray | None) -> StretchMemory:
    return StretchMemory(k, rooms, {"owned": np.full(k, kv.owned_total, dtype=np.int64),
                                    "internal": np.full(k, kv.internal_total, dtype=np.int64)})
