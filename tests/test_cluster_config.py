"""``fragsim cluster CONFIG.toml`` (fragsim.cluster.config) and the session router."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fragsim.cli import main
from fragsim.cluster.config import load_cluster
from fragsim.errors import FragsimError
from fragsim.simulate import RunSpec, simulate
from fragsim.traces.sessions import SessionSpec, make_sessions

SMALL = """
[cluster]
router = "least-loaded"
pd_threshold = 256

[workload]
trace = "azure-conv"
num_requests = 300

[defaults]
model = "llama-3.1-8b"
max_seq_len = 8192

[[pools]]
role = "prefill"
count = 1

[[pools]]
name = "decode-a100"
role = "decode"
count = 2
gpu = "a100-80gb"

[[pools]]
name = "small"
count = 1
gpu = "l4"
max_num_seqs = 32
"""


def write(tmp_path: Path, text: str, name: str = "cluster.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_pools_of_different_gpus_run_and_report_per_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, SMALL)
    config = load_cluster(path)
    assert [(m.pool, m.role, m.spec.gpu) for m in config.members] == [
        ("prefill", "prefill", "h100-80gb"), ("decode-a100", "decode", "a100-80gb"),
        ("decode-a100", "decode", "a100-80gb"), ("small", "mixed", "l4")]
    assert config.members[3].spec.max_num_seqs == 32 and config.members[0].spec.max_num_seqs == 256
    assert main(["cluster", str(path), "--no-save", "--json"]) == 0
    s = json.loads(capsys.readouterr().out.splitlines()[0])
    assert [p["pool"] for p in s["pools"]] == ["prefill", "decode-a100", "small"]
    assert s["num_requests"] == 300 == s["num_finished"] + s["num_refused"]
    caps = {i["pool"]: i["capacity_slots"] for i in s["instances"]}
    assert caps["prefill"] != caps["decode-a100"] > 10 * caps["small"]  # H100, A100-80GB, L4
    assert s["pools"][2]["num_requests"] == 300 - s["num_disaggregated"] > 0
    assert main(["cluster", str(path), "--no-save"]) == 0
    out = capsys.readouterr().out
    assert "decode-a100 ×2" in out and "#3 small" in out and "KV transfers" in out


def test_the_example_file_is_a_valid_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster", "--example"]) == 0
    config = load_cluster(write(tmp_path, capsys.readouterr().out))
    assert [m.role for m in config.members] == ["prefill"] * 2 + ["decode"] * 3
    assert config.settings.router == "least-loaded" and config.workload.load_scale == 4


@pytest.mark.parametrize(("edit", "message"), [
    (('role = "prefill"', 'role = "encode"'), r"\[\[pools\]\] #1 role: expected one of mixed, prefill, decode"),
    (('role = "prefill"\ncount = 1', 'role = "mixed"\ncount = 1'), r"\[\[pools\]\] role: a decode pool needs a prefill pool"),
    (("count = 2", "count = 0"), r"#2 count: expected an integer >= 1, got 0"),
    (('gpu = "l4"', 'gpu = "l4"\nrate = 3.0'), r"#3 rate: a trace field: set it once, in \[workload\]"),
    (('gpu = "l4"', 'gpu = "l4"\nmax_num_seq = 3'), r"#3 max_num_seq: unknown parameter"),
    (('gpu = "l4"', 'gpu = "l4"\nrouter = "session"'), r"#3 router: a cluster setting"),
    (('name = "small"', 'name = "decode-a100"'), r"#3 name: 'decode-a100' names pool #2 already"),
    (('router = "least-loaded"', 'router = "fastest"'), r"\[cluster\] router: expected one of"),
    (('pd_threshold = 256', 'pd_threshold = 256\nbandwidth = 3'), r"\[cluster\] bandwidth: unknown key"),
    (('gpu = "l4"', 'gpu = "l4"\nmodel = "llama-3.1-70b"'), r"#3: .*llama-3.1-70b"),
    (('gpu = "l4"', 'gpu = "l4"\nallocator = "magic"'), r"#3 allocator: unknown allocator 'magic'"),
])
def test_a_bad_cluster_file_names_the_table_and_key(tmp_path: Path, edit: tuple[str, str], message: str) -> None:
    old, new = edit
    assert old in SMALL
    path = write(tmp_path, SMALL.replace(old, new, 1))
    with pytest.raises(FragsimError, match=message):
        load_cluster(path)


def test_the_defaults_name_every_pool_s_allocator(tmp_path: Path) -> None:
    text = SMALL.replace('max_seq_len = 8192', 'max_seq_len = 8192\nallocator = "vllm-hybrid"', 1)
    text = text.replace('max_num_seqs = 32', 'max_num_seqs = 32\nallocator = "jenga"', 1)
    config = load_cluster(write(tmp_path, text))
    assert [m.allocator for m in config.members] == ["vllm-hybrid"] * 3 + ["jenga"]
    with pytest.raises(FragsimError, match=r"\[defaults\] allocator: expected a name, got 3"):
        load_cluster(write(tmp_path, SMALL.replace('max_seq_len = 8192', 'max_seq_len = 8192\nallocator = 3', 1)))


def test_pools_that_cannot_meet_are_refused_when_run(tmp_path: Path) -> None:
    from fragsim.cluster import run_members
    from fragsim.simulate import load_workload

    for edit, message in [(('gpu = "a100-80gb"', 'gpu = "a100-80gb"\nmodel = "qwen3-8b"'),
                           "prefill and decode pools serve different models"),
                          (('gpu = "a100-80gb"', 'gpu = "a100-80gb"\nblock_size = 32'),
                           "block_size: the pools differ")]:
        config = load_cluster(write(tmp_path, SMALL.replace(*edit, 1)))
        with pytest.raises(FragsimError, match=message):
            run_members(load_workload(config.workload), config.members, config.settings, config.label)


def test_the_session_router_keeps_a_session_on_one_instance() -> None:
    sessions = make_sessions(SessionSpec(num_sessions=80, session_rate=2.0, system_prompt_len=600, seed=4))
    run = RunSpec(model="llama-3.1-8b", gpu="a100-40gb", max_seq_len=16384, instances=4,
                  router="session", prefix_caching=True)
    result = simulate(sessions.trace, "vllm", run, check=True)
    where = result.requests.set_index("request_id")["instance"].to_numpy()
    for session in np.unique(sessions.session):
        assert len(set(where[sessions.session == session])) == 1
    assert len(set(where)) == 4  # and the sessions spread over every instance
    rr = simulate(sessions.trace, "vllm", RunSpec(**{**run.__dict__, "router": "round-robin"}))
    assert result.summary["prefix_cache_hit_rate"] > rr.summary["prefix_cache_hit_rate"]


def test_the_session_router_needs_session_ids() -> None:
    from fragsim.simulate import load_workload

    run = RunSpec(trace="azure-conv", num_requests=50, model="llama-3.1-8b", gpu="a100-40gb",
                  max_seq_len=8192, instances=2, router="session")
    with pytest.raises(FragsimError, match="--router session: the session router needs a session id"):
        simulate(load_workload(run), "vllm", run)


def _sessions_run(**kw: object) -> dict[str, object]:
    sessions = make_sessions(SessionSpec(num_sessions=120, session_rate=3.0, system_prompt_len=600, seed=7))
    run = RunSpec(**{**dict(model="llama-3.1-8b", gpu="a100-40gb", max_seq_len=16384, instances=3,
                           router="prefix-aware", prefix_caching=True, kv_slots=30000), **kw})  # type: ignore[arg-type]
    return simulate(sessions.trace, "vllm", run, check=True).summary


def test_kv_events_without_delay_give_the_router_the_caches_exactly() -> None:
    """A small pool evicts; the router's own index does not hear of it and expects more
    than the instances find, while KV events with no delay tell it what they hold when
    it routes (a request is admitted later, by when a step may have cached or evicted
    a block more)."""
    approx = _sessions_run()
    exact = _sessions_run(router_kv_events_ms=0.0)
    assert exact["num_prefix_cache_evictions"] > 0  # type: ignore[operator]

    def error(s: dict[str, object]) -> float:
        return abs(s["router_estimated_hit_tokens"] / s["prefix_cache_hits"] - 1)  # type: ignore[operator]
    assert error(exact) < 0.001 < error(approx)
    assert approx["router_estimated_hit_tokens"] > approx["prefix_cache_hits"]  # type: ignore[operator]
    late = _sessions_run(router_kv_events_ms=2000.0)
    assert late["router_estimated_hit_tokens"] != late["prefix_cache_hits"]


def test_the_router_weights_and_load_snapshots_change_its_picks() -> None:
    base = _sessions_run()
    prefix_only = _sessions_run(router_weights=(1.0, 0.0, 0.0))
    assert prefix_only["prefix_cache_hits"] >= base["prefix_cache_hits"]  # type: ignore[operator]
    assert prefix_only["load_imbalance"] > base["load_imbalance"]  # type: ignore[operator]
    stale = _sessions_run(router="least-loaded", router_snapshot_ms=5000.0)
    live = _sessions_run(router="least-loaded")
    assert stale["load_imbalance"] != live["load_imbalance"]
