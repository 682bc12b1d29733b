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

Most stretches are short: with a few hundred sequences a completion or an arrival
comes every few steps, and a stretch of four steps is typical. There the cost is
the number of numpy calls, not their size, so a short stretch (at most ``SHORT``
steps) takes its step times one by one in plain floats (the same values the array
evaluation gives, bit for bit) and stops at the next arrival as it goes, and a
stretch of at most ``block_size`` steps, where no row takes a second block, does
its growth bookkeeping in plain ints (:func:`jump_growth`). The numbers are those
of the general path; only the number of calls changes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from fragsim.engine_state import EngineState

#: stretches of at most this many steps get their step times one by one, in plain floats
#: (the cost model's ``decode_step_time``): most stretches are a handful of steps long,
#: where a dozen numpy calls on arrays of a few elements cost more than the arithmetic
SHORT = 32


class Plan(NamedTuple):
    """A stretch's length and step times, before any memory moves."""

    k: int                      # steps
    dts: np.ndarray             # their durations (at least k)
    starts: list[float]         # their start times, and the end of the last (at least k + 1)
    ctx0: int                   # tokens the batch holds at its start
    watch: bool                 # nothing waits: the stretch stops where a request arrives


def plan(engine: EngineState) -> Plan | None:
    """How many uneventful decode steps may run at once, and their times (None: none).

    Stops before the first completion, the first step that starts once the next
    servable request has arrived (when nothing waits) and the first queue timeout.
    Memory may shorten it further (:func:`jump_growth`, the hybrid managers).
    """
    b, cfg = engine.batch, engine.cfg
    n = b.n
    if n == 0 or not engine._quiet or cfg.exact_steps:
        return None
    now = engine.now
    # While requests wait the queue head is blocked and arrivals change nothing; else the
    # stretch stops at the first step that starts once the next servable request is in.
    watch = not engine.waiting and not engine.swapped
    arrive = math.inf
    if watch:
        nxt = int(engine.next_servable[engine._next])
        if nxt < engine.N:
            arrive = float(engine.arrival[nxt])
            if arrive <= now:
                return None  # it arrived during the last step: that step runs exactly
    g = engine.g
    # Stop before the first completion: row r completes when g reaches final − offset.
    k = min(b.end_min() - g - 1, cfg.max_jump_steps)
    if k <= 0:
        return None
    ctx0 = b.offset_sum() + n * g
    step_time = engine._decode_step_time
    if k <= SHORT and step_time is not None:
        # Step j starts at starts[j] (a running sum, as np.cumsum adds) and reads
        # ctx0 + n·j tokens; stop at the first step that starts once the request is in.
        starts, times = [now], []
        t = now
        for j in range(k):
            if arrive <= t:
                k = j
                break
            dt = step_time(n, ctx0 + n * j)
            times.append(dt)
            t += dt
            starts.append(t)
        dts = np.array(times)
    else:
        ctx = ctx0 + n * np.arange(k, dtype=np.int64)
        dts = engine.cost.decode_step_times(n, ctx)
        starts_arr = np.cumsum(np.concatenate(([now], dts)))
        if arrive <= starts_arr[k - 1]:
            k = int(np.flatnonzero(arrive <= starts_arr[:k])[0])
        starts = starts_arr.tolist()
    if cfg.queue_timeout_s is not None:
        first = next((r for r in engine.waiting if engine.preemptions[r] == 0), None)
        if first is not None:
            since, timeout = float(engine.arrival[first]), cfg.queue_timeout_s
            k = next((j for j in range(k) if starts[j] - since > timeout), k)
    if k <= 0:
        return None
    return Plan(k, dts, starts, ctx0, watch)


def waiting_counts(engine: EngineState, stretch: Plan, k: int) -> np.ndarray:
    """Requests waiting during each of the first ``k`` steps of a stretch."""
    if stretch.watch:
        # Nothing servable arrives before the stretch ends (that is where it stops).
        return np.zeros(k, dtype=np.int64)
    pulled = np.searchsorted(engine.arrival, stretch.starts[:k], side="right")
    return len(engine.waiting) + len(engine.swapped) \
        + engine.servable_cum[pulled] - engine.servable_cum[engine._next]


def jump(engine: EngineState) -> float:
    """Advance a stretch of uneventful decode steps at once. Returns its duration (0: none)."""
    stretch = plan(engine)
    if stretch is None:
        return 0.0
    b = engine.batch
    n, g, k, ctx0 = b.n, engine.g, stretch.k, stretch.ctx0
    # Shared slots stay put during a stretch (nothing forks, frees or is admitted), and
    # every shared block is full: Σ owned and Σ filled both count them `shared` too often.
    shared = engine.kv.shared_total
    largest: np.ndarray | None
    if engine.grows:
        k, owned_steps, internal_steps = jump_growth(engine, b.offset[:n] + g, k)
        if k <= 0:
            return 0.0
        if shared:
            owned_steps = owned_steps - shared
        largest = None  # paged: every free slot is allocatable
    else:
        owned_steps = np.full(k, engine.kv.owned_total, dtype=np.int64)
        internal_steps = np.full(k, engine.kv.internal_total, dtype=np.int64)
        largest = np.full(k, engine.alloc.largest_allocatable(), dtype=np.int64)
    dts = stretch.dts[:k]
    token_states = np.arange(ctx0 - shared, ctx0 - shared + n * k, n, dtype=np.int64)
    engine.rec.record_steps(engine.now, dts, token_states, owned_steps, internal_steps,
                            largest, n, waiting_counts(engine, stretch, k), shared)
    return advance(engine, stretch, k)


def advance(engine: EngineState, stretch: Plan, k: int) -> float:
    """Move the clock and the step counter past the first ``k`` steps of a recorded
    stretch (checked with ``check=True``); returns their duration."""
    engine.now = float(stretch.starts[k])
    engine.g += k
    engine.num_steps += k
    if engine.cfg.check:
        engine._check()
    return float(stretch.dts[:k].sum())


def jump_growth(engine: EngineState, filled0: np.ndarray, k: int) -> tuple[int, np.ndarray, np.ndarray]:
    """Paged growth over ``k`` steps: the blocks each step takes, in exact-mode order.

    A row needs a new block at the start of step ``j`` when ``filled0 + j + 1`` first
    exceeds what it owns, i.e. at ``j0 = owned − filled0``, then every ``B`` steps.
    Stops before the first step whose blocks would not all be available.
    """
    b, B, kv = engine.batch, engine.block_size, engine.kv
    n = b.n
    j0 = b.owned[:n] - filled0
    if k <= B:
        return _growth_one_block_each(engine, j0, k)
    count = np.where(j0 < k, (k - j0 + B - 1) // B, 0)
    total = int(count.sum())
    if total == 0:
        return (k, np.full(k, kv.owned_total, dtype=np.int64),
                np.full(k, kv.internal_total, dtype=np.int64))
    rows = np.repeat(np.arange(n), count)
    within = np.arange(total) - np.repeat(np.cumsum(count) - count, count)
    step = j0[rows] + B * within
    per_step = np.bincount(step, minlength=k)
    cum = np.cumsum(per_step)
    free_blocks = (kv.capacity - kv.physical) // B
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
    owned_steps = kv.owned_total + B * np.cumsum(np.bincount(step, minlength=k))[:k]
    internal_steps = kv.internal_total + np.cumsum(
        np.bincount(step, weights=d_internal, minlength=k)).astype(np.int64)[:k]
    # The blocks in exact-mode order: step by step, rows in request order within a step.
    # A row's first block asks for what it lacks, each later one for B more slots.
    rows, within = rows[order], within[order]
    targets = old[order] + 1
    asked = np.where(within > 0, B, targets - b.requested[rows])
    if not kv.extend_all(b.seq[rows].tolist(), asked.tolist()):
        raise AssertionError("paged growth failed inside a stretch that had room for it")
    blocks = np.bincount(rows, minlength=n)
    live_requested, live_owned = b.requested[:n], b.owned[:n]
    np.copyto(live_requested, live_owned + (B * blocks - B + 1), where=blocks > 0)
    live_owned += B * blocks
    kv.moved(int(owned_steps[-1]) - kv.owned_total, int(internal_steps[-1]) - kv.internal_total)
    return k, owned_steps, internal_steps


def _growth_one_block_each(engine: EngineState, j0: np.ndarray, k: int) -> tuple[int, np.ndarray, np.ndarray]:
    """:func:`jump_growth` over at most ``B`` steps, where no row takes a second block:
    the rows that take one, in exact-mode order (by step, then by request), and the
    per-step sums in plain ints (a short stretch grows a few rows)."""
    b, B, kv = engine.batch, engine.block_size, engine.kv
    owned_total, internal_total = kv.owned_total, kv.internal_total
    rows = (j0 < k).nonzero()[0]
    if len(rows) == 0:
        return k, np.full(k, owned_total, dtype=np.int64), np.full(k, internal_total, dtype=np.int64)
    step = j0[rows]
    free_blocks = (kv.capacity - kv.physical) // B
    if len(rows) > free_blocks:
        # The first step whose blocks are not all free: the one the (free + 1)-th block
        # in step order falls in. The stretch stops before it.
        k = int(np.sort(step)[free_blocks])
        if k == 0:
            return 0, step[:0], step[:0]
        keep = step < k
        rows, step = rows[keep], step[keep]
    order = np.lexsort((b.req[rows], step))
    rows, step = rows[order], step[order]
    _, seqs, _, owned, requested, finals = b.columns(rows)
    blocks, internal = [0] * k, [0] * k
    for j, held, final in zip(step.tolist(), owned, finals, strict=True):
        blocks[j] += 1
        if held + B > final:  # the new block's tail is never filled: internal fragmentation
            internal[j] += held + B - final - (held - final if held > final else 0)
    asked = [held + 1 - had for held, had in zip(owned, requested, strict=True)]
    if not kv.extend_all(seqs, asked):
        raise AssertionError("paged growth failed inside a stretch that had room for it")
    b.requested[rows] = [held + 1 for held in owned]
    b.owned[rows] = [held + B for held in owned]
    owned_steps, internal_steps = [], []
    for j in range(k):
        owned_total += B * blocks[j]
        internal_total += internal[j]
        owned_steps.append(owned_total)
        internal_steps.append(internal_total)
    kv.moved(owned_total - kv.owned_total, internal_total - kv.internal_total)
    return k, np.array(owned_steps, dtype=np.int64), np.array(internal_steps, dtype=np.int64)
