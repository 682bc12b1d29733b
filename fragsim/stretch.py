"""Stretches: many uneventful decode steps advanced at once.

Most steps change nothing but lengths: every sequence grows by one token. The
engine advances such a stretch in one go (``_jump``): step times, the
time-weighted memory split and any paged block allocations of up to thousands of
steps come out of a few numpy calls, and SimPy sees one timeout. It stops short
of any step where something else could happen (an arrival that could be
admitted, a completion, a queue timeout, a failed block allocation, a chunk that
an offload tier stores (:mod:`fragsim.decode_stores`)), and those
steps run through the same code as ``exact_steps`` mode, which runs every step on
its own. Both modes see bit-identical step times and make the same decisions, so
their summaries agree (tests compare them).

A stretch starts right after a step whose decisions left nothing pending (no prompt
chunk, no admission possible until memory frees or a request arrives). Its length
is the number of steps before the first one where anything could change; its step
times come from :meth:`~fragsim.costmodel.CostModel.decode_step_times` over the
whole stretch, its memory split per step from the decode batch's arrays.

Memory is the KV manager's: asked for ``k`` steps of the decoding rows
(:meth:`~fragsim.kv.protocol.KVManager.stretch`), it says how many its blocks allow
(a block that might not be free, a window's free that might let the queue's head
in), moves the blocks at the steps they move, and records each step's split. This
module does no block arithmetic.

Most stretches are short: with a few hundred sequences a completion or an arrival
comes every few steps, and a stretch of four steps is typical. There the cost is
the number of numpy calls, not their size, so a short stretch (at most ``SHORT``
steps) takes its step times one by one in plain floats (the same values the array
evaluation gives, bit for bit) and stops at the next arrival as it goes. The
numbers are those of the general path; only the number of calls changes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from fragsim import decode_stores
from fragsim.kv.protocol import Rows

if TYPE_CHECKING:
    from fragsim.engine import Engine

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


def plan(engine: Engine) -> Plan | None:
    """How many uneventful decode steps may run at once, and their times (None: none).

    Stops before the first completion, the first step that starts once the next
    servable request has arrived (when nothing waits), the first queue timeout and,
    with decode stores, the first step that completes a chunk to store.
    Memory may shorten it further (the KV manager's :meth:`stretch`).
    """
    b, cfg = engine.batch, engine.cfg
    n = b.n
    if n == 0 or not engine.quiet or cfg.exact_steps:
        return None
    now = engine.now
    # While requests wait the queue head is blocked and arrivals change nothing; else the
    # stretch stops at the first step that starts once the next servable request is in.
    reqs = engine.requests
    watch = not engine.waiting and not engine.swapped
    arrive = math.inf
    if reqs.dynamic:
        # A cluster's router sends requests as they arrive: any arrival may come here,
        # whether or not the queue is blocked (the waiting counts must see it).
        watch = False
        if reqs.next_row < reqs.N:
            arrive = float(reqs.arrival[reqs.next_row])
            if arrive <= now:
                return None
        if reqs.takes_hand_ins and engine.env is not None:
            # A hand-in comes with another instance's event: none before the next one.
            arrive = min(arrive, float(engine.env.peek()))
            if arrive <= now:
                return None
    elif watch:
        nxt = int(reqs.next_servable[reqs.next_row])
        if nxt < reqs.N:
            arrive = float(reqs.arrival[nxt])
            if arrive <= now:
                return None  # it arrived during the last step: that step runs exactly
    g = engine.g
    # Stop before the first completion: row r completes when g reaches final − offset.
    k = min(b.end_min() - g - 1, cfg.max_jump_steps)
    before = decode_stores.steps_before(engine)  # a step that completes a chunk to store runs alone
    if before is not None:
        k = min(k, before)
    if k <= 0:
        return None
    ctx0 = b.offset_sum() + n * g
    step_time = engine.decode_step_time
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
        first = next((r for r in engine.waiting if reqs.preemptions[r] == 0), None)
        if first is not None:
            since, timeout = float(reqs.arrival[first]), cfg.queue_timeout_s
            k = next((j for j in range(k) if starts[j] - since > timeout), k)
    if k <= 0:
        return None
    return Plan(k, dts, starts, ctx0, watch)


class Backoff:
    """Under memory pressure a KV manager's stretch often cannot take its first step,
    and stretches stall in runs. For a manager that asks for it (``backs_off``: its
    stretch costs more than an exact step), after ``n`` stalls in a row the next
    ``min(2^(n−1), 16)`` chances are stepped exactly without trying (a single step is
    always exact; only speed changes), and the next stretch tries its first step
    alone first (``stalled``)."""

    def __init__(self) -> None:
        self.stalls = 0
        self.skip = 0

    def stalled(self, backs_off: bool) -> None:
        self.stalls += 1
        if backs_off:
            self.skip = min(1 << (self.stalls - 1), 16)


def waiting_counts(engine: Engine, stretch: Plan, k: int) -> np.ndarray:
    """Requests waiting during each of the first ``k`` steps of a stretch."""
    if stretch.watch:
        # Nothing servable arrives before the stretch ends (that is where it stops).
        return np.zeros(k, dtype=np.int64)
    reqs = engine.requests
    if reqs.dynamic:  # the stretch stops before the next arrival
        return np.full(k, len(engine.waiting) + len(engine.swapped), dtype=np.int64)
    pulled = np.searchsorted(reqs.arrival, stretch.starts[:k], side="right")
    return len(engine.waiting) + len(engine.swapped) \
        + reqs.servable_cum[pulled] - reqs.servable_cum[reqs.next_row]


def head_tokens(engine: Engine) -> int | None:
    """Tokens the queue's head would ask for if the batch limits let it in (None:
    nothing waits, or the limits keep it out whatever memory frees). A prompt step of
    ``vllm-v0`` has the whole token budget; under ``orca`` a prompt must fit whole."""
    cfg = engine.cfg
    if not engine.waiting or engine.num_running() >= cfg.max_num_seqs:
        return None
    room = cfg.num_batched_tokens - (0 if cfg.scheduler == "vllm-v0" else engine.batch.n)
    head, reqs = engine.waiting[0], engine.requests
    context = int(reqs.prompt[head] + reqs.generated[head])
    if room <= 0 or (cfg.whole_prompts and not cfg.prefix_caching and context > room):
        return None
    return context + 1


def jump(engine: Engine) -> float:
    """Advance a stretch of uneventful decode steps at once. Returns its duration (0: none).

    The time plan (:func:`plan`) bounds it; the KV manager says how many of those
    steps its memory allows, moves its blocks, and records the split of each step."""
    if engine.beams is not None and engine.batch.n:
        return 0.0  # beams fork every step: no stretches while they decode
    kv = engine.kv
    backoff = engine.backoff
    if backoff.skip:
        backoff.skip -= 1
        return 0.0
    stretch = plan(engine)
    if stretch is None:
        return 0.0
    b = engine.batch
    n, g = b.n, engine.g
    rows = Rows(b.seq[:n], b.req[:n], b.offset[:n] + g, b.room[:n], b.final[:n])
    memory = kv.stretch(rows, stretch.k, head_tokens(engine), backoff.stalls > 0)
    k = memory.k
    if k <= 0:
        backoff.stalled(kv.backs_off)
        return 0.0
    backoff.stalls = 0
    if memory.rooms is not None:
        b.room[:n] = memory.rooms
    # Shared slots stay put during a stretch (nothing forks, frees or is admitted), and
    # every shared block is full: Σ filled counts them `shared` too often.
    first = stretch.ctx0 - kv.shared_slots
    stored = np.arange(first, first + n * k, n, dtype=np.int64)
    kv.record_steps(engine.rec, memory, engine.now, stretch.dts[:k], stored, n,
                    waiting_counts(engine, stretch, k))
    return advance(engine, stretch, k)


def advance(engine: Engine, stretch: Plan, k: int) -> float:
    """Move the clock and the step counter past the first ``k`` steps of a recorded
    stretch (checked with ``check=True``); returns their duration."""
    engine.now = float(stretch.starts[k])
    engine.g += k
    engine.num_steps += k
    if engine.cfg.check:
        engine.check()
    return float(stretch.dts[:k].sum())
