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

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd
import simpy
from simpy.events import URGENT

from fragsim.cluster.disagg import DecodeSide, KVLink, PrefillSide
from fragsim.cluster.pools import ROLES, Pools, roles_of, route_disaggregated
from fragsim.cluster.routers import ROUTERS, make_router
from fragsim.errors import FragsimError
from fragsim.request_table import FINISHED


@dataclass
class ClusterResult:
    allocator: str
    summary: dict[str, Any]
    requests: pd.DataFrame
    instances: list[Any]        # each instance's RunResult
    timeseries: pd.DataFrame
    address_map: dict[str, Any] | None = None


def run_cluster(trace: Any, allocator_name: str, spec: Any, num_instances: int, router: str,
                progress: Callable[[int], None] | None = None, check: bool = False,
                slo_ttft_s: float = 2.0, slo_tpot_s: float = 0.1) -> ClusterResult:
    """Serve ``trace`` on ``num_instances`` copies of the deployment ``spec`` describes
    (with ``spec.prefill_instances`` and ``spec.decode_instances``, split by role)."""
    from fragsim.prefix import PrefixKeys
    from fragsim.simulate import RunResult, _model_gpu, make_engine
    from fragsim.simulate_summary import summarize

    if num_instances < 1:
        raise FragsimError(f"--instances must be >= 1, got {num_instances}")
    if router not in ROUTERS:
        raise FragsimError(f"--router must be one of {', '.join(ROUTERS)}, got {router!r}")
    roles = roles_of(replace(spec, instances=num_instances))
    keys = PrefixKeys(trace, spec.block_size) if spec.prefix_caching else None
    disaggregated = "prefill" in roles
    if disaggregated:
        _refuse_with_disaggregation(allocator_name, spec)
        # A prefill instance runs each prompt and its first token only (max_tokens=1).
        prompts_only = replace(trace, output_len=np.ones(len(trace), dtype=np.int64))
    engines = [make_engine(prompts_only if role == "prefill" else trace, allocator_name, spec,
                           check=check, prefix_keys=keys) for role in roles]
    try:
        policy = make_router(router, keys, np.asarray(trace.prompt_len), engines)
        pools = Pools(roles, engines, lambda pool: make_router(router, keys, np.asarray(trace.prompt_len), pool)) \
            if disaggregated else None
    except ValueError as exc:
        raise FragsimError(f"--router {router}: {exc}") from None
    done = [0] * num_instances
    if progress is not None:
        for i, engine in enumerate(engines):
            if roles[i] == "prefill":
                continue  # a request counts once, where it ends
            def report(n: int, i: int = i) -> None:
                done[i] = n
                progress(sum(done))
            engine.progress = report
    n = len(trace)
    env = simpy.Environment(initial_time=engines[0].now)
    link = None
    if pools is not None:
        link = _wire_disaggregation(env, trace, spec, engines, pools)
    elif num_instances == 1:  # one choice: nothing to decide, and exactly one run
        engines[0].requests.route_all(np.ones(n, dtype=bool))
    elif policy.static:
        where = policy.assign(n, num_instances)
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
    model, _ = _model_gpu(spec)
    kv_bytes = model.kv_bytes_per_token_per_gpu(spec.tp)
    results = []
    for i, engine in enumerate(engines):
        summary, requests = summarize(engine, allocator_name, wall / num_instances, kv_bytes)
        summary["instance"] = i
        summary["role"] = roles[i]
        requests.insert(0, "instance", i)
        results.append(RunResult(allocator_name, summary, requests, pd.DataFrame(engine.rec.timeseries())))
    requests = _requests(results, roles, link, trace)
    summary = _cluster_summary(allocator_name, engines, results, requests, wall, router, slo_ttft_s, slo_tpot_s)
    if pools is not None:
        assert link is not None
        summary.update(pools.summary())
        summary.update(_transfer_summary(link, engines, summary))
        summary["pools"] = _pool_summaries(allocator_name, engines, results, roles, wall, router,
                                           slo_ttft_s, slo_tpot_s)
    elif num_instances > 1 and hasattr(policy, "summary"):
        summary.update(policy.summary())
    series = pd.concat([r.timeseries.assign(instance=i) for i, r in enumerate(results)], ignore_index=True)
    return ClusterResult(allocator_name, summary, requests, results, series)


def _refuse_with_disaggregation(allocator_name: str, spec: Any) -> None:
    from fragsim.simulate import is_hybrid_manager

    if is_hybrid_manager(allocator_name):
        raise FragsimError(f"--prefill-instances with allocator {allocator_name!r}: prefill/decode "
                           "disaggregation runs over dense allocators in this release")
    if spec.kv_offloading_size is not None:
        raise FragsimError("--kv-offloading-size with --prefill-instances: an instance has one KV "
                           "connector in this release (an offload tier or a side of the transfer)")
    if spec.batching == "static":
        raise FragsimError("--batching static with --prefill-instances: disaggregation needs "
                           "continuous batching")


def _wire_disaggregation(env: simpy.Environment, trace: Any, spec: Any, engines: list[Any],
                         pools: Pools) -> KVLink:
    """The link, each side's connector, and the router process of a disaggregated cluster."""
    from fragsim.simulate import _model_gpu

    model, _ = _model_gpu(spec)
    try:
        link = KVLink(spec.kv_transfer_bandwidth_gbps * 1e9, spec.kv_transfer_latency_ms / 1e3,
                      model.kv_bytes_per_token_per_gpu(spec.tp), spec.tp, spec.block_size)
    except ValueError as exc:
        raise FragsimError(str(exc)) from None
    link.bind(env, len(engines))

    def hand_off(req: int, sender: int, now: float) -> None:
        """``req``'s prefill ended on ``sender`` at ``now``: its decode instance gets it then."""
        receiver = engines[pools.decode_of.pop(req)]

        def deliver(_: Any) -> None:
            receiver.requests.hand_in(req)
            receiver.connector.expect(req, sender)
            receiver.poke()
        _UrgentTimeout(env, now - env.now).callbacks.append(deliver)

    for i, (role, engine) in enumerate(zip(pools.roles, engines, strict=True)):
        link.pokes[i] = engine.poke
        engine.requests.route_as_they_come()
        if role == "prefill":
            engine.connector = PrefillSide(link, i, hand_off)
        elif role == "decode":
            engine.connector = DecodeSide(link, i, engine.requests)
            engine.requests.takes_hand_ins = True
    env.process(route_disaggregated(env, np.asarray(trace.arrival_s), np.asarray(trace.prompt_len),
                                    engines, pools, spec.pd_threshold, _UrgentTimeout))
    return link


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


#: split quantities added over instances (slots or bytes; means over each instance's span)
_SPLIT = ("token_states", "reservation", "internal_fragmentation", "free")


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def _requests(results: list[Any], roles: list[str], link: KVLink | None, trace: Any) -> pd.DataFrame:
    """One row per request: where it ended. A disaggregated request's row is its decode
    instance's, with its prefill instance and its transfer; one that ended on its
    prefill instance (refused there) keeps that row."""
    frames = [r.requests for r in results]
    if link is None:
        return pd.concat(frames).sort_values("request_id").reset_index(drop=True)
    prefill = pd.concat([f for f, role in zip(frames, roles, strict=True) if role == "prefill"])
    rest = pd.concat([f for f, role in zip(frames, roles, strict=True) if role != "prefill"])
    where = prefill.set_index("request_id")["instance"]
    rest["prefill_instance"] = rest["request_id"].map(where).fillna(-1).astype(np.int64)
    stuck = prefill[~prefill["request_id"].isin(rest["request_id"])].copy()
    stuck["output_len"] = np.asarray(trace.output_len)[stuck["request_id"].to_numpy()]
    stuck["prefill_instance"] = stuck["instance"]
    out = pd.concat([rest, stuck]).sort_values("request_id").reset_index(drop=True)
    moved = {job.req: job for job in link.done}
    ids = out["request_id"].tolist()
    out["kv_transfer_bytes"] = [moved[r].bytes if r in moved else 0 for r in ids]
    out["kv_transfer_s"] = [(moved[r].end or 0.0) - moved[r].ready if r in moved else math.nan for r in ids]
    return out


def _cluster_summary(allocator: str, engines: list[Any], results: list[Any], requests: pd.DataFrame,
                     wall: float, router: str, slo_ttft_s: float, slo_tpot_s: float) -> dict[str, Any]:
    """The cluster's figures under the keys of one run: counts summed, the split over
    every instance's pool together, latencies over every request (where it ended)."""
    per = [r.summary for r in results]
    cap = sum(engine.capacity for engine in engines)
    done = requests["status"] == "finished"
    # Every instance starts at the trace's first arrival and records until its last
    # request is done: the cluster's span is the longest.
    span = max(engine.rec.span_s for engine in engines)
    ttft, tpot, e2e = (requests[c].to_numpy(dtype=np.float64) for c in ("ttft_s", "tpot_s", "e2e_latency_s"))
    norm = requests["normalized_latency_s"].to_numpy(dtype=np.float64)
    d = done.to_numpy()
    out_tokens = int(requests.loc[done, "output_len"].sum()) * engines[0].cfg.width
    good = d & (ttft <= slo_ttft_s) & ~(tpot > slo_tpot_s)  # a one-token answer has no TPOT

    def pct(values: np.ndarray, q: float) -> float:
        return float(np.percentile(values, q)) if len(values) else math.nan

    summary: dict[str, Any] = {"allocator": allocator, "router": router, "num_instances": len(engines)}
    for key in per[0]:
        values = [s.get(key) for s in per]
        if key.startswith(("num_", "prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache")) \
                and all(isinstance(v, int | np.integer) for v in values):
            summary[key] = int(sum(values))
    # A disaggregated request also finishes on its prefill instance: it counts where it ends.
    ends = [s for s in per if s.get("role") != "prefill"] or per  # a prefill pool alone: its own
    for key in ("num_finished", "num_truncated"):
        summary[key] = int(sum(s[key] for s in ends))
    summary["num_requests"] = len(requests)
    summary["capacity_slots"] = sum(s["capacity_slots"] or 0 for s in per) or None
    summary["capacity_bytes"] = sum(s["capacity_bytes"] or 0 for s in per)
    means = {q: sum(e.rec.means()[q] for e in engines) for q in _SPLIT}
    held = sum(e.rec.mean_held() for e in engines)
    for q in _SPLIT:
        summary[f"{q}_frac"] = means[q] / cap if cap else 0.0
    sending = any(s.get("role") == "prefill" for s in per)  # held: for a transfer, else for stores
    summary["store_pending_frac"] = held / cap if cap and not sending else 0.0
    if sending:
        summary["mean_kv_sending_slots"] = held
        summary["kv_sending_frac"] = held / cap if cap else 0.0
    if per[0].get("mean_token_states_slots") is not None:
        for q in _SPLIT:
            summary[f"mean_{q}_slots"] = means[q]
    shared = sum(e.rec.mean_shared() for e in engines)
    physical = cap - means["free"]
    summary["mean_shared_slots"] = shared
    summary["blocks_saved_frac"] = shared / (physical + shared) if physical + shared > 0 else 0.0
    queries, hits = summary.get("prefix_cache_queries", 0), summary.get("prefix_cache_hits", 0)
    summary.update({
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "mean_running": sum(s["mean_running"] for s in per),
        "peak_running": sum(s["peak_running"] for s in per),
        "mean_waiting": sum(s["mean_waiting"] for s in per),
        "mean_external_fragmentation_ratio": float(np.mean([s["mean_external_fragmentation_ratio"] for s in per])),
        "peak_external_fragmentation_ratio": max(s["peak_external_fragmentation_ratio"] for s in per),
        "throughput_tokens_per_s": out_tokens / span if span > 0 else 0.0,
        "throughput_requests_per_s": float(d.sum()) / span if span > 0 else 0.0,
        "goodput_rps": float(good.sum()) / span if span > 0 else 0.0,
        "slo_ttft_s": slo_ttft_s,
        "slo_tpot_s": slo_tpot_s,
        "mean_ttft_s": float(np.mean(ttft[d])) if d.any() else math.nan,
        "p50_ttft_s": pct(ttft[d], 50),
        "p99_ttft_s": pct(ttft[d], 99),
        "mean_tpot_s": float(np.nanmean(tpot[d])) if np.isfinite(tpot[d]).any() else math.nan,
        "p99_tpot_s": pct(tpot[d][np.isfinite(tpot[d])], 99),
        "mean_e2e_latency_s": float(np.mean(e2e[d])) if d.any() else math.nan,
        "p99_e2e_latency_s": pct(e2e[d], 99),
        "mean_normalized_latency_s": float(np.mean(norm[d])) if d.any() else math.nan,
        "load_imbalance": _imbalance(per),
        "sim_time_s": span,
        "wall_time_s": wall,
        "instances": per,
    })
    # Other keys of one run: the instances' common value, or None where they differ
    # (a per-instance figure that does not add up; see "instances").
    for key in per[0]:
        if key not in summary:
            values = [s.get(key) for s in per]
            same = all(_equal(v, values[0]) for v in values[1:])
            summary[key] = values[0] if same else None
    assert int((requests["status"] == "finished").sum()) == sum(
        int((e.requests.status == FINISHED).sum()) for e, s in zip(engines, per, strict=True) if s in ends)
    return summary


def _imbalance(per: list[dict[str, Any]]) -> float:
    """How unevenly the work spread: in each pool, the busiest instance's requests over
    the pool's mean; the largest of those."""
    worst = 1.0
    for role in {s.get("role", "mixed") for s in per}:
        counts = [s["num_requests"] for s in per if s.get("role", "mixed") == role]
        if sum(counts):
            worst = max(worst, max(counts) / (sum(counts) / len(counts)))
    return worst


def _pool_summaries(allocator: str, engines: list[Any], results: list[Any], roles: list[str],
                    wall: float, router: str, slo_ttft_s: float, slo_tpot_s: float) -> list[dict[str, Any]]:
    """One summary per pool (instances of one role), with the cluster's keys; a prefill
    pool's latencies are its own (the first token its prefill makes)."""
    out = []
    for role in ROLES:
        members = [i for i, r in enumerate(roles) if r == role]
        if not members:
            continue
        part = [results[i] for i in members]
        requests = pd.concat([r.requests for r in part], ignore_index=True)
        summary = _cluster_summary(allocator, [engines[i] for i in members], part, requests, wall,
                                   router, slo_ttft_s, slo_tpot_s)
        summary.pop("instances")
        summary.update(role=role, instance_ids=members)
        out.append(summary)
    return out


def _transfer_summary(link: KVLink, engines: list[Any], summary: dict[str, Any]) -> dict[str, Any]:
    """Where the bytes are while requests change instance, besides the prefill side's
    copies held for a transfer (``kv_sending_frac``, a part of the split): the decode
    side's blocks reserved for one (part of ``reservation``), and the bytes at both
    ends (counted in both)."""
    cap = sum(engine.capacity for engine in engines)
    span = summary["sim_time_s"]
    out = link.summary(span)
    out.update({
        "kv_receiving_frac": out["mean_kv_receiving_slots"] / cap if cap else 0.0,
        "kv_duplicated_frac": out["mean_kv_duplicated_slots"] / cap if cap else 0.0,
    })
    return out
