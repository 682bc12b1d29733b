"""Preemption and swapping: who gives memory back when a decoding sequence cannot
grow, where it goes, and when a swapped-out request comes back.

The victim is the latest-arrived running request, all of its sequences, whether it
decodes or is still prefilling. With ``preemption="swap"`` a lone decoding sequence
moves to CPU swap space while that has room (its transfer adds to the step's
time; with a CPU offload tier, swap space is taken from the tier, one host pool);
otherwise the request is recomputed: it rejoins the queue's head and
re-prefills its prompt and every token generated so far (a group of samples or
beams restarts from its prompt). Swapped requests resume, earliest first, each
step before the queue is admitted. The engine (:mod:`fragsim.engine`) calls these
where its step needs them; they act on its batch, queues and request table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fragsim.request_table import RUNNING, SWAPPED, WAITING

if TYPE_CHECKING:
    from fragsim.engine import Engine


def preempt_latest(engine: Engine) -> int:
    """Preempt the latest-arrived running request, all of its sequences; returns it."""
    b, kv, reqs = engine.batch, engine.kv, engine.requests
    cand = int(b.req[: b.n].max()) if b.n else -1
    # Only the running set is preempted: a request waiting for its KV, or for a slot
    # once it landed, keeps its blocks (vLLM 0.33 preempts from ``running`` alone).
    running = [p for p in engine.prefilling if p.running]
    pre = max(running, key=lambda p: p.req) if running else None
    if pre is not None and pre.req > cand:
        reqs.cached[pre.req] = 0  # its next placement finds the cache anew
        engine.prefilling.remove(pre)
        held = sum(kv.free(seq) for seq in pre.seqs)
        requeue(engine, pre.req, 0, held)
        return pre.req
    if cand < 0:
        raise RuntimeError("growth failed with nothing running to preempt")
    reqs.cached[cand] = 0
    rows = np.flatnonzero(b.req[: b.n] == cand)
    rows = rows[np.argsort(b.seq[rows])]
    filled = int(b.offset[rows[0]]) + engine.g
    held = 0
    for seq in b.seq[rows].tolist():
        held += kv.free(seq)
        if engine.beams is not None:
            engine.beams.forget(seq)  # a group restarts from its prompt
    b.remove_rows(rows)
    alone = len(rows) == 1 and engine.width == 1
    if alone:
        # Recompute re-prefills the prompt and every token generated so far.
        reqs.generated[cand] = filled - int(reqs.prompt[cand])
    requeue(engine, cand, filled if alone else 0, held)  # a group is recomputed, never swapped
    return cand


def requeue(engine: Engine, req: int, filled: int, held: int) -> None:
    """Swap ``req`` out (``filled`` tokens, ``held`` slots) if it may, else queue it first
    for recompute."""
    cfg, reqs = engine.cfg, engine.requests
    reqs.preemptions[req] += 1
    c = engine.rec.counters
    if cfg.preemption == "swap" and filled > 0 and _room_to_swap(engine, held):
        engine.swapped.append((req, filled, held))
        reqs.status[req] = SWAPPED
        c.num_preemptions_swap += 1
        engine.step_extra += held * cfg.kv_bytes_per_token / cfg.swap_bandwidth
    else:
        reqs.status[req] = WAITING
        engine.waiting.appendleft(req)
        c.num_preemptions_recompute += 1
    engine.freed = True


def _room_to_swap(engine: Engine, held: int) -> bool:
    """Take host memory for ``held`` slots: from the CPU offload tier when there is one
    (one host pool), else from the swap space."""
    pool = engine.connector.host_pool if engine.connector is not None else None
    if pool is not None:
        return pool.swap_out(held, engine.now)
    if engine.swap_used + held > engine.cfg.swap_space_slots:
        return False
    engine.swap_used += held
    return True


def resume_swapped(engine: Engine) -> None:
    """Swap requests back in, earliest first, while the batch limits and memory allow."""
    cfg, reqs = engine.cfg, engine.requests
    while engine.swapped and engine.num_running() < cfg.max_num_seqs and engine.budget > 0:
        req, filled, cpu_slots = engine.swapped[0]
        final = int(reqs.final[req])
        admitted = engine.kv.admit((req,), filled + 1, final, int(reqs.prompt[req]), None)
        if admitted is None:
            return
        engine.swapped.popleft()
        pool = engine.connector.host_pool if engine.connector is not None else None
        if pool is not None:
            pool.swap_in(cpu_slots, engine.now)
        else:
            engine.swap_used -= cpu_slots
        engine.batch.add(req, filled, engine.g, admitted.rooms[0], final)
        reqs.status[req] = RUNNING
        engine.budget -= 1
        engine.step_extra += filled * cfg.kv_bytes_per_token / cfg.swap_bandwidth
