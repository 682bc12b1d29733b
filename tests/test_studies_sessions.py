"""The ``sessions`` workload kind: a study's [workload] table that draws multi-turn
session traces (fragsim.traces.sessions) with the study's seed, keeps their own
arrival times, and names the field of any bad parameter in a one-line error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fragsim.errors import FragsimError
from fragsim.experiments import build_trace, expand, load_study
from fragsim.studies.runner import run_one
from fragsim.studies.workloads import check_workload
from fragsim.traces.sessions import SessionSpec, make_sessions

TABLE = {"kind": "sessions", "num_sessions": 40, "session_rate": 2.0, "turns_mean": 5,
         "max_turns": 12, "think_time": 20, "lengths": "alpaca-paper",
         "system_prompt_len": 700, "max_len": 4096}
SPEC = SessionSpec(40, 2.0, turns_mean=5.0, max_turns=12, think_time_s=20.0,
                   lengths="alpaca-paper", system_prompt_len=700, max_len=4096, seed=3)


def same_trace(a, b) -> bool:  # type: ignore[no-untyped-def]
    return (np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.prompt_len, b.prompt_len)
            and np.array_equal(a.output_len, b.output_len) and a.block_hashes == b.block_hashes
            and a.block_hash_size == b.block_hash_size and a.has_timestamps == b.has_timestamps)


def test_the_kind_builds_the_trace_make_sessions_makes() -> None:
    workload = check_workload(TABLE, partial=False)
    expected = make_sessions(SPEC).trace
    trace = build_trace(workload, 10**6, seed=3, rate=None)
    assert same_trace(trace, expected)
    assert trace.block_hashes is not None and trace.block_hash_size == 512
    # num_requests keeps the first requests in arrival order, times and hashes as they were
    first = build_trace(workload, 25, seed=3, rate=None)
    assert len(first) == 25
    assert np.array_equal(first.arrival_s, expected.arrival_s[:25] - expected.arrival_s[0])
    assert first.block_hashes == expected.block_hashes[:25]
    assert not same_trace(build_trace(workload, 10**6, seed=4, rate=None), expected)


def test_defaults_are_session_specs() -> None:
    workload = check_workload({"kind": "sessions", "num_sessions": 30, "session_rate": 1.0},
                              partial=False)
    default = SessionSpec(30, 1.0)
    assert (workload["turns_mean"], workload["max_turns"], workload["think_time"], workload["lengths"],
            workload["system_prompt_len"], workload["max_len"]) == (
        default.turns_mean, default.max_turns, default.think_time_s, default.lengths,
        default.system_prompt_len, default.max_len)
    assert same_trace(build_trace(workload, 10**6, seed=0, rate=None), make_sessions(default).trace)


def test_sessions_are_never_re_timed() -> None:
    workload = check_workload(TABLE, partial=False)
    with pytest.raises(FragsimError, match="carries its own arrival times"):
        build_trace(workload, 100, seed=3, rate=5.0)


@pytest.mark.parametrize(("change", "message"), [
    ({"num_sessions": 0}, r"^num_sessions: must be >= 1, got 0$"),
    ({"session_rate": 0}, r"^session_rate: must be > 0 \(sessions per second\), got 0\.0$"),
    ({"turns_mean": 0.5}, r"^turns_mean: must be >= 1, got 0\.5$"),
    ({"max_turns": 0}, r"^max_turns: must be >= 1, got 0$"),
    ({"think_time": -1}, r"^think_time: must be >= 0 \(seconds\), got -1\.0$"),
    ({"system_prompt_len": -5}, r"^system_prompt_len: must be >= 0 \(tokens\), got -5$"),
    ({"max_len": 1}, r"^max_len: must be >= 2 \(tokens\), got 1$"),
    ({"lengths": "sharegpt"}, r"^lengths: expected a synthetic workload \(sharegpt-paper, .*got 'sharegpt'$"),
    ({"lengths": 3}, r"^lengths: expected str, got 3$"),
    ({"num_sessions": 2.5}, r"^num_sessions: expected int, got 2\.5$"),
    ({"think_time_s": 3}, r"^think_time_s: unknown parameter; allowed: kind, num_sessions, "),
    ({"prompt_frac": 0.5}, r"^prompt_frac: unknown parameter"),
])
def test_bad_parameters_name_the_field(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        check_workload({**TABLE, **change}, partial=False)
    assert "\n" not in str(info.value)


def test_a_missing_parameter_names_it() -> None:
    with pytest.raises(ValueError, match=r"^session_rate: required by workload kind 'sessions'$"):
        check_workload({"kind": "sessions", "num_sessions": 3}, partial=False)


STUDY = """
[study]
description = "sessions"
seed = 3
allocators = ["vllm"]
min_requests = 30

[fixed]
model = "llama-3.1-8b"
gpu = "h100-80gb"
max_seq_len = 8192
prefix_caching = true
num_requests = 200

[workload]
kind = "sessions"
num_sessions = 40
session_rate = 2.0
turns_mean = 5
max_turns = 12
think_time = 20
lengths = "alpaca-paper"
system_prompt_len = 700
max_len = 4096

[sweep]
workload.think_time = [5.0, 20.0]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "t.toml"
    path.write_text(text)
    return path


def test_a_study_replays_the_session_trace_as_drawn(tmp_path: Path) -> None:
    study = load_study(write(tmp_path, STUDY))
    runs = expand(study, scale=0.1)  # 200 requests scaled to 20, floor 30
    assert [r.spec.num_requests for r in runs] == [30, 30]
    assert [r.columns["workload_think_time"] for r in runs] == [5.0, 20.0]
    assert runs[0].spec.trace == "generated:sessions" and runs[0].spec.rate is None
    row = run_one(runs[1]).row
    assert row["num_requests"] == 30
    expected = make_sessions(SPEC).trace
    assert row["prefix_cache_queries"] == int(expected.prompt_len[:30].sum())
    assert row["prefix_cache_hits"] > 0  # later turns find the earlier ones


@pytest.mark.parametrize(("old", "new", "message"), [
    ("num_requests = 200\n", "num_requests = 200\nrate = 2.0\n",
     r"^t\.toml: \[fixed\] rate: a sessions workload carries its own arrival times; drop rate"),
    ("workload.think_time = [5.0, 20.0]\n", "rate = [1.0, 2.0]\n",
     r"^t\.toml: \[sweep\] rate: a sessions workload carries its own arrival times"),
    ("workload.think_time = [5.0, 20.0]\n", "workload.session_rate = [1.0, 0.0]\n",
     r"^t\.toml: \[sweep\] workload\.session_rate: session_rate: must be > 0"),
    ('lengths = "alpaca-paper"', 'lengths = "nope"',
     r"^t\.toml: \[workload\]: lengths: expected a synthetic workload"),
    ("think_time = 20\n", 'think_time = "long"\n', r"^t\.toml: \[workload\]: think_time: expected float"),
])
def test_study_mistakes_are_one_line_and_name_the_key(tmp_path: Path, old: str, new: str,
                                                      message: str) -> None:
    assert old in STUDY
    with pytest.raises(FragsimError, match=message) as info:
        load_study(write(tmp_path, STUDY.replace(old, new, 1)))
    assert "\n" not in str(info.value)
