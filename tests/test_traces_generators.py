"""Traces made or changed in memory: the Trace columns, arrivals, workloads, slices, speed-ups."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fragsim.errors import FragsimError
from fragsim.traces import (
    WORKLOADS,
    Request,
    Trace,
    assign_arrivals,
    load_trace,
    make_workload,
    save_trace,
    scale_time,
    slice_trace,
    trace_stats,
)
from fragsim.traces.workloads import fit_mus, population_means


def make_trace(arrivals: list[float], *, hashes: bool = False) -> Trace:
    n = len(arrivals)
    return Trace(
        name="t",
        source="test",
        arrival_s=np.array(arrivals, dtype=float),
        prompt_len=np.arange(1, n + 1) * 10,
        output_len=np.arange(1, n + 1),
        block_hashes=[(i,) for i in range(n)] if hashes else None,
        block_hash_size=512 if hashes else None,
    )


def lengths_only(n: int) -> Trace:
    return Trace("l", "test", np.zeros(n), np.full(n, 7), np.full(n, 3), has_timestamps=False)


# --- Trace and Request ---------------------------------------------------------------------


def test_requests_are_rows_with_row_index_ids() -> None:
    trace = make_trace([0.0, 0.5, 2.0], hashes=True)
    assert list(trace.requests()) == [
        Request(0, 0.0, 10, 1, (0,)),
        Request(1, 0.5, 20, 2, (1,)),
        Request(2, 2.0, 30, 3, (2,)),
    ]
    assert len(trace) == 3 and trace.duration_s == 2.0


def test_columns_are_read_only_copies() -> None:
    prompt = np.array([5, 6])
    trace = Trace("t", "test", np.array([0.0, 1.0]), prompt, np.array([1, 1]))
    prompt[0] = 99
    assert trace.prompt_len.tolist() == [5, 6]
    with pytest.raises(ValueError):
        trace.prompt_len[0] = 1
    assert trace.arrival_s.dtype == np.float64 and trace.prompt_len.dtype == np.int64


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompt_len": [1]}, "differ in length"),
        ({"output_len": [1, 0]}, ">= 1"),
        ({"arrival_s": [1.0, 0.0]}, "sorted"),
        ({"has_timestamps": False}, "all arrival_s == 0"),
        ({"block_hashes": [(1,)], "block_hash_size": 512}, "block_hashes has 1 rows"),
        ({"block_hashes": [(1,), (2,)]}, "block_hash_size"),
    ],
)
def test_trace_rejects_broken_columns(kwargs: dict[str, object], match: str) -> None:
    columns: dict[str, object] = {
        "arrival_s": [0.0, 1.0],
        "prompt_len": [1, 2],
        "output_len": [1, 2],
    }
    with pytest.raises(ValueError, match=match):
        Trace(**{"name": "t", "source": "test", **columns, **kwargs})  # type: ignore[arg-type]


def test_to_frame_uses_the_plain_csv_columns() -> None:
    frame = make_trace([0.0, 1.0], hashes=True).to_frame()
    assert list(frame.columns) == ["arrival_time_s", "prompt_len", "output_len", "block_hashes"]
    assert frame.index.name == "request_id"
    assert frame["block_hashes"].tolist() == [(0,), (1,)]


def test_from_requests_builds_the_same_columns() -> None:
    trace = make_trace([0.0, 0.5], hashes=True)
    rebuilt = Trace.from_requests(trace.requests(), block_hash_size=512)
    assert rebuilt.arrival_s.tolist() == [0.0, 0.5]
    assert rebuilt.prompt_len.tolist() == [10, 20]
    assert rebuilt.block_hashes == [(0,), (1,)]


lengths = st.integers(min_value=1, max_value=10**6)
gaps = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(gaps, lengths, lengths), min_size=1, max_size=30),
    st.booleans(),
)
def test_save_then_load_gives_the_same_trace(
    tmp_path_factory: pytest.TempPathFactory, rows: list[tuple[float, int, int]], hashes: bool
) -> None:
    arrivals = np.cumsum([0.0] + [g for g, _, _ in rows[1:]])
    trace = Trace(
        "t",
        "test",
        arrivals,
        np.array([p for _, p, _ in rows]),
        np.array([o for _, _, o in rows]),
        block_hashes=[tuple(range(i * 2**40, i * 2**40 + -(-p // 512))) for i, (_, p, _) in enumerate(rows)]
        if hashes else None,
        block_hash_size=512 if hashes else None,
    )
    path = tmp_path_factory.mktemp("rt") / "t.csv"
    save_trace(trace, path)
    loaded = load_trace(path)
    assert np.array_equal(loaded.arrival_s, trace.arrival_s)
    assert np.array_equal(loaded.prompt_len, trace.prompt_len)
    assert np.array_equal(loaded.output_len, trace.output_len)
    assert loaded.block_hashes == trace.block_hashes


# --- arrivals ------------------------------------------------------------------------------


def interarrival(trace: Trace) -> tuple[float, float]:
    """(rate, CV) of a trace's arrivals."""
    stats = trace_stats(trace)
    return stats["rate_req_per_s"], stats["interarrival_cv"]


def test_poisson_arrivals_hit_the_rate_with_cv_one() -> None:
    trace = assign_arrivals(lengths_only(200_000), rate=5.0, seed=1)
    rate, cv = interarrival(trace)
    assert trace.has_timestamps and trace.arrival_s[0] == 0.0
    assert rate == pytest.approx(5.0, rel=0.01)
    assert cv == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("cv", [0.5, 2.0, 3.0])
def test_gamma_arrivals_hit_the_rate_and_the_cv(cv: float) -> None:
    rate, measured_cv = interarrival(assign_arrivals(lengths_only(200_000), 4.0, "gamma", cv, 3))
    assert rate == pytest.approx(4.0, rel=0.02)
    assert measured_cv == pytest.approx(cv, rel=0.03)


def test_arrivals_are_seeded() -> None:
    base = lengths_only(1000)
    first = assign_arrivals(base, 2.0, "gamma", 2.0, seed=7)
    again = assign_arrivals(base, 2.0, "gamma", 2.0, seed=7)
    other = assign_arrivals(base, 2.0, "gamma", 2.0, seed=8)
    assert np.array_equal(first.arrival_s, again.arrival_s)
    assert not np.array_equal(first.arrival_s, other.arrival_s)
    assert np.array_equal(first.prompt_len, base.prompt_len)


def test_assign_arrivals_replaces_real_timestamps_keeping_row_order() -> None:
    trace = assign_arrivals(make_trace([0.0, 100.0, 200.0]), rate=1000.0)
    assert trace.duration_s < 1.0
    assert trace.prompt_len.tolist() == [10, 20, 30]


@pytest.mark.parametrize(
    ("rate", "arrival", "cv", "match"),
    [
        (0.0, "poisson", 1.0, "rate must be a positive number"),
        (math.nan, "poisson", 1.0, "rate must be a positive number"),
        (1.0, "uniform", 1.0, "arrival must be one of poisson, gamma, got 'uniform'"),
        (1.0, "gamma", -1.0, "cv must be a positive number"),
        (1.0, "poisson", 2.0, "applies to gamma arrivals only"),
    ],
)
def test_bad_arrival_options_are_named(rate: float, arrival: str, cv: float, match: str) -> None:
    with pytest.raises(FragsimError, match=match):
        assign_arrivals(lengths_only(3), rate, arrival, cv)


# --- synthetic workloads -------------------------------------------------------------------

PAPER_MEANS = {"sharegpt-paper": (161.31, 337.99), "alpaca-paper": (19.31, 58.45)}


@pytest.mark.parametrize("name", PAPER_MEANS)
def test_workload_population_means_are_the_papers(name: str) -> None:
    workload = WORKLOADS[name]
    prompt_mean, output_mean, _ = population_means(workload.prompt, workload.output)
    assert prompt_mean == pytest.approx(PAPER_MEANS[name][0], abs=1e-3)
    assert output_mean == pytest.approx(PAPER_MEANS[name][1], abs=1e-3)
    mu_p, mu_o = fit_mus(*PAPER_MEANS[name], workload.prompt.sigma, workload.output.sigma)
    assert (mu_p, mu_o) == pytest.approx((workload.prompt.mu, workload.output.mu), abs=1e-5)


@pytest.mark.parametrize("name", PAPER_MEANS)
def test_workload_samples_have_the_papers_means_under_the_cap(name: str) -> None:
    trace = make_workload(name, 200_000, rate=10.0, seed=0)
    assert trace.prompt_len.mean() == pytest.approx(PAPER_MEANS[name][0], rel=0.01)
    assert trace.output_len.mean() == pytest.approx(PAPER_MEANS[name][1], rel=0.01)
    assert int((trace.prompt_len + trace.output_len).max()) <= 2048
    assert int(trace.prompt_len.min()) >= 1 and int(trace.output_len.min()) >= 1
    assert interarrival(trace)[0] == pytest.approx(10.0, rel=0.01)


def test_workloads_are_seeded_and_lengths_do_not_depend_on_arrivals() -> None:
    a = make_workload("alpaca-paper", 500, rate=1.0, seed=4)
    b = make_workload("alpaca-paper", 500, rate=1.0, seed=4)
    c = make_workload("alpaca-paper", 500, rate=1.0, seed=5)
    gamma = make_workload("alpaca-paper", 500, rate=3.0, seed=4, arrival="gamma", cv=2.0)
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.prompt_len, b.prompt_len)
    assert not np.array_equal(a.prompt_len, c.prompt_len)
    assert np.array_equal(a.prompt_len, gamma.prompt_len)
    assert not np.array_equal(a.arrival_s, gamma.arrival_s)


def test_workload_without_rate_is_length_only() -> None:
    trace = make_workload("sharegpt-paper", 10, rate=None)
    assert not trace.has_timestamps and len(trace) == 10


def test_workload_table_describes_each_entry() -> None:
    assert {"sharegpt-paper", "alpaca-paper"} <= set(WORKLOADS)
    assert "161.31" in str(WORKLOADS["sharegpt-paper"])


def test_unknown_workload_lists_the_known_ones() -> None:
    with pytest.raises(FragsimError, match="unknown workload 'x'; known: sharegpt-paper, alpaca"):
        make_workload("x", 10, 1.0)
    with pytest.raises(FragsimError, match="num_requests must be a positive integer"):
        make_workload("alpaca-paper", 0, 1.0)


# --- slicing and scaling -------------------------------------------------------------------


def test_slice_by_time_window_rezeroes() -> None:
    trace = make_trace([0.0, 1.0, 2.0, 3.0, 4.0], hashes=True)
    window = slice_trace(trace, start_s=1.5, end_s=4.0)  # [1.5, 4.0): rows 2 and 3
    assert window.arrival_s.tolist() == [0.0, 1.0]
    assert window.prompt_len.tolist() == [30, 40]
    assert window.block_hashes == [(2,), (3,)]
    assert [r.request_id for r in window.requests()] == [0, 1]


def test_slice_by_offset_and_count_after_the_window() -> None:
    trace = make_trace([0.0, 1.0, 2.0, 3.0, 4.0])
    assert slice_trace(trace, num_requests=2).prompt_len.tolist() == [10, 20]
    assert slice_trace(trace, offset=3).arrival_s.tolist() == [0.0, 1.0]
    cut = slice_trace(trace, start_s=1.0, offset=1, num_requests=2)
    assert cut.prompt_len.tolist() == [30, 40]
    assert slice_trace(trace, num_requests=99).prompt_len.tolist() == [10, 20, 30, 40, 50]


def test_slice_of_a_length_only_trace_takes_rows_not_times() -> None:
    assert len(slice_trace(lengths_only(10), offset=2, num_requests=5)) == 5
    with pytest.raises(FragsimError, match="has no timestamps"):
        slice_trace(lengths_only(10), start_s=1.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"start_s": 10.0}, "keeps no requests"),
        ({"offset": 5}, "keeps no requests"),
        ({"start_s": 2.0, "end_s": 1.0}, "end_s .* must be greater"),
        ({"num_requests": 0}, "num_requests must be >= 1"),
        ({"offset": -1}, "offset must be >= 0"),
    ],
)
def test_bad_slices_are_errors(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(FragsimError, match=match):
        slice_trace(make_trace([0.0, 1.0, 2.0, 3.0, 4.0]), **kwargs)  # type: ignore[arg-type]


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(0.0, 100.0), min_size=1, max_size=40).map(sorted),
    st.floats(0.0, 120.0),
    st.floats(0.1, 120.0),
)
def test_slice_keeps_exactly_the_window(arrivals: list[float], start: float, width: float) -> None:
    trace = make_trace([a - arrivals[0] for a in arrivals])
    inside = [a for a in trace.arrival_s.tolist() if start <= a < start + width]
    if not inside:
        with pytest.raises(FragsimError):
            slice_trace(trace, start_s=start, end_s=start + width)
        return
    window = slice_trace(trace, start_s=start, end_s=start + width)
    assert len(window) == len(inside)
    np.testing.assert_allclose(window.arrival_s, np.array(inside) - inside[0])


def test_scale_time_multiplies_the_rate_and_keeps_the_cv() -> None:
    trace = assign_arrivals(lengths_only(5000), 2.0, "gamma", 2.5, seed=0)
    faster = scale_time(trace, 4.0)
    assert np.array_equal(faster.arrival_s, trace.arrival_s / 4.0)
    rate, cv = interarrival(trace)
    assert interarrival(faster) == pytest.approx((rate * 4.0, cv))
    with pytest.raises(FragsimError, match="factor must be a positive number"):
        scale_time(trace, 0.0)
    with pytest.raises(FragsimError, match="no timestamps to scale"):
        scale_time(lengths_only(3), 2.0)


def test_real_trace_slice_and_scale(shared_traces: Path) -> None:
    trace = load_trace(shared_traces / "azure_conv_2023.csv")
    first_ten_minutes = slice_trace(trace, end_s=600.0)
    assert first_ten_minutes.duration_s < 600.0
    assert len(first_ten_minutes) == int(np.searchsorted(trace.arrival_s, 600.0))
    assert scale_time(trace, 2.0).duration_s == pytest.approx(trace.duration_s / 2)
