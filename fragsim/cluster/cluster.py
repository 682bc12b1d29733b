"""Many instances of one deployment behind a router, in one SimPy environment.

Every instance is today's engine (:class:`fragsim.engine.Engine`) with its own KV
manager, cost model and recorder, built from the same :class:`RunSpec`; it sees
the whole trace but serves only the rows routed to it
(:meth:`RequestTable.route_all <fragsim.request_table.RequestTable.route_all>` for a
router that reads no state, :meth:`route_as_they_come
<fragsim.request_table.RequestTable.route_as_they_come>` for one that does).

A dynamic router is a process of the same environment: at each arrival it wakes
with urgent priority, so that it routes before any instance's step at that time
(as a lone engine pulls a request that arrives at the start of its step), asks the
policy (:mod:`fragsim.cluster.routers`), and wakes the instance if it was idle.
Instances then never run a stretch of decode steps past the next arrival, since any
arrival may come to them. Prefix keys are one object shared by every instance, so
that a prefix-aware router compares like with like.

One instance behind any router is exactly ``fragsim run``: the same rows, the same
steps (the tests hold it to that).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd
import simpy
from simpy.events import URGENT

from fragsim.cluster.disagg import DecodeSide, KVLink, PrefillSide
from fragsim.cluster.pools import Pools, roles_of, route_disaggregated
from fragsim.cluster.routers import ROUTERS, RouterOptions, make_router
from fragsim.cluster.summary import (
    cluster_summary,
    pool_summaries,
    requests_table,
    transfer_summary,
)
from fragsim.connector import MultiConnector
from fragsim.errors import FragsimError


@dataclass
class ClusterResult:
    allocator: str
    summary: dict[str, Any]
    requests: pd.DataFrame
    instances: list[Any]        # each instance's RunResult
    timeseries: pd.DataFrame
    address_map: dict[str, Any] | None = None
    transfers: pd.DataFrame | None = None   # one row per KV transfer (prefill/decode split)


@dataclass(frozen=True)
class Member:
    """One instance: the pool it belongs to, its role, its deployment and allocator."""

    pool: str
    role: str
    spec: Any                   # a RunSpec: model, GPU, tp, pool size, limits, cost model
    allocator: str


@dataclass(frozen=True)
class Settings:
    """What the cluster shares: its router, its SLOs and the prefill-to-decode link."""

    router: str = "round-robin"
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.1
    kv_transfer_bandwidth_gbps: float = 25.0
    kv_transfer_latency_ms: float = 1.0
    pd_threshold: int = 0
    router_weights: tuple[float, float, float] = (2.0, 1.0, 1.0)
    router_snapshot_ms: float = 0.0
    router_kv_events_ms: float | None = None
    kv_transfer_layerwise: bool = False


def run_cluster(trace: Any, allocator_name: str, spec: Any, num_instances: int, router: str,
                progress: Callable[[int], None] | None = None, check: bool = False,
                slo_ttft_s: float = 2.0, slo_tpot_s: float = 0.1) -> ClusterResult:
    """Serve ``trace`` on ``num_instances`` copies of the deployment ``spec`` describes
    (with ``spec.prefill_instances`` and ``spec.decode_instances``, split by role)."""
    if num_instances < 1:
        raise FragsimError(f"--instances must be >= 1, got {num_instances}")
    roles = roles_of(replace(spec, instances=num_instances))
    members = [Member(role, role, spec, allocator_name) for role in roles]
    settings = Settings(router, slo_ttft_s, slo_tpot_s, spec.kv_transfer_bandwidth_gbps,
                        spec.kv_transfer_latency_ms, spec.pd_threshold, spec.router_weights,
                        spec.router_snapshot_ms, spec.router_kv_events_ms, spec.kv_transfer_layerwise)
    return run_members(trace, members, settings, allocator_name, progress, check)


def run_members(trace: Any, members: list[Member], settings: Settings, label: str,
                progress: Callable[[int], None] | None = None, check: bool = False) -> ClusterResult:
    """Serve ``trace`` on one instance per member, behind ``settings.router``."""
    from fragsim.prefix import PrefixKeys
    from fragsim.simulate import RunResult, _model_gpu, make_engine
    from fragsim.simulate_summary import summarize

    router = settings.router
    if router not in ROUTERS:
        raise FragsimError(f"--router must be one of {', '.join(ROUTERS)}, got {router!r}")
    roles = [m.role for m in members]
    block = _one_block_size(members)
    keys = PrefixKeys(trace, block) if any(m.spec.prefix_caching for m in members) else None
    disaggregated = "prefill" in roles
    if settings.kv_transfer_layerwise and not disaggregated:
        raise FragsimError("--kv-transfer-layerwise: needs a prefill/decode split (--prefill-instances "
                           "and --decode-instances)")
    if disaggregated:
        _refuse_with_disaggregation(members, settings)
        # A prefill instance runs each prompt and its first token only (max_tokens=1).
        prompts_only = replace(trace, output_len=np.ones(len(trace), dtype=np.int64))
    engines = [make_engine(prompts_only if m.role == "prefill" else trace, m.allocator, m.spec,
                           check=check, prefix_keys=keys) for m in members]
    prompt = np.asarray(trace.prompt_len)
    try:
        session = getattr(trace, "session", None)
        options = RouterOptions(settings.router_weights, settings.router_snapshot_ms / 1e3,
                                None if settings.router_kv_events_ms is None else settings.router_kv_events_ms / 1e3)
        policy = None if disaggregated else make_router(router, keys, prompt, engines, session, options)
        pools = Pools(roles, engines, lambda pool: make_router(router, keys, prompt, pool, session, options)) \
            if disaggregated else None
    except ValueError as exc:
        raise FragsimError(f"--router {router}: {exc}") from None
    _report_progress(engines, roles, progress)
    n = len(trace)
    env = simpy.Environment(initial_time=engines[0].now)
    link = None
    if pools is not None:
        link = _wire_disaggregation(env, trace, members, settings, engines, pools)
    elif len(engines) == 1:  # one choice: nothing to decide, and exactly one run
        engines[0].requests.route_all(np.ones(n, dtype=bool))
    elif policy is not None and policy.static:
        where = policy.assign(n, len(engines))
        for i, engine in enumerate(engines):
            engine.requests.route_all(where == i)
    else:
        for engine in engines:
            engine.requests.route_as_they_come()
        env.process(_route(env, np.asarray(trace.arrival_s), engines, policy))
    t0 = time.perf_counter()
    processes = [engine.start(env) for engine in engines]
    if pools is not None:
        _end_hand_ins_with_prefills(env, processes, engines, pools)
    env.run()
    wall = time.perf_counter() - t0
    for engine in engines:
        engine.finish_run()
    results = []
    for i, (m, engine) in enumerate(zip(members, engines, strict=True)):
        model, _ = _model_gpu(m.spec)
        kv_bytes = model.kv_bytes_per_token_per_gpu(m.spec.tp)
        summary, requests = summarize(engine, m.allocator, wall / len(engines), kv_bytes)
        summary.update(instance=i, pool=m.pool, role=m.role)
        requests.insert(0, "instance", i)
        results.append(RunResult(m.allocator, summary, requests, pd.DataFrame(engine.rec.timeseries())))
    requests = requests_table(results, roles, link, trace)
    summary = cluster_summary(label, engines, results, requests, wall, router, settings.slo_ttft_s,
                              settings.slo_tpot_s)
    if pools is not None:
        assert link is not None
        summary.update(pools.summary())
        summary.update(transfer_summary(link, engines, summary))
    elif len(engines) > 1 and policy is not None:
        summary.update(policy.summary())
    names = [m.pool for m in members]
    if len(set(names)) > 1:
        summary["pools"] = pool_summaries(label, engines, results, names, roles, wall, router,
                                          settings.slo_ttft_s, settings.slo_tpot_s)
    series = pd.concat([r.timeseries.assign(instance=i) for i, r in enumerate(results)], ignore_index=True)
    transfers = link.table() if link is not None else None
    return ClusterResult(label, summary, requests, results, series, transfers=transfers)


def _one_block_size(members: list[Member]) -> int:
    sizes = {m.spec.block_size for m in members}
    if len(sizes) > 1:
        raise FragsimError(f"block_size: the pools differ ({', '.join(map(str, sorted(sizes)))}); a "
                           "cluster's pools share one block size (prefix keys, KV transfers)")
    return sizes.pop()


def _report_progress(engines: list[Any], roles: list[str], progress: Callable[[int], None] | None) -> None:
    """Requests done, counted where they end (not on a prefill instance)."""
    if progress is None:
        return
    done = [0] * len(engines)
    for i, engine in enumerate(engines):
        if roles[i] == "prefill":
            continue

        def report(n: int, i: int = i) -> None:
            done[i] = n
            progress(sum(done))
        engine.progress = report


def _refuse_with_disaggregation(members: list[Member], settings: Settings) -> None:
    from fragsim.simulate import is_hybrid_manager

    hybrid = {is_hybrid_manager(m.allocator) for m in members}
    if len(hybrid) > 1:
        names = ", ".join(sorted({m.allocator for m in members}))
        raise FragsimError(f"allocator: a disaggregated cluster runs either hybrid KV managers or dense "
                           f"allocators on every instance, got {names}")
    for m in members:
        spec = m.spec
        if spec.scheduler != "vllm-v1":
            raise FragsimError(f"--scheduler {spec.scheduler} with --prefill-instances: disaggregation "
                               "runs under today's scheduler (vllm-v1)")
        if spec.batching == "static":
            raise FragsimError("--batching static with --prefill-instances: disaggregation needs "
                               "continuous batching")
        if settings.kv_transfer_layerwise and spec.queue_timeout_s is not None:
            raise FragsimError("--queue-timeout with --kv-transfer-layerwise: a push's two sides "
                               "would have to cancel each other's reservations, not modelled")


def _wire_disaggregation(env: simpy.Environment, trace: Any, members: list[Member], settings: Settings,
                         engines: list[Any], pools: Pools) -> KVLink:
    """The link, each side's connector, and the router process of a disaggregated cluster."""
    from fragsim.simulate import _model_gpu

    sides = [m for m in members if m.role != "mixed"]
    models = {_model_gpu(m.spec)[0].name for m in sides}
    if len(models) > 1:
        raise FragsimError(f"model: the prefill and decode pools serve different models "
                           f"({', '.join(sorted(models))}); a decode instance reads the KV a prefill made")
    token_bytes = [_model_gpu(m.spec)[0].kv_bytes_per_token_per_gpu(m.spec.tp) * m.spec.tp for m in members]
    layers = [_model_gpu(m.spec)[0].num_layers for m in members] if settings.kv_transfer_layerwise else None
    try:
        link = KVLink(settings.kv_transfer_bandwidth_gbps * 1e9, settings.kv_transfer_latency_ms / 1e3,
                      token_bytes, [m.spec.tp for m in members], members[0].spec.block_size, layers)
    except ValueError as exc:
        raise FragsimError(str(exc)) from None
    link.bind(env, len(engines))

    def hand_off(req: int, sender: int, now: float) -> None:
        """``req``'s prefill ended on ``sender`` at ``now``: its decode instance gets it then."""
        index = pools.decode_of.pop(req)
        receiver, side = engines[index], link.receivers[index]

        def deliver(_: Any) -> None:
            receiver.requests.hand_in(req)
            side.expect(req, sender)
            receiver.poke()
        _UrgentTimeout(env, now - env.now).callbacks.append(deliver)

    def push(req: int, sender: int, index: int) -> bool:
        """At ``req``'s arrival: its decode instance gets it now, to reserve before its
        prefill runs on ``sender``; False (pulled instead): either side refuses it."""
        receiver = engines[index]
        if not (engines[sender].requests.servable[req] and receiver.requests.servable[req]):
            return False
        link.senders[sender].expect_push(req)
        receiver.requests.hand_in(req)
        link.receivers[index].expect(req, sender, push=True)
        receiver.poke()
        return True

    for i, (role, engine) in enumerate(zip(pools.roles, engines, strict=True)):
        link.pokes[i] = engine.poke
        engine.requests.route_as_they_come()
        side: Any = None
        if role == "prefill":
            side = PrefillSide(link, i, hand_off, _keep_window(engine))
        elif role == "decode":
            side = DecodeSide(link, i, engine.requests, _payload(engine, members[i].spec.tp))
            engine.requests.takes_hand_ins = True
        if side is not None:  # the transfer first, then an offload tier (as llm-d stacks them)
            engine.connector = side if engine.connector is None else MultiConnector([side, engine.connector])
    env.process(route_disaggregated(env, np.asarray(trace.arrival_s), np.asarray(trace.prompt_len),
                                    engines, pools, settings.pd_threshold, _UrgentTimeout,
                                    push if settings.kv_transfer_layerwise else None))
    return link


def _keep_window(engine: Any) -> Callable[[int, int], None] | None:
    """A prefill instance's hybrid KV manager keeps what the decode side's first step
    reads of a finished request (it recomputes the last prompt token); None: dense."""
    keep = getattr(engine.kv, "keep", None)
    if keep is None:
        return None
    final = engine.requests.final
    return lambda seq, req: keep(seq, int(final[req]) - 2)  # the prompt less its last token


def _payload(engine: Any, tp: int) -> Callable[[int, int, int], tuple[int, dict[str, int]]] | None:
    """What a decode instance's hybrid KV manager placed for a transfer (bytes of one
    GPU; bytes of every GPU by layer kind); None: dense (whole blocks of every layer)."""
    moved = getattr(engine.kv, "moved", None)
    if moved is None:
        return None

    def payload(req: int, first: int, last: int) -> tuple[int, dict[str, int]]:
        units, by_kind = moved(req, first, last)
        return units, {kind: size * tp for kind, size in by_kind.items()}
    return payload


def _end_hand_ins_with_prefills(env: simpy.Environment, processes: list[Any], engines: list[Any],
                                pools: Pools) -> None:
    """Once every prefill instance has ended, no more requests come to a decode instance."""
    prefills = [processes[i] for i in pools.members["prefill"]]

    def close(_: Any) -> None:
        for i in pools.members["decode"]:
            engines[i].requests.routing_done = True
            engines[i].poke()
    simpy.AllOf(env, prefills).callbacks.append(close)


class _UrgentTimeout(simpy.events.Event):
    """A timeout that fires before the ordinary events of its time (SimPy's own
    ``Timeout``, at urgent priority)."""

    def __init__(self, env: simpy.Environment, delay: float) -> None:
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, URGENT, delay)


def _route(env: simpy.Environment, arrival: np.ndarray, engines: list[Any], policy: Any):  # type: ignore[no-untyped-def]
    """At each arrival, first of everything at that time: pick an instance, send it there."""
    for req, t in enumerate(arrival.tolist()):
        if t > env.now:
            yield _UrgentTimeout(env, t - env.now)
        i = policy.pick(req, engines)
        engine = engines[i]
        engine.requests.route(req)
        policy.routed(req, i, engines)
        engine.poke()
    for engine in engines:
        engine.requests.routing_done = True
        engine.poke()
