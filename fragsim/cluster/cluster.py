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
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import simpy
from simpy.events import URGENT

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
    """Serve ``trace`` on ``num_instances`` copies of the deployment ``spec`` describes."""
    from fragsim.prefix import PrefixKeys
    from fragsim.simulate import RunResult, _model_gpu, make_engine
    from fragsim.simulate_summary import summarize

    if num_instances < 1:
        raise FragsimError(f"--instances must be >= 1, got {num_instances}")
    if router not in ROUTERS:
        raise FragsimError(f"--router must be one of {', '.join(ROUTERS)}, got {router!r}")
    keys = PrefixKeys(trace, spec.block_size) if spec.prefix_caching else None
    engines = [make_engine(trace, allocator_name, spec, check=check, prefix_keys=keys)
               for _ in range(num_instances)]
    try:
        policy = make_router(router, keys, np.asarray(trace.prompt_len), engines)
    except ValueError as exc:
        raise FragsimError(f"--router {router}: {exc}") from None
    done = [0] * num_instances
    if progress is not None:
        for i, engine in enumerate(engines):
            def report(n: int, i: int = i) -> None:
                done[i] = n
                progress(sum(done))
            engine.progress = report
    n = len(trace)
    env = simpy.Environment(initial_time=engines[0].now)
    if num_instances == 1:  # one choice: nothing to decide, and exactly one run
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
    for engine in engines:
        engine.start(env)
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
        requests.insert(0, "instance", i)
        results.append(RunResult(allocator_name, summary, requests, pd.DataFrame(engine.rec.timeseries())))
    summary = _cluster_summary(allocator_name, engines, results, wall, router, slo_ttft_s, slo_tpot_s)
    if num_instances > 1 and hasattr(policy, "summary"):
        summary.update(policy.summary())
    requests = pd.concat([r.requests for r in results]).sort_values("request_id").reset_index(drop=True)
    series = pd.concat([r.timeseries.assign(instance=i) for i, r in enumerate(results)], ignore_index=True)
    return ClusterResult(allocator_name, summary, requests, results, series)


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
        if engine.wake is not None and not engine.wake.triggered:
            engine.wake.succeed()
    for engine in engines:
        engine.requests.routing_done = True
        if engine.wake is not None and not engine.wake.triggered:
            engine.wake.succeed()


#: split quantities added over instances (slots or bytes; means over each instance's span)
_SPLIT = ("token_states", "reservation", "internal_fragmentation", "free")


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def _cluster_summary(allocator: str, engines: list[Any], results: list[Any], wall: float, router: str,
                     slo_ttft_s: float, slo_tpot_s: float) -> dict[str, Any]:
    """The cluster's figures under the keys of one run: counts summed, the split over
    every instance's pool together, latencies over every request."""
    per = [r.summary for r in results]
    requests = pd.concat([r.requests for r in results], ignore_index=True)
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
        values = [s[key] for s in per]
        if key.startswith(("num_", "prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache")) \
                and all(isinstance(v, int | np.integer) for v in values):
            summary[key] = int(sum(values))
    summary["num_requests"] = len(requests)
    summary["capacity_slots"] = sum(s["capacity_slots"] or 0 for s in per) or None
    summary["capacity_bytes"] = sum(s["capacity_bytes"] or 0 for s in per)
    means = {q: sum(e.rec.means()[q] for e in engines) for q in _SPLIT}
    held = sum(e.rec.mean_held() for e in engines)
    for q in _SPLIT:
        summary[f"{q}_frac"] = means[q] / cap if cap else 0.0
    summary["store_pending_frac"] = held / cap if cap else 0.0
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
        # how unevenly the work spread: the busiest instance's requests over the mean
        "load_imbalance": (max(s["num_requests"] for s in per) / (len(requests) / len(per))
                           if len(requests) else 1.0),
        "sim_time_s": span,
        "wall_time_s": wall,
        "instances": per,
    })
    # Other keys of one run: the instances' common value, or None where they differ
    # (a per-instance figure that does not add up; see "instances").
    for key in per[0]:
        if key not in summary:
            values = [s[key] for s in per]
            same = all(_equal(v, values[0]) for v in values[1:])
            summary[key] = values[0] if same else None
    assert int((requests["status"] == "finished").sum()) == sum(
        int((e.requests.status == FINISHED).sum()) for e in engines)
    return summary
