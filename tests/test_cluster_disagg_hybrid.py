"""Prefill/decode disaggregation of hybrid models: only what each layer kind reads
crosses the link (a window's blocks, one state per state layer), the decode side places
only that, and the byte split holds at every step on both sides."""

from __future__ import annotations

import numpy as np
import pytest
from oracles import held_by_position_check, hybrid_split_by_position_check

import fragsim.simulate as simulate_module
from fragsim.errors import FragsimError
from fragsim.hybrid import CATEGORIES
from fragsim.kinds import rule_of
from fragsim.simulate import RunSpec, load_workload, simulate
from fragsim.simulate_spec import _model_gpu
from fragsim.traces import Trace

STEP = 0.02
BLOCK = 16
GiB = 1 << 30


def spec(model: str, **kw: object) -> RunSpec:
    base: dict[str, object] = dict(model=model, gpu="h100-80gb", cost_model="fixed", step_time_s=STEP,
                                   max_seq_len=8192, kv_cache_memory_bytes=4 * GiB, instances=2,
                                   prefill_instances=1, decode_instances=1,
                                   kv_transfer_bandwidth_gbps=10.0, kv_transfer_latency_ms=2.0)
    base.update(kw)
    return RunSpec(**base)  # type: ignore[arg-type]


def one(prompt: int, output: int) -> Trace:
    return Trace("pd", "test", np.array([0.0]), np.array([prompt]), np.array([output]))


def per_token(model: str, kind: str, tp: int = 1) -> int:
    """Bytes one token costs the layers of ``kind`` on one GPU."""
    m, _ = _model_gpu(spec(model))
    return sum(la.bytes_per_token(m.kv_dtype_bytes, tp) for la in m.layer_specs if la.kind == kind)


def window_of(model: str) -> int:
    m, _ = _model_gpu(spec(model))
    return next(la.window for la in m.layer_specs if la.kind == "sliding")


@pytest.mark.parametrize("manager", ["vllm-hybrid", "jenga", "static-partition"])
def test_a_sliding_window_model_moves_the_window_only(manager: str) -> None:
    """gpt-oss-20b: a full-attention layer moves every block of the prompt, a sliding
    layer the blocks its first decode step reads (the decode side recomputes the last
    prompt token, which reads from position prompt − window); TTFT by hand."""
    run = spec("gpt-oss-20b")
    prompt = 1000
    result = simulate(one(prompt, 5), manager, run, check=True)
    row, s = result.requests.iloc[0], result.summary
    w = window_of("gpt-oss-20b")
    first = rule_of("sliding", w).skipped_blocks(prompt - 1, BLOCK)
    blocks = -(-prompt // BLOCK)
    full = blocks * BLOCK * per_token("gpt-oss-20b", "full")
    sliding = (blocks - first) * BLOCK * per_token("gpt-oss-20b", "sliding")
    assert s["kv_transfer_bytes_by_kind"] == {"sliding": sliding, "full": full}
    assert s["kv_transfer_bytes"] == row["kv_transfer_bytes"] == full + sliding
    link = (full + sliding) / 10e9
    assert row["ttft_s"] == pytest.approx(STEP + 0.002 + link + STEP, abs=1e-12)
    # The decode side placed just those blocks, from the prefill's end to the landing.
    assert s["mean_kv_receiving_slots"] * s["sim_time_s"] == pytest.approx((full + sliding) * (0.002 + link))
    # The prefill side's copy: prompt + its one token of full attention, a window of sliding.
    prefill = s["instances"][0]
    held = prefill["mean_kv_sending_slots"] * prefill["sim_time_s"]
    stored = prompt + 1
    kept = (stored * per_token("gpt-oss-20b", "full")
            + (stored - max(rule_of("sliding", w).skipped(stored), first * BLOCK))
            * per_token("gpt-oss-20b", "sliding"))
    assert held == pytest.approx(kept * (0.002 + link), rel=1e-9)
    table = result.transfers
    assert list(table["bytes_sliding"]) == [sliding] and list(table["bytes_full"]) == [full]


def test_a_state_model_moves_one_state_per_state_layer() -> None:
    """nemotron-h-56b at tp 2: a Mamba layer's state crosses whole, whatever the prompt's
    length; full attention moves its blocks. Every GPU moves its share."""
    run = spec("nemotron-h-56b", tp=2, kv_cache_memory_bytes=8 * GiB)
    m, _ = _model_gpu(run)
    state = sum(la.state_bytes(m.dtype_bytes, 2) for la in m.layer_specs if la.kind == "mamba")
    # vLLM sizes the attention block to the state's page: whole blocks cross.
    rows = simulate_module.make_engine(one(100, 3), "vllm-hybrid", run).kv.manager.rows
    block = next(r.block_tokens for r in rows if r.kind == "full")
    assert block > 1000
    for prompt in (100, 3000, 7000):
        s = simulate(one(prompt, 3), "vllm-hybrid", run, check=True).summary
        full = -(-prompt // block) * block * per_token("nemotron-h-56b", "full", tp=2)
        assert s["kv_transfer_bytes_by_kind"] == {"mamba": 2 * state, "full": 2 * full}


@pytest.mark.parametrize("model, manager, pool", [
    ("gpt-oss-20b", "vllm-hybrid", GiB // 2), ("gpt-oss-20b", "jenga", GiB // 2),
    ("gpt-oss-20b", "paged-uniform", GiB // 2),
    ("gemma-3-27b", "static-partition", GiB), ("llama-4-scout", "vllm-hybrid", 2 * GiB),
    ("nemotron-h-56b", "vllm-hybrid", 4 * GiB)])
def test_a_loaded_cluster_keeps_every_split_at_every_step(model: str, manager: str, pool: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Small pools, so that requests are preempted, also while their KV is on the way; on
    every instance the split is rebuilt position by position at every step."""
    make = simulate_module.make_engine

    def checked(*args: object, **kw: object) -> object:
        engine = make(*args, **kw)  # type: ignore[arg-type]
        engine.checks.append(hybrid_split_by_position_check)
        return engine
    monkeypatch.setattr(simulate_module, "make_engine", checked)
    run = RunSpec(trace="azure-conv", num_requests=120, model=model, gpu="h100-80gb", max_seq_len=16384,
                  kv_cache_memory_bytes=pool, instances=4, prefill_instances=2, decode_instances=1,
                  pd_threshold=300)
    result = simulate(load_workload(run), manager, run, check=True)
    s = result.summary
    assert s["num_finished"] + s["num_refused"] == s["num_requests"] == 120
    assert s["num_kv_transfers"] > 0
    for part in (s, *s["instances"]):
        total = sum(part[f"{c}_frac"] for c in CATEGORIES) + part.get("kv_sending_frac", 0.0)
        assert total == pytest.approx(1.0, abs=1e-9)
    assert s["kv_sending_frac"] > 0 and 0 < s["kv_duplicated_frac"]
    assert sum(s["kv_transfer_bytes_by_kind"].values()) == s["kv_transfer_bytes"]


def test_hybrid_disaggregation_refuses_what_it_does_not_model(tmp_path: object) -> None:
    from pathlib import Path

    from fragsim.cluster import run_members
    from fragsim.cluster.config import load_cluster

    path = Path(str(tmp_path)) / "mixed.toml"
    path.write_text('[workload]\nnum_requests = 10\n[defaults]\nmodel = "gpt-oss-20b"\n'
                    '[[pools]]\nrole = "prefill"\nallocator = "vllm-hybrid"\n'
                    '[[pools]]\nrole = "decode"\nallocator = "vllm"\n')
    config = load_cluster(path)
    with pytest.raises(FragsimError, match="either hybrid KV managers or dense allocators"):
        run_members(load_workload(config.workload), config.members, config.settings, config.label)


def test_a_prefix_cache_on_both_sides_keeps_every_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss-20b under vLLM's hybrid manager with prefix caching on every instance:
    prompts share their first 1,024 tokens, so the prefill side's finished requests,
    held until read, share blocks with requests still running. The decode side moves
    only what its own hit lacks. Every split, and the part held for transfers, is
    rebuilt position by position at every step."""
    make = simulate_module.make_engine

    def checked(*args: object, **kw: object) -> object:
        engine = make(*args, **kw)  # type: ignore[arg-type]
        engine.checks += [hybrid_split_by_position_check, held_by_position_check]
        return engine
    monkeypatch.setattr(simulate_module, "make_engine", checked)
    n = 60
    trace = Trace("shared", "test", np.arange(n) * 0.03, np.full(n, 1800), np.full(n, 8),
                  block_hashes=[(1, 2, 3 + i, 100 + i) for i in range(n)], block_hash_size=512)
    run = spec("gpt-oss-20b", prefix_caching=True, kv_cache_memory_bytes=GiB // 2, instances=3,
               decode_instances=2, step_time_s=0.01)
    s = simulate(trace, "vllm-hybrid", run, check=True).summary
    assert s["num_finished"] == n and s["num_kv_transfers"] == n
    prefill, *decode = s["instances"]
    assert prefill["prefix_cache_hits"] > 0 and all(d["prefix_cache_hits"] > 0 for d in decode)
    # The decode side's own hit is not moved: less crosses than the prompts hold.
    full = n * 1800 * per_token("gpt-oss-20b", "full")
    assert s["kv_transfer_bytes_by_kind"]["full"] < full
    assert s["kv_sending_frac"] > 0
