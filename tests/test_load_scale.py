"""--load-scale: K seeded copies of a trace merged (K times the rate, burstiness kept)."""

from __future__ import annotations

import numpy as np
import pytest

from fragsim.errors import FragsimError
from fragsim.simulate import RunSpec, load_workload
from fragsim.traces import Trace, load_trace, scale_load, trace_stats


def test_k_copies_give_k_times_the_rate_and_keep_the_burstiness() -> None:
    trace = load_trace("azure-conv")
    scaled = scale_load(trace, 8, seed=3)
    base, big = trace_stats(trace), trace_stats(scaled)
    assert len(scaled) == 8 * len(trace)
    assert big["rate_req_per_s"] == pytest.approx(8 * base["rate_req_per_s"], rel=0.01)
    # The rate over time keeps its shape: per-minute counts are K times the trace's
    # (a copy moves by less than one mean gap), so peaks stay peaks.
    edges = np.arange(0.0, float(trace.arrival_s[-1]) + 60.0, 60.0)
    counts, _ = np.histogram(trace.arrival_s, edges)
    scaled_counts, _ = np.histogram(scaled.arrival_s, edges)
    assert np.corrcoef(counts, scaled_counts)[0, 1] > 0.99
    assert scaled_counts.std() / scaled_counts.mean() == pytest.approx(counts.std() / counts.mean(), rel=0.05)
    assert np.all(np.diff(scaled.arrival_s) >= 0)
    assert sorted(scaled.prompt_len.tolist()) == sorted(np.tile(trace.prompt_len, 8).tolist())
    again = scale_load(trace, 8, seed=3)
    assert np.array_equal(again.arrival_s, scaled.arrival_s)
    assert not np.array_equal(scale_load(trace, 8, seed=4).arrival_s, scaled.arrival_s)


def test_each_copy_has_its_own_content() -> None:
    trace = Trace("t", "test", np.array([0.0, 1.0]), np.array([600, 1000]), np.array([5, 5]),
                  block_hashes=[(0, 1), (0, 2)], block_hash_size=512)
    scaled = scale_load(trace, 3, seed=0)
    assert scaled.block_hashes is not None
    assert sorted(scaled.block_hashes) == [(0, 1), (0, 2), (3, 4), (3, 5), (6, 7), (6, 8)]


def test_load_scale_applies_to_a_run_and_refuses_nonsense() -> None:
    spec = RunSpec(trace="azure-conv", num_requests=100, load_scale=4)
    assert len(load_workload(spec)) == 400
    with pytest.raises(FragsimError, match="load scale"):
        scale_load(load_trace("azure-conv"), 0)
