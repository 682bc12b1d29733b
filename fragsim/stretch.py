"""Stretches: many uneventful decode steps advanced at once.

Most steps change nothing but lengths: every sequence grows by one token. The
engine advances such a stretch in one go (``_jump``): step times, the
time-weighted memory split and any paged block allocations of up to thousands of
steps come out of a few numpy calls, and SimPy sees one timeout. It stops short
of any step where something else could happen (an arrival that could be
admitted, a completion, a queue timeout, a failed block allocation), and those
steps run through the same code as ``exact_steps`` mode, which runs every step on
its own. Both modes see bit-identical step times and make the same decisions, so
their summaries agree (tests compare them).

A stretch starts right after a step whose decisions left nothing pending (no prompt
chunk, no admission possible until memory frees or a request arrives). Its length
is the number of steps before the first one where anything could change; its step
times come from :meth:`~fragsim.costmodel.CostModel.decode_step_times` over the
whole stretch, its memory split per step from the decode batch's arrays.
"""

from __future__ import annotations

import numpy as np

from fragsim.engine_state import EngineState


def jump(engine: EngineState) -> float:
    """Advance a stretch of uneventful decode steps at once. Returns its duration (0: none)."""
    b, cfg = engine.batch, engine.cfg
    n = b.n
    if n == 0 or not engine._quiet or cfg.exact_steps:
        return 0.0
    g = engine.g
    filled0 = b.offset[:n] + g
    k = min(int((b.final[:n] - filled0).min()) - 1, cfg.max_jump_steps)
    if k <= 0:
        return 0.0
    ctx = int(filled0.sum()) + n * np.arange(k, dtype=np.int64)
    dts = engine.cost.decode_step_times(n, ctx)
    starts = np.cumsum(np.concatenate(([engine.now], dts)))
    if not engine.waiting and not engine.swapped:
        nxt = int(engine.next_servable[engine._next])
        if nxt < engine.N:
            hit = np.flatnonzero(engine.arrival[nxt] <= starts[:k])
            if len(hit):
                k = int(hit[0])
    if cfg.queue_timeout_s is not None:
        first = next((r for r in engine.waiting if engine.preemptions[r] == 0), None)
        if first is not None:
            hit = np.flatnonzero(starts[:k] - engine.arrival[first] > cfg.queue_timeout_s)
            if len(hit):
                k = int(hit[0])
    if k <= 0:
        return 0.0
    # Shared slots stay put during a stretch (nothing forks, frees or is admitted), and
    # every shared block is full: Σ owned and Σ filled both count them `shared` too often.
    shared = engine.shared_total
    if engine.grows:
        k, owned_steps, internal_steps = jump_growth(engine, filled0, k)
        if k <= 0:
            return 0.0
        if shared:
            owned_steps = owned_steps - shared
        largest = engine.capacity - owned_steps
    else:
        owned_steps = np.full(k, engine.owned_total, dtype=np.int64)
        internal_steps = np.full(k, engine.internal_total, dtype=np.int64)
        largest = np.full(k, engine.alloc.largest_allocatable(), dtype=np.int64)
    token_states = ctx[:k] - shared if shared else ctx[:k]
    pulled = np.searchsorted(engine.arrival, starts[:k], side="right")
    waiting = len(engine.waiting) + len(engine.swapped) \
        + engine.servable_cum[pulled] - engine.servable_cum[engine._next]
    engine.rec.record_steps(engine.now, dts[:k], token_states, owned_steps, internal_steps,
                          largest, n, waiting, shared)
    engine.now = float(starts[k])
    engine.g += k
    engine.num_steps += k
    if cfg.check:
        engine._check()
    return float(dts[:k].sum())

def jump_growth(engine: EngineState, filled0: np.ndarray, k: int) -> tuple[int, np.ndarray, np.ndarray]:
    """Paged growth over ``k`` steps: the blocks each step takes, in exact-mode order.

    A row needs a new block at the start of step ``j`` when ``filled0 + j + 1`` first
    exceeds what it owns, i.e. at ``j0 = owned − filled0``, then every ``B`` steps.
    Stops before the first step whose blocks would not all be available.
    """
    b, B = engine.batch, engine.block_size
    n = b.n
    j0 = b.owned[:n] - filled0
    count = np.where(j0 < k, (k - j0 + B - 1) // B, 0)
    total = int(count.sum())
    if total == 0:
        return (k, np.full(k, engine.owned_total, dtype=np.int64),
                np.full(k, engine.internal_total, dtype=np.int64))
    rows = np.repeat(np.arange(n), count)
    within = np.arange(total) - np.repeat(np.cumsum(count) - count, count)
    step = j0[rows] + B * within
    per_step = np.bincount(step, minlength=k)
    cum = np.cumsum(per_step)
    free_blocks = (engine.capacity - engine.owned_total + engine.shared_total) // B
    over = np.flatnonzero(cum > free_blocks)
    if len(over):
        k = int(over[0])
        keep = step < k
        rows, within, step = rows[keep], within[keep], step[keep]
        if k == 0:
            return 0, per_step[:0], per_step[:0]
    order = np.lexsort((b.req[rows], step))
    final = b.final[rows]
    old = b.owned[rows] + B * within
    d_internal = np.maximum(0, old + B - final) - np.maximum(0, old - final)
    owned_steps = engine.owned_total + B * np.cumsum(np.bincount(step, minlength=k))[:k]
    internal_steps = engine.internal_total + np.cumsum(
        np.bincount(step, weights=d_internal, minlength=k)).astype(np.int64)[:k]
    extend = engine.alloc.extend
    for i in order:
        row = int(rows[i])
        target = int(filled0[row]) + int(step[i]) + 1
        if not extend(int(b.seq[row]), target - int(b.requested[row])):
            raise AssertionError("paged growth failed inside a stretch that had room for it")
        b.requested[row] = target
        b.owned[row] += B
    engine.owned_total = int(owned_steps[-1])
    engine.internal_total = int(internal_steps[-1])
    return k, owned_steps, internal_steps
