"""Serving workloads through the caching-allocator model: the seed's RAG paradox,
determinism, and the recorded op sequence."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from fragsim.caching.workloads import (
    WORKLOADS,
    ModelDims,
    ServingWorkload,
    _forward_temporaries,
    run_workload,
)
from gpu_backend.native_caching import replay_model

MiB = 1 << 20


@pytest.fixture(scope="module")
def rag() -> object:
    return run_workload("rag-longtail", hours=0.1)


def test_rag_longtail_reproduces_the_paradox(rag: object) -> None:
    """An OOM while the device has more free memory than the request, and no
    block as large as the request (seed 004 §3.2)."""
    s = rag.summary  # type: ignore[attr-defined]
    assert s["num_ooms_enough_total_free"] >= 1
    first = s["first_enough_free_oom"]
    assert first["total_free_bytes"] >= first["size"] > first["largest_free_block"]
    assert first["largest_allocatable"] < first["size"]
    assert first["tag"].endswith(":probs32")  # the long prompt's fp32 softmax buffer
    assert sum(first["free_blocks_by_size"].values()) == first["num_free_blocks"] >= 100
    assert s["peak_fragmentation_ratio"] > 0.2 and s["time_above_danger_s"] > 0
    ooms = rag.ooms  # type: ignore[attr-defined]
    assert (ooms["largest_free_block"] < ooms["rounded_size"]).all()
    rag.model.check()  # type: ignore[attr-defined]


def test_time_series_is_consistent(rag: object) -> None:
    ts = rag.timeseries  # type: ignore[attr-defined]
    assert (np.diff(ts["time_s"]) >= 0).all()
    assert (ts["reserved_bytes"] == ts["allocated_bytes"] + ts["inactive_bytes"]).all()
    assert (ts["total_free_bytes"] == ts["inactive_bytes"] + ts["device_free_bytes"]).all()
    assert (ts["largest_free_block"] <= ts["largest_allocatable"]).all()
    assert ts["fragmentation_ratio"].between(0, 1).all()
    assert (ts["reserved_bytes"] <= WORKLOADS["rag-longtail"].device_bytes).all()
    assert ts["num_ooms"].iloc[-1] == rag.summary["num_ooms"]  # type: ignore[attr-defined]


def test_deterministic_for_a_seed_and_longer_runs_extend_shorter_ones() -> None:
    a = run_workload("rag-longtail", hours=0.02)
    b = run_workload("rag-longtail", hours=0.02)
    pd.testing.assert_frame_equal(a.timeseries, b.timeseries)
    assert a.summary == b.summary
    c = run_workload("rag-longtail", hours=0.02, seed=1)
    assert not a.timeseries.equals(c.timeseries)
    longer = run_workload("rag-longtail", hours=0.03)
    n = len(a.timeseries) - 1  # the last row of the shorter run may be cut by its horizon
    pd.testing.assert_frame_equal(a.timeseries.iloc[:n], longer.timeseries.iloc[:n])


def test_recorded_ops_replay_to_the_same_state() -> None:
    r = run_workload("rag-longtail", hours=0.02, record_ops=True)
    replay = replay_model(r.ops, r.workload.device_bytes)
    assert replay["ooms"] == [e["op_index"] for e in r.model.oom_events]
    end = replay["states"][len(r.ops) - 1]
    assert (end["reserved_bytes"], end["allocated_bytes"]) == (r.model.reserved_bytes, r.model.allocated_bytes)


def test_expandable_segments_lower_fragmentation() -> None:
    plain = run_workload("rag-longtail", hours=0.05).summary
    expandable = run_workload("rag-longtail", hours=0.05, expandable_segments=True).summary
    assert expandable["mean_fragmentation_ratio"] < plain["mean_fragmentation_ratio"]
    assert expandable["num_ooms_enough_total_free"] <= plain["num_ooms_enough_total_free"]


def test_hf_serving_max_length_kv() -> None:
    r = run_workload("hf-serving", hours=0.02)
    assert r.workload.kv_alloc == "max" and r.summary["num_completed"] > 0
    sizes = {e[2] for e in run_workload("hf-serving", hours=0.005, record_ops=True).ops
             if e[0] == "malloc"}
    assert 2048 * 32 * 128 * 2 in sizes  # one layer's K for max_seq_len on Llama-2-7B
    r.model.check()


def test_forward_temporaries_sizes() -> None:
    dims = ModelDims("tiny", 2, 4, 2, 8, 32, 64, 100)
    w = ServingWorkload(model="tiny")
    ops = _forward_temporaries(dims, tokens=10, kv_len=12, logit_rows=10, w=w)
    sizes = {name: size for kind, name, size in ops if kind == "m"}
    assert sizes == {"h": 640, "x": 640, "q": 640, "k": 320, "v": 320, "scores": 960,
                     "probs32": 1920, "probs": 960, "attn": 640, "o": 640, "x2": 640,
                     "gate": 1280, "up": 1280, "act": 1280, "down": 640,
                     "logits16": 2000, "logits32": 4000}
    live: set[str] = set()
    for kind, name, _ in ops:  # every temporary is freed exactly once, after its malloc
        if kind == "m":
            live.add(name)
        elif kind == "f":
            live.remove(name)
    assert not live
    fused = _forward_temporaries(dims, 10, 12, 1, dataclasses.replace(w, attention="fused"))
    assert "scores" not in {name for _, name, _ in fused}


def test_model_dims_from_the_catalog() -> None:
    d = ModelDims.from_name("llama-2-13b")
    assert (d.num_layers, d.num_kv_heads, d.kv_bytes_per_token) == (40, 40, 819200)
    assert sum(n for _, n in d.weight_tensors()) == 13_015_864_320 * 2


@pytest.mark.parametrize(("params", "field"), [
    ({"hours": 0}, "hours"), ({"long_fraction": 2.0}, "long_fraction"),
    ({"prompt_tokens": (300, 200)}, "prompt_tokens"), ({"kv_alloc": "pow2"}, "kv_alloc"),
    ({"max_seq_len": 512}, "max_seq_len"), ({"arrival_cv": 0}, "arrival_cv"),
])
def test_workload_validation_names_the_field(params: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f'"{field}" must be'):
        ServingWorkload(**params)  # type: ignore[arg-type]


def test_run_workload_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown workload 'nope'; known: hf-serving, rag-longtail"):
        run_workload("nope")
    with pytest.raises(ValueError, match="unknown workload parameter\\(s\\) colour"):
        run_workload("rag-longtail", colour="red")
    with pytest.raises(ValueError, match="too small for the weights"):
        run_workload("rag-longtail", device_gb=4.0, hours=0.01)
