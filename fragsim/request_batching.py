"""Request-level (``static``) batching, as HuggingFace ``generate`` and FasterTransformer do.

A batch forms when none runs: waiting requests are admitted first-come
first-served while the allocator and ``max_num_seqs`` allow, all prefill in the
batch's first step, and the batch decodes (finished members padding along) until
its longest member is done; then every member returns and frees its memory. The
seeds' "8 + 8 + 4" is this mode with room for 8.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fragsim.kv.protocol import Rows

if TYPE_CHECKING:
    from fragsim.engine import Engine


def static_step(engine: Engine) -> float:
    """Request-level batching: form a batch, or run the current one one step."""
    engine.step_extra = 0.0
    engine.freed = False
    engine.chunks = []
    engine.pull_arrivals()
    engine.expire_waiting()
    b, reqs = engine.batch, engine.requests
    if not engine.static_running:
        engine.budget = 1 << 62  # the whole batch prefills in its first step
        engine.admit_waiting()
        if not engine.prefilling:
            return 0.0
        engine.static_running = True
    n = b.n + len(engine.prefilling)
    decode_context = int(b.offset[: b.n].sum()) + b.n * engine.g
    if engine.chunks:
        tokens = sum(c for _, c in engine.chunks)
        units = sum(c * (c - 1) // 2 for _, c in engine.chunks)
        dt = engine.cost.step_time(tokens, units, b.n, decode_context)
    else:
        dt = float(engine.cost.decode_step_times(n, np.array([decode_context]))[0])
    token_states = int(np.minimum(b.offset[: b.n] + engine.g, b.final[: b.n]).sum())
    engine.kv.record(engine.rec, engine.now, dt, token_states, engine, n, len(engine.waiting))
    if engine.observer is not None:
        engine.observer.before_step(engine, dt)
    engine.now = engine.now + dt
    engine.num_steps += 1
    engine.g += 1
    for p, chunk in engine.chunks:
        engine.num_prefill_tokens += chunk
        reqs.generated[p.req] += 1
        reqs.first_token[p.req] = engine.now
        b.add(p.req, p.target + 1, engine.g, p.rooms[0], int(reqs.final[p.req]))
    engine.prefilling.clear()
    if b.n and bool(np.all(b.offset[: b.n] + engine.g >= b.final[: b.n])):
        for row in range(b.n):
            req = int(b.req[row])
            engine.kv.free(req)
            engine.finish_request(req)
        b.clear()
        engine.static_running = False
    engine.quiet = engine.static_running
    if engine.observer is not None:
        engine.observer.after_step(engine)
    return dt

def static_jump(engine: Engine) -> float:
    b, cfg, reqs = engine.batch, engine.cfg, engine.requests
    n = b.n
    if not engine.quiet or cfg.exact_steps or n == 0:
        return 0.0
    filled0 = b.offset[:n] + engine.g
    remaining = b.final[:n] - filled0
    k = min(int(remaining.max()) - 1, cfg.max_jump_steps)
    if k <= 0:
        return 0.0
    steps = np.arange(k, dtype=np.int64)
    ctx = int(filled0.sum()) + n * steps
    dts = engine.cost.decode_step_times(n, ctx)
    starts = np.cumsum(np.concatenate(([engine.now], dts)))
    if cfg.queue_timeout_s is not None:
        first = next((r for r in engine.waiting if reqs.preemptions[r] == 0), None)
        if first is None and reqs.next_servable[reqs.next_row] < reqs.N:
            first = int(reqs.next_servable[reqs.next_row])
            if reqs.arrival[first] > starts[k - 1]:
                first = None
        if first is not None:
            hit = np.flatnonzero(starts[:k] - reqs.arrival[first] > cfg.queue_timeout_s)
            if len(hit):
                k = int(hit[0])
                if k <= 0:
                    return 0.0
    # Σ_r min(filled0_r + j, final_r) = Σ filled0 + Σ_r min(j, remaining_r)
    rem = np.sort(remaining)
    below = np.searchsorted(rem, steps[:k], side="left")
    rem_cum = np.concatenate(([0], np.cumsum(rem)))
    token_states = int(filled0.sum()) + rem_cum[below] + steps[:k] * (n - below)
    pulled = np.searchsorted(reqs.arrival, starts[:k], side="right")
    waiting = len(engine.waiting) + reqs.servable_cum[pulled] - reqs.servable_cum[reqs.next_row]
    b_rows = Rows(b.seq[:n], b.req[:n], filled0, b.room[:n], b.final[:n])
    engine.kv.record_steps(engine.rec, engine.kv.stretch(b_rows, k, None, False), engine.now, dts[:k],
                           token_states, n, waiting)
    engine.now = float(starts[k])
    engine.g += k
    engine.num_steps += k
    return float(dts[:k].sum())
