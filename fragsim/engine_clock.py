"""The engine in time: its SimPy process, and how it idles and wakes.

An engine (:class:`fragsim.engine.Engine`) runs steps back to back while it has work:
a stretch of uneventful decode steps at once where :mod:`fragsim.stretch` allows, else
one step. With nothing to compute it idles until something happens by itself (the
next arrival, a transfer landing), recording the pool as it stands meanwhile; in a
cluster, a request routed or handed to it, or a transfer it waits on starting, wakes
it sooner (:meth:`Engine.poke <fragsim.engine.Engine.poke>`). With nothing at all to
wait for, it waits for such a poke.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import simpy

from fragsim import request_batching, stretch
from fragsim.engine_views import live_sequences

if TYPE_CHECKING:
    from fragsim.engine import Engine



def idle_target(engine: Engine) -> float:
    """Nothing to compute: when something next happens here by itself, the next
    arrival or the next transfer landing (inf: nothing known)."""
    target = engine.requests.next_arrival()
    if engine.connector is not None:
        landing = engine.connector.next_done()
        if landing is not None:
            target = min(target, max(landing, engine.now))
    return target


def record_idle(engine: Engine, dt: float) -> None:
    if dt <= 0:
        return
    if engine.connector is not None:
        engine.record_step(dt, 0)  # blocks may be held for transfers meanwhile
    else:
        engine.kv.record(engine.rec, engine.now, dt, 0, engine, 0, len(engine.waiting))


def process(engine: Engine, env: simpy.Environment):  # type: ignore[no-untyped-def]
    """The engine's SimPy process: steps while there is work, idles in between."""
    from fragsim.engine import Engine

    static = engine.cfg.batching == "static"
    step, jump = (request_batching.static_step, request_batching.static_jump) if static \
        else (Engine.step, stretch.jump)
    reqs, connector = engine.requests, engine.connector
    while not reqs.all_done() or (connector is not None and connector.pending_at_end()):
        dt = (0.0 if connector is not None and connector.busy else jump(engine)) or step(engine)
        if not dt:
            busy = engine.num_running() or engine.waiting or engine.swapped
            in_flight = connector is not None and connector.busy
            if busy and reqs.next_arrival() == math.inf and not in_flight and reqs.routing_done:
                raise RuntimeError(
                    f"scheduler stalled at t={engine.now:.3f}s with {len(engine.waiting)} waiting and "
                    f"nothing running; this is a bug (please report the configuration)")
            target = idle_target(engine)
            if engine.now < target < math.inf:
                yield from idle_until(engine, env, target)
                continue
            if target == math.inf and (in_flight or (not busy and not reqs.routing_done)):
                # the router, or the other side of a transfer, wakes it
                yield from wait_for_wake(engine, env)
                continue
            if not busy and not in_flight:
                continue
        _count_event(engine)
        yield env.timeout(max(0.0, engine.now - env.now))


def idle_until(engine: Engine, env: simpy.Environment, target: float):  # type: ignore[no-untyped-def]
    """Idle until ``target``; in a cluster, a poke (a request routed or handed in, a
    transfer started) ends the wait sooner."""
    wait = env.timeout(max(0.0, target - env.now))
    if engine.requests.dynamic:
        engine.wake = env.event()
        yield wait | engine.wake
        engine.wake = None
    else:
        yield wait
    now = target if wait.processed else float(env.now)
    record_idle(engine, now - engine.now)
    engine.now = now
    _count_event(engine)


def wait_for_wake(engine: Engine, env: simpy.Environment):  # type: ignore[no-untyped-def]
    """Idle until a poke: the cluster's router sent a request here (or routed its
    last), or a transfer this instance waits on started."""
    engine.wake = env.event()
    yield engine.wake
    engine.wake = None
    record_idle(engine, env.now - engine.now)
    engine.now = max(engine.now, float(env.now))


def _count_event(engine: Engine) -> None:
    """One more SimPy timeout; the address map samples the pool when it is due."""
    engine.num_events += 1
    if engine.address_sampler.due(engine.now):
        engine.address_sampler.sample(engine.now, {s.seq_id: s.filled for s in live_sequences(engine)})
