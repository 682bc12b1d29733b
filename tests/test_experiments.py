"""Experiment files: schema errors name the key, grids expand to exact lists, workloads fit."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from fragsim.errors import FragsimError
from fragsim.experiments import build_trace, draw, expand, load_study, lognormal_params
from fragsim.studies.grid import scaled
from fragsim.studies.workloads import check_workload

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "experiments"

BASE = """
[study]
description = "a test study"
seed = 3
allocators = ["orca-oracle", "vllm"]

[fixed]
trace = "azure-conv"
num_requests = 40
cost_model = "fixed"
step_time_s = 0.01
"""


def write(tmp_path: Path, text: str, name: str = "t.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def rows(runs: list) -> list[tuple]:
    return [(r.case, r.spec.rate, r.spec.block_size, r.allocator, r.spec.num_requests) for r in runs]


# ---------------------------------------------------------------- grid expansion

def test_grid_is_cases_then_cartesian_product_then_allocators(tmp_path: Path) -> None:
    study = load_study(write(tmp_path, BASE + """
[sweep]
block_size = [8, 16]

[[cases]]
label = "slow"
[cases.sweep]
rate = [0.5, 1.0]

[[cases]]
label = "fast"
rate = 4.0
allocators = ["vllm"]
"""))
    assert rows(expand(study)) == [
        ("slow", 0.5, 8, "orca-oracle", 40), ("slow", 0.5, 8, "vllm", 40),
        ("slow", 1.0, 8, "orca-oracle", 40), ("slow", 1.0, 8, "vllm", 40),
        ("slow", 0.5, 16, "orca-oracle", 40), ("slow", 0.5, 16, "vllm", 40),
        ("slow", 1.0, 16, "orca-oracle", 40), ("slow", 1.0, 16, "vllm", 40),
        ("fast", 4.0, 8, "vllm", 40),
        ("fast", 4.0, 16, "vllm", 40),
    ]
    assert study.axes == ["block_size", "rate"]


def test_run_ids_are_stable_unique_and_name_point_and_allocator(tmp_path: Path) -> None:
    study = load_study(write(tmp_path, BASE + "[sweep]\nrate = [1.0, 2.0]\n"))
    runs = expand(study)
    assert [r.run_id for r in runs] == [r.run_id for r in expand(load_study(study.path))]
    assert len({r.run_id for r in runs}) == 4
    assert len({r.point_id for r in runs}) == 2
    assert all(r.run_id == f"{r.point_id}-{r.allocator}" for r in runs)
    assert runs[0].spec.seed == 3


def test_scale_shrinks_requests_to_a_floor_and_changes_the_ids(tmp_path: Path) -> None:
    study = load_study(write(tmp_path, BASE.replace("num_requests = 40", "num_requests = 400")))
    assert [r.spec.num_requests for r in expand(study, scale=0.1)] == [50, 50]  # floor 50
    assert [r.spec.num_requests for r in expand(study, scale=0.5)] == [200, 200]
    assert [r.spec.num_requests for r in expand(study, scale=0.1, min_requests=10)] == [40, 40]
    assert expand(study, scale=0.5)[0].point_id != expand(study)[0].point_id
    assert (scaled(20, 0.1, 32), scaled(1000, 0.05, 50), scaled(1000, 1.0, 50)) == (20, 50, 1000)


def test_duration_replays_rate_times_seconds_and_scales_like_a_count(tmp_path: Path) -> None:
    study = load_study(write(tmp_path, BASE.replace('trace = "azure-conv"', 'trace = "sharegpt-paper"') + """
[[cases]]
label = "one hour"
duration_s = 3600
[cases.sweep]
rate = [0.5, 2.0]

[[cases]]
label = "counted"
rate = 2.0
"""))
    runs = expand(study)
    assert [(r.case, r.spec.rate, r.spec.num_requests) for r in runs[::2]] == [
        ("one hour", 0.5, 1800), ("one hour", 2.0, 7200), ("counted", 2.0, 40)]
    assert runs[0].columns["duration_s"] == 3600.0 and "duration_s" not in runs[-1].columns
    assert [r.spec.num_requests for r in expand(study, scale=0.1)][::2] == [180, 720, 40]


@pytest.mark.parametrize(("patch", "message"), [
    ("duration_s = 60\n", r"\[fixed\] duration_s: set together with num_requests; give one"),
    ("[[cases]]\nlabel = 'a'\nduration_s = 0\nrate = 1.0\n", r"duration_s: expected seconds > 0, got 0"),
    ("[[cases]]\nlabel = 'a'\nduration_s = 60\n", r"\[\[cases\]\] 'a' duration_s: needs a rate"),
])
def test_duration_errors_name_the_key(tmp_path: Path, patch: str, message: str) -> None:
    text = BASE + patch if patch.startswith("[") else BASE.replace("num_requests = 40\n", "num_requests = 40\n" + patch)
    with pytest.raises(FragsimError, match=message):
        load_study(write(tmp_path, text))


def test_shared_traces_expand_from_option_or_env_but_ids_do_not_move(
        tmp_path: Path, shared_traces: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    study = load_study(write(tmp_path, BASE.replace(
        'trace = "azure-conv"', 'trace = "${SHARED_TRACES}/sharegpt_8k_lengths.csv"\nrate = 1.0')))
    monkeypatch.delenv("FRAGSIM_SHARED_TRACES", raising=False)
    with pytest.raises(FragsimError, match=r"t\.toml: trace .*--traces-dir DIR or set FRAGSIM_SHARED_TRACES"):
        expand(study)
    with pytest.raises(FragsimError, match="sharegpt_8k_lengths.csv not found"):
        expand(study, traces_dir=tmp_path)
    runs = expand(study, traces_dir=shared_traces)
    assert Path(runs[0].spec.trace) == shared_traces / "sharegpt_8k_lengths.csv"
    assert runs[0].columns["trace"] == "${SHARED_TRACES}/sharegpt_8k_lengths.csv"
    monkeypatch.setenv("FRAGSIM_SHARED_TRACES", str(shared_traces))
    assert [r.run_id for r in expand(study)] == [r.run_id for r in runs]


def test_every_shipped_experiment_loads_and_expands(shared_traces: Path) -> None:
    names = sorted(p.stem for p in EXPERIMENTS.glob("*.toml") if p.stem != "catalog_example")
    assert {"vllm_fig2", "vllm_fig13", "block_size", "rate_sweep", "real_traces", "seed_capacity_7b",
            "seed_peak_traffic", "seed_underprovision", "seed_rag_longtail", "sharing",
            "prefix_mooncake", "vmm"} <= set(names)
    for name in names:
        study = load_study(EXPERIMENTS / f"{name}.toml")
        assert study.figures, name
        assert expand(study, scale=0.1, traces_dir=shared_traces), name


# ---------------------------------------------------------------- schema errors

@pytest.mark.parametrize(("patch", "message"), [
    ("[sweep]\nrate = []\n", r"^t\.toml: \[sweep\] rate: expected a non-empty list$"),
    ("[sweep]\nrate = 2.0\n", r"^t\.toml: \[sweep\] rate: expected a non-empty list$"),
    ("[sweep]\nrate = [1.0, 1.0]\n", r"\[sweep\] rate: repeated values"),
    ("[sweep]\nrate = [1.0, \"fast\"]\n", r"\[sweep\] rate: expected a number, got 'fast'"),
    ("[sweep]\nmodle = [\"opt-13b\"]\n", r"\[sweep\] modle: unknown parameter"),
    ("[sweep]\nnum_requests = [10]\n", r"\[sweep\] num_requests: also set in \[fixed\]"),
    ("[figures]\nkind = 1\n", r"\[\[figures\]\]: expected an array of tables"),
    ("[[figures]]\nkind = \"pie\"\nfile = \"a.png\"\n", r"\[\[figures\]\] #1 kind: expected one of"),
    ("[[figures]]\nkind = \"lines\"\nfile = \"a.png\"\ny = \"x\"\n", r"\[\[figures\]\] #1 x: required"),
    ("[[figures]]\nkind = \"bars\"\nfile = \"../a.png\"\nx = \"a\"\ny = \"b\"\n",
     r"#1 file: expected a plain name ending in \.png"),
    ("[[figures]]\nkind = \"lines\"\nfile = \"a.png\"\nx = \"rate\"\ny = \"a\"\ncolour = 1\n",
     r"\[\[figures\]\] #1 colour: unknown key"),
    ("[results]\nx = 1\n", r"t\.toml: \[results\]: unknown table"),
    ("[[cases]]\nlabel = \"a\"\nbatching = \"dynamic\"\n",
     r"\[\[cases\]\] #1 batching: expected one of continuous, static, got 'dynamic'"),
    ("[[cases]]\nrate = 1.0\n", r"\[\[cases\]\] #1 label: required"),
    ("[[cases]]\nlabel = \"a\"\nseed = 1\n", r"\[\[cases\]\] #1 seed: set the seed in \[study\]"),
    ("[[cases]]\nlabel = \"a\"\nallocators = [\"vllm\", \"nope\"]\n",
     r"\[\[cases\]\] #1 allocators: unknown allocator 'nope'"),
    ("[sweep]\nrate = [1.0]\n[[cases]]\nlabel = \"a\"\nrate = 2.0\n",
     r"\[\[cases\]\] #1 rate: is already swept in \[sweep\]"),
    ("[[cases]]\nlabel = \"a\"\n[[cases]]\nlabel = \"a\"\n", r"\[\[cases\]\] label: repeated labels"),
])
def test_schema_errors_name_the_file_table_and_key(tmp_path: Path, patch: str, message: str) -> None:
    with pytest.raises(FragsimError, match=message):
        load_study(write(tmp_path, BASE + patch))


@pytest.mark.parametrize(("old", "new", "message"), [
    ('allocators = ["orca-oracle", "vllm"]', 'allocators = ["orca-oracle", "magic"]',
     r"^t\.toml: \[study\] allocators: unknown allocator 'magic'; known: ft-static"),
    ('allocators = ["orca-oracle", "vllm"]', "allocators = []", r"\[study\] allocators: expected a non-empty list"),
    ("seed = 3", "", r"\[study\] seed: required"),
    ("seed = 3", 'seed = "3"', r"\[study\] seed: expected an integer, got '3'"),
    ("seed = 3", "seed = 3\nrepeat = 2", r"\[study\] repeat: unknown key"),
    ("num_requests = 40", 'num_requests = "many"', r"\[fixed\] num_requests: expected an integer, got 'many'"),
    ("num_requests = 40", "num_requests = 40.5", r"\[fixed\] num_requests: expected an integer"),
    ("num_requests = 40", "truncate_prompts = 1", r"\[fixed\] truncate_prompts: expected true or false"),
    ("num_requests = 40", "time_window_s = [0, 1, 2]", r"\[fixed\] time_window_s: expected a list of 2 numbers"),
    ('trace = "azure-conv"', "", r"\[fixed\] trace: no trace and no \[workload\]"),
])
def test_schema_errors_in_study_and_fixed(tmp_path: Path, old: str, new: str, message: str) -> None:
    with pytest.raises(FragsimError, match=message):
        load_study(write(tmp_path, BASE.replace(old, new)))


def test_bad_toml_and_missing_file_are_fragsim_errors(tmp_path: Path) -> None:
    with pytest.raises(FragsimError, match=r"t\.toml: not valid TOML"):
        load_study(write(tmp_path, "[study\n"))
    with pytest.raises(FragsimError, match="no such experiment file"):
        load_study(tmp_path / "absent.toml")


WORKLOAD_BASE = BASE.replace('trace = "azure-conv"\n', "") + """
[workload]
kind = "longtail"
short_tokens = [200, 300]
long_tokens = 1500
long_frac = 0.05
"""


@pytest.mark.parametrize(("patch", "message"), [
    ("[sweep]\nworkload.long_frac = [0.1, 2.0]\n", r"\[sweep\] workload\.long_frac: long_frac: must be in \[0, 1\]"),
    ("[sweep]\nworkload.size = [1]\n", r"\[sweep\] workload\.size: size: unknown parameter"),
    ("[[cases]]\nlabel = \"a\"\ntrace = \"azure-conv\"\n", r"\[\[cases\]\] 'a' trace: set together with \[workload\]"),
    ("[[cases]]\nlabel = \"a\"\nworkload = { kind = \"lognormal\", mean_tokens = 100.0 }\n",
     r"\[\[cases\]\] 'a' workload: p99_tokens: required"),
])
def test_workload_errors(tmp_path: Path, patch: str, message: str) -> None:
    with pytest.raises(FragsimError, match=message):
        load_study(write(tmp_path, WORKLOAD_BASE + patch))


def test_workload_axes_and_case_overrides_expand(tmp_path: Path) -> None:
    study = load_study(write(tmp_path, WORKLOAD_BASE + """
[sweep]
workload.long_frac = [0.0, 0.1]
[[cases]]
label = "short"
workload = { short_tokens = [10, 20] }
"""))
    runs = expand(study)
    assert [(r.workload["long_frac"], r.workload["short_tokens"]) for r in runs[::2]] == [
        (0.0, (10, 20)), (0.1, (10, 20))]
    assert runs[0].columns["workload_short_tokens"] == "10-20"
    assert runs[0].spec.trace == "generated:longtail"
    assert study.axes == ["workload_long_frac"]


# ---------------------------------------------------------------- generated workloads

def test_lognormal_fit_hits_the_mean_and_p99() -> None:
    mu, sigma = lognormal_params(180.0, 450.0)
    assert (round(mu, 4), round(sigma, 4)) == (5.0986, 0.4344)
    assert math.exp(mu + sigma**2 / 2) == pytest.approx(180.0)
    assert math.exp(mu + 2.3263478740408408 * sigma) == pytest.approx(450.0)
    wl = check_workload({"kind": "lognormal", "mean_tokens": 180, "p99_tokens": 450,
                         "prompt_frac": 0.4}, partial=False)
    trace = build_trace(wl, 200_000, seed=0, rate=None)
    total = trace.prompt_len + trace.output_len
    assert total.mean() == pytest.approx(180.5, abs=1.0)     # ceil adds about half a token
    assert np.percentile(total, 99) == pytest.approx(450, rel=0.02)
    assert (trace.prompt_len >= 1).all() and (trace.output_len >= 1).all()
    assert trace.has_timestamps and not trace.arrival_s.any()  # a burst at t = 0


def test_longtail_mixture_and_seeded_arrivals() -> None:
    wl = check_workload({"kind": "longtail", "short_tokens": [200, 300], "long_tokens": 1500,
                         "long_frac": 0.05, "prompt_frac": 0.85}, partial=False)
    trace = build_trace(wl, 20_000, seed=1, rate=10.0)
    total = trace.prompt_len + trace.output_len
    assert set(np.unique(total[total > 300])) == {1500}
    assert (total[total <= 300] >= 200).all()
    assert (total == 1500).mean() == pytest.approx(0.05, abs=0.005)
    assert len(trace) / trace.duration_s == pytest.approx(10.0, rel=0.05)
    again = build_trace(wl, 20_000, seed=1, rate=10.0)
    assert np.array_equal(trace.arrival_s, again.arrival_s) and np.array_equal(trace.prompt_len, again.prompt_len)


def test_lognormal_rejects_a_p99_no_lognormal_has() -> None:
    with pytest.raises(ValueError, match=r"p99_tokens: p99_tokens / mean_tokens must be in \(1,"):
        check_workload({"kind": "lognormal", "mean_tokens": 100, "p99_tokens": 90}, partial=False)


# ---------------------------------------------------------------- figures

def test_a_figure_naming_a_missing_column_fails_clearly(tmp_path: Path) -> None:
    import pandas as pd

    study = load_study(write(tmp_path, BASE + """
[[figures]]
kind = "lines"
file = "a.png"
x = "rate"
y = "mean_runing"
"""))
    table = pd.DataFrame({"rate": [1.0], "allocator": ["vllm"], "mean_running": [2.0]})
    with pytest.raises(FragsimError, match=r"t\.toml: figure a\.png: no column 'mean_runing'"):
        draw(study.figures[0], table, None, study)


def test_log_axes_label_swept_values_and_one_two_five() -> None:
    import pandas as pd
    from matplotlib.figure import Figure

    from fragsim.studies.figures import _log_tick, _log_x

    assert [_log_tick(v) for v in (1, 2, 3, 5, 0.5, 0.03, 5e7, 2e9, 1e3, 0)] == [
        "1", "2", "", "5", "0.5", "", "50M", "2G", "1k", ""]
    ax = Figure().subplots()
    ax.plot([0.01, 0.3, 3.0], [1, 2, 3])
    _log_x(ax, pd.Series([0.01, 0.3, 3.0, 0.3]))
    assert ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.01", "0.3", "3"]


def test_a_row_without_x_or_group_is_a_dashed_reference_line() -> None:
    """A case without the swept thing (no offload tier in a sweep of tier sizes) draws as a
    dashed horizontal line at its value, named by its case, in lines and bars figures."""
    import math

    import pandas as pd

    from fragsim.studies.schema import FigureSpec

    table = pd.DataFrame({
        "case": ["no tier", "CPU tier", "CPU tier"],
        "kv_offloading_size": [math.nan, 64.0, 256.0],
        "kv_offloading_backend": ["native", "native", "native"],
        "allocator": ["vllm"] * 3,
        "mean_ttft_s": [0.5, 0.5, 0.4],
        "tiers.cpu.free_frac": [math.nan, 0.1, 0.2],
    })
    lines = draw(FigureSpec("lines", "a.png", x="kv_offloading_size",
                            y=("mean_ttft_s", "tiers.cpu.free_frac"), group="case", logx=True), table, None)
    ttft, free = lines.axes[:2]
    reference = [line for line in ttft.get_lines() if line.get_label() == "no tier"]
    assert len(reference) == 1 and reference[0].get_linestyle() == "--"
    assert list(reference[0].get_ydata()) == [0.5, 0.5]
    (tier,) = [line for line in ttft.get_lines() if line.get_label() == "CPU tier"]
    assert list(tier.get_xdata()) == [64.0, 256.0]
    assert [line.get_label() for line in free.get_lines()] == ["CPU tier"]  # no value: no line
    assert list(free.get_lines()[0].get_ydata()) == [10.0, 20.0]  # a tier split in percent
    bars = draw(FigureSpec("bars", "b.png", x="kv_offloading_backend", y=("mean_ttft_s",),
                           group="kv_offloading_size"), table, None)
    ax = bars.axes[0]
    assert [p.get_height() for p in ax.patches] == [0.5, 0.4]  # one bar per tier size
    assert [line.get_label() for line in ax.get_lines()] == ["no tier"]
