"""A cluster of instances behind a router (fragsim.cluster)."""

from __future__ import annotations

import numpy as np
import pytest

from fragsim.cluster import run_cluster
from fragsim.errors import FragsimError
from fragsim.simulate import RunSpec, load_workload, simulate
from fragsim.traces import Trace
from fragsim.traces.sessions import SessionSpec, make_sessions

#: what differs by construction: host time, and how an idle instance waits (SimPy events)
NOT_COMPARED = {"wall_time_s", "num_events"}


def spec(**kw: object) -> RunSpec:
    base: dict[str, object] = dict(trace="azure-conv", num_requests=600, model="llama-3.1-8b",
                                   gpu="a100-40gb", max_seq_len=8192)
    base.update(kw)
    return RunSpec(**base)  # type: ignore[arg-type]


def sessions(n: int = 60, seed: int = 2) -> object:
    return make_sessions(SessionSpec(num_sessions=n, session_rate=3.0, system_prompt_len=800, seed=seed)).trace


def same_as_one_run(cluster: dict[str, object], one: dict[str, object]) -> None:
    for key, value in one.items():
        if key in NOT_COMPARED or key not in cluster or isinstance(value, list | dict):
            continue
        got = cluster[key]
        if isinstance(value, float) and np.isnan(value):
            assert got is not None and np.isnan(got), key  # type: ignore[arg-type]
        else:
            assert got == value, (key, got, value)


@pytest.mark.parametrize("router", ["round-robin", "random", "least-loaded"])
def test_one_instance_behind_any_router_is_exactly_one_run(router: str) -> None:
    run = spec(kv_slots=30_000)  # a small pool: preemptions and queueing
    trace = load_workload(run)
    one = simulate(trace, "vllm", run, check=True).summary
    assert one["num_preemptions"] > 0
    same_as_one_run(run_cluster(trace, "vllm", run, 1, router, check=True).summary, one)


def test_one_prefix_aware_instance_with_a_tier_is_exactly_one_run() -> None:
    run = spec(prefix_caching=True, kv_offloading_size=2.0, kv_slots=40_000)
    trace = sessions()
    one = simulate(trace, "vllm", run, check=True).summary
    cluster = run_cluster(trace, "vllm", run, 1, "prefix-aware", check=True).summary
    same_as_one_run(cluster, one)
    assert cluster["instances"][0]["tiers"] == one["tiers"]


def test_a_hybrid_manager_behind_a_router() -> None:
    """One instance is one run; two keep the byte split, padding and out-of-window
    parts included, over both pools."""
    run = spec(model="gpt-oss-20b", gpu="h100-80gb", kv_cache_memory_bytes=2 * 2**30, num_requests=300)
    trace = load_workload(run)
    one = simulate(trace, "vllm-hybrid", run, check=True).summary
    same_as_one_run(run_cluster(trace, "vllm-hybrid", run, 1, "least-loaded", check=True).summary, one)
    two = run_cluster(trace, "vllm-hybrid", run, 2, "least-loaded", check=True).summary
    parts = ("token_states", "reservation", "internal_fragmentation", "padding", "out_of_window", "free")
    assert two["out_of_window_frac"] > 0
    assert sum(two[f"{q}_frac"] for q in parts) == pytest.approx(1.0, abs=1e-9)
    assert two["num_finished"] + two["num_refused"] == 300


def test_round_robin_splits_the_trace_and_every_request_is_answered() -> None:
    run = spec()
    trace = load_workload(run)
    result = run_cluster(trace, "vllm", run, 4, "round-robin", check=True)
    s = result.summary
    assert s["num_instances"] == 4 and len(s["instances"]) == 4
    assert s["num_finished"] + s["num_refused"] == len(trace)
    for i, r in enumerate(result.instances):
        assert r.requests["request_id"].tolist() == list(range(i, len(trace), 4))
    assert sorted(result.requests["request_id"]) == list(range(len(trace)))
    fracs = ("token_states_frac", "reservation_frac", "internal_fragmentation_frac", "free_frac",
             "store_pending_frac")
    assert sum(s[f] for f in fracs) == pytest.approx(1.0)


def test_least_loaded_avoids_the_queue_round_robin_builds() -> None:
    # Every fourth request is long: round-robin sends all of them to instance 0, whose
    # queue grows; least-loaded sends each request where 4 × waiting + running is least.
    n = 400
    long = np.arange(n) % 4 == 0
    trace = Trace("skew", "test", np.arange(n) / 16.0, np.where(long, 3000, 100), np.where(long, 400, 50))
    run = spec(kv_slots=20_000)
    rr = run_cluster(trace, "vllm", run, 4, "round-robin").summary
    ll = run_cluster(trace, "vllm", run, 4, "least-loaded", check=True).summary
    assert ll["num_finished"] == rr["num_finished"] == n
    assert rr["instances"][0]["mean_ttft_s"] > 2 * rr["instances"][1]["mean_ttft_s"]
    assert ll["mean_ttft_s"] < rr["mean_ttft_s"] / 2


def test_prefix_aware_routing_keeps_sessions_where_their_prefix_is() -> None:
    run = spec(prefix_caching=True, kv_slots=30_000)
    trace = sessions(120, seed=4)
    rr = run_cluster(trace, "vllm", run, 4, "round-robin").summary
    pa = run_cluster(trace, "vllm", run, 4, "prefix-aware", check=True).summary
    assert pa["prefix_cache_hit_rate"] > rr["prefix_cache_hit_rate"] + 0.1
    assert pa["mean_ttft_s"] < rr["mean_ttft_s"]
    # The router's estimate is its own index, sized to each GPU pool: it expects more
    # than the instances find once their caches evict in their own order.
    assert pa["router_estimated_hit_tokens"] > pa["prefix_cache_hits"]


def test_bad_cluster_settings_name_the_option() -> None:
    run = spec()
    trace = load_workload(run)
    with pytest.raises(FragsimError, match="--instances"):
        run_cluster(trace, "vllm", run, 0, "round-robin")
    with pytest.raises(FragsimError, match="--router must be one of"):
        run_cluster(trace, "vllm", run, 2, "fastest")
    with pytest.raises(FragsimError, match="needs --prefix-caching"):
        run_cluster(trace, "vllm", run, 2, "prefix-aware")


def test_the_cli_prints_a_row_per_instance_and_json_carries_them(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from fragsim.cli import main

    assert main(["run", "--num-requests", "300", "--allocator", "vllm", "--instances", "3",
                 "--router", "least-loaded", "--no-save"]) == 0
    out = capsys.readouterr().out
    assert "vllm ×3 least-loaded" in out and "#2" in out and "goodput" in out
    assert main(["run", "--num-requests", "300", "--allocator", "vllm", "--instances", "3",
                 "--no-save", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[0])
    assert summary["num_instances"] == 3 and len(summary["instances"]) == 3
    assert summary["num_requests"] == 300 == sum(i["num_requests"] for i in summary["instances"])
    assert {"goodput_rps", "mean_ttft_s", "token_states_frac", "prefix_cache_hits"} <= set(summary)


def test_the_random_router_draws_uniformly_and_the_same_every_run() -> None:
    from fragsim.cluster.routers import Random

    where = Random().assign(40_000, 8)
    counts = np.bincount(where, minlength=8)
    assert counts.min() > 4_700 and counts.max() < 5_300        # 5,000 each, give or take 3 σ
    assert (Random().assign(40_000, 8) == where).all()
    assert [Random().pick(r, [None] * 8) for r in range(50)] == where[:50].tolist()  # type: ignore[list-item]
