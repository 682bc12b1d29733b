"""The fitted step-cost model, its presets, and ``fragsim calibrate``."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fragsim import calibrate
from fragsim.catalog import get_gpu, get_model
from fragsim.cli import main as cli_main
from fragsim.costmodel import (
    COST_MODEL_PRESETS,
    TERMS,
    RooflineCostModel,
    StepCostModel,
    load_cost_model,
    make_cost_model,
    resolve_cost_model_name,
)
from fragsim.errors import FragsimError
from fragsim.simulate import RunSpec, load_workload, simulate

TRUTH = StepCostModel(overhead_s=4e-3, per_seq_s=2e-5, prefill_token_s=3e-5, attention_unit_s=1e-9,
                      decode_token_s=1e-5, weights_s=8e-3, context_token_s=4e-8, name="truth")


def synthetic_steps(n: int = 300, noise: float = 0.02, seed: int = 1) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    prefill = rng.integers(0, 4096, n) * (rng.random(n) < 0.3)
    decode = rng.integers(0, 256, n)
    context = decode * rng.integers(100, 3000, n)
    units = prefill * (prefill - 1) // 2
    t = TRUTH.step_times(prefill, units, decode, context) * np.exp(rng.normal(0, noise, n))
    return pd.DataFrame({"num_prefill_tokens": prefill, "num_decode": decode,
                         "decode_context": context, "step_time_ms": t * 1e3})


# ------------------------------------------------------------------ the model


def test_scalar_and_array_step_times_are_bit_identical() -> None:
    rng = np.random.default_rng(0)
    p, u, d, c = (rng.integers(0, 5000, 50) for _ in range(4))
    many = TRUTH.step_times(p, u, d, c)
    one = [TRUTH.step_time(int(a), int(b), int(e), int(f)) for a, b, e, f in zip(p, u, d, c, strict=True)]
    assert many.tolist() == one
    ctx = rng.integers(0, 10**6, 40)
    assert TRUTH.decode_step_times(7, ctx).tolist() == [TRUTH.decode_step_time(7, int(x)) for x in ctx]
    assert TRUTH.decode_step_times(7, ctx[:1]).tolist() == [TRUTH.decode_step_time(7, int(ctx[0]))]


def test_the_regimes() -> None:
    m = TRUTH
    # memory bound: weights + KV read, plus the fixed costs outside the max
    assert m.step_time(0, 0, 10, 1000) == pytest.approx(4e-3 + 10 * 2e-5 + 8e-3 + 1000 * 4e-8)
    # compute bound: a long prompt chunk
    assert m.step_time(4000, 0, 0, 0) == pytest.approx(4e-3 + 4000 * 3e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_roofline_in_this_shape(tp: int) -> None:
    roof = RooflineCostModel(get_model("llama-2-13b"), get_gpu("a100-80gb"), tp=tp)
    fitted = StepCostModel.from_roofline(roof)
    for args in [(0, 0, 32, 32_000), (2048, 2048 * 2047 // 2, 0, 0), (512, 10_000, 16, 20_000)]:
        assert fitted.step_time(*args) == pytest.approx(roof.step_time(*args), rel=1e-3 if tp > 1 else 1e-12)


def test_blis_preset_is_blis_beta() -> None:
    m = load_cost_model("blis-llama-3.1-8b-h100")
    beta = (5752.705191348184, 17.25086436834028, 5.999143920128404)
    for p, d in [(0, 1), (0, 200), (2048, 0), (900, 64)]:
        assert m.step_time(p, p * (p - 1) // 2, d, d * 1000) == pytest.approx(
            (beta[0] + beta[1] * p + beta[2] * d) * 1e-6, rel=1e-12)
    assert (m.model, m.gpu, m.tp) == ("llama-3.1-8b", "h100-80gb", 1)


def test_presets_load_and_auto_picks_them() -> None:
    assert {"vllm-paper", "blis-llama-3.1-8b-h100"} <= set(COST_MODEL_PRESETS)
    for name in COST_MODEL_PRESETS:
        assert load_cost_model(name).name == name
    assert resolve_cost_model_name("auto", "llama-3.1-8b", "h100-80gb", 1) == "blis-llama-3.1-8b-h100"
    assert resolve_cost_model_name("auto", "opt-13b", "a100-40gb", 1) == "vllm-paper"
    assert resolve_cost_model_name("auto", "opt-13b", "a100-40gb", 2) == "roofline"
    cm = make_cost_model("auto", model=get_model("llama-2-7b"), gpu=get_gpu("a100-80gb"))
    assert isinstance(cm, RooflineCostModel)


def test_toml_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text(replace(TRUTH, model="opt-13b", gpu="a100-40gb", source='a "quoted" source',
                            fit={"rows": 3, "free": ["overhead_s"], "err": {"mape": 0.1}}).to_toml())
    back = load_cost_model(path)
    assert back.coefficients() == TRUTH.coefficients()
    assert (back.model, back.gpu, back.source) == ("opt-13b", "a100-40gb", 'a "quoted" source')
    assert back.fit == {"rows": 3, "free": ["overhead_s"], "err": {"mape": 0.1}}


@pytest.mark.parametrize("text, match", [
    ("[coefficients]\noverhead_s = -1.0\n", "overhead_s must be a finite number >= 0"),
    ("[coefficients]\noverheads = 1.0\n", r"overheads unknown; allowed: overhead_s"),
    ("name = 'x'\n", r"needs a \[coefficients\] table"),
    ("[coefficients]\noverhead_s = 0.0\n", "every coefficient is 0"),
    ("[coefficients\n", "not valid TOML"),
])
def test_bad_cost_model_files_name_the_field(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(FragsimError, match=match):
        load_cost_model(path)


def test_unknown_cost_model_lists_the_choices() -> None:
    with pytest.raises(FragsimError, match="no such preset or file; presets: .*vllm-paper"):
        load_cost_model("nope.toml")


def test_exact_and_stretch_modes_agree_with_a_fitted_model() -> None:
    spec = RunSpec(trace="sharegpt-paper", rate=4.0, num_requests=200, model="opt-13b",
                   gpu="a100-40gb", cost_model="vllm-paper")
    trace = load_workload(spec)
    fast = simulate(trace, "vllm", spec).requests
    exact = simulate(trace, "vllm", replace(spec, exact_steps=True)).requests
    assert fast["finish_s"].tolist() == exact["finish_s"].tolist()
    assert fast["num_preemptions"].tolist() == exact["num_preemptions"].tolist()


# ------------------------------------------------------------------ reading measurements


def test_vllm_benchmark_json(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({
        "start_times": [10.5, 10.0, 11.0], "input_lens": [100, 50, 70], "output_lens": [3, 1, 5],
        "ttfts": [0.2, 0.1, 0.3], "itls": [[0.02, 0.04], [], [0.01] * 4], "errors": ["", "", "boom"]}))
    m, _ = calibrate.load_measurements(path)
    assert m.kind == "requests" and m.dropped == 1
    t = m.table
    assert t["arrival_s"].tolist() == [0.0, 0.5]          # sorted, from the first start
    assert t["prompt_len"].tolist() == [50, 100]
    assert np.isnan(t["tpot_s"].iloc[0]) and t["tpot_s"].iloc[1] == pytest.approx(0.03)


def test_blis_trace_v2(tmp_path: Path) -> None:
    path = tmp_path / "trace_data.csv"
    path.write_text("request_id,input_tokens,output_tokens,arrival_time_us,send_time_us,"
                    "first_chunk_time_us,last_chunk_time_us,num_chunks,status\n"
                    "0,100,11,0,1000,51000,151000,11,ok\n"
                    "1,80,5,500000,500000,520000,560000,5,ok\n"
                    "2,80,5,600000,600000,0,0,0,error\n")
    m, _ = calibrate.load_measurements(path)
    assert m.kind == "requests" and len(m.table) == 2 and m.dropped == 1
    assert m.table["ttft_s"].tolist() == pytest.approx([0.05, 0.02])
    assert m.table["tpot_s"].tolist() == pytest.approx([0.01, 0.01])


def test_steps_table_units_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "steps.csv"
    synthetic_steps(20).to_csv(path, index=False)
    m, _ = calibrate.load_measurements(path)
    assert m.kind == "steps" and m.table["step_time_s"].max() < 1
    bad = synthetic_steps(5)
    bad.loc[3, "num_decode"] = -2
    bad.to_csv(path, index=False)
    with pytest.raises(FragsimError, match=r"row 4: num_decode = -2"):
        calibrate.load_measurements(path)
    pd.DataFrame({"a": [1], "b": [2]}).to_csv(path, index=False)
    with pytest.raises(FragsimError, match="not a measurements file.*its columns are a, b"):
        calibrate.load_measurements(path)


# ------------------------------------------------------------------ fitting


def test_steps_fit_recovers_the_coefficients() -> None:
    m = calibrate.Measurements("steps", "synthetic", calibrate._steps(Path("s"), synthetic_steps()).table)
    report = calibrate.fit_steps(m, StepCostModel(overhead_s=1e-3))
    for term in TERMS:
        # the compute-bound decode and attention terms show only in steps with long prompts
        rel = 0.5 if term in ("decode_token_s", "attention_unit_s") else 0.15
        assert getattr(report.model, term) == pytest.approx(getattr(TRUTH, term), rel=rel), term
    assert report.holdout_error["rows"] == 60
    assert report.holdout_error["mape"] < 0.04


def test_steps_fit_leaves_unmeasured_terms_at_the_prior() -> None:
    steps = synthetic_steps()
    steps = steps[steps["num_prefill_tokens"] == 0].reset_index(drop=True)
    m = calibrate._steps(Path("s"), steps)
    prior = replace(TRUTH, prefill_token_s=7e-5, attention_unit_s=2e-9)
    report = calibrate.fit_steps(m, prior)
    assert "prefill_token_s" not in report.free and report.model.prefill_token_s == 7e-5


def test_steps_fit_needs_enough_rows() -> None:
    m = calibrate._steps(Path("few.csv"), synthetic_steps(8))
    with pytest.raises(FragsimError, match="few.csv: 6 steps to fit 7 coefficients"):
        calibrate.fit_steps(m, StepCostModel(overhead_s=1e-3))


def test_requests_fit_recovers_a_known_engine() -> None:
    spec = RunSpec(trace="sharegpt-paper", rate=3.0, num_requests=150, model="opt-13b",
                   gpu="a100-40gb")  # loaded: the batch, and so the per-sequence cost, shows
    truth = replace(StepCostModel.from_roofline(RooflineCostModel(get_model("opt-13b"),
                                                                  get_gpu("a100-40gb"))),
                    overhead_s=6e-3, per_seq_s=3e-4)
    measured = simulate(load_workload(spec), "vllm", spec, cost=truth).requests
    m = calibrate._requests(Path("r"), measured["arrival_s"], measured["prompt_len"],
                            measured["output_len"], measured["ttft_s"], measured["tpot_s"])
    prior = replace(truth, overhead_s=2e-3, per_seq_s=0.0)
    report = calibrate.fit_requests(m, prior, spec, free=["overhead_s", "per_seq_s"],
                                    max_evaluations=120)
    assert report.model.overhead_s == pytest.approx(6e-3, rel=0.2)
    assert report.model.per_seq_s == pytest.approx(3e-4, rel=0.2)
    assert abs(report.holdout_error["mean_tpot_error"]) < 0.05


def test_points_fit_matches_the_batch(tmp_path: Path) -> None:
    spec = RunSpec(model="opt-13b", gpu="a100-40gb")
    truth = replace(StepCostModel.from_roofline(RooflineCostModel(get_model("opt-13b"),
                                                                  get_gpu("a100-40gb"))),
                    per_seq_s=4e-4)
    point = replace(spec, trace="alpaca-paper", rate=20.0, num_requests=300)
    target = simulate(load_workload(point), "vllm", point, cost=truth).summary["mean_running"]
    path = tmp_path / "points.toml"
    path.write_text(f'[system]\nmodel = "opt-13b"\ngpu = "a100-40gb"\n\n[[points]]\n'
                    f'trace = "alpaca-paper"\nrate = 20.0\nnum_requests = 300\nallocator = "vllm"\n'
                    f"mean_running = {target}\n")
    m, system = calibrate.load_measurements(path)
    assert system == {"model": "opt-13b", "gpu": "a100-40gb"}
    prior = replace(truth, per_seq_s=0.0)
    report = calibrate.fit_points(m, prior, spec, free=["per_seq_s"], max_evaluations=40)
    assert report.rows["error"].abs().max() < 0.02


def test_points_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text('[[points]]\ntrace = "alpaca-paper"\nallocator = "vllm"\nmean_running = -3\n')
    with pytest.raises(FragsimError, match=r"#1: mean_running = -3; expected > 0"):
        calibrate.load_measurements(path)


def test_vllm_paper_preset_documents_its_fit() -> None:
    m = load_cost_model("vllm-paper")
    assert (m.model, m.gpu, m.tp) == ("opt-13b", "a100-40gb", 1)
    assert m.fit is not None and m.fit["free"] == ["overhead_s", "per_seq_s"]
    points = m.fit["points"]
    fitted = [p for p in points.values() if not p["held_out"]]
    assert len(fitted) == 2 and all(abs(p["fitted"] / p["measured"] - 1) < 0.05 for p in fitted)


# ------------------------------------------------------------------ the command


def test_calibrate_then_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    steps = tmp_path / "steps.csv"
    synthetic_steps().to_csv(steps, index=False)
    out = tmp_path / "mine.toml"
    assert cli_main(["calibrate", str(steps), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "error on the held back rows" in text and out.is_file()
    assert cli_main(["run", "--model", "opt-13b", "--gpu", "a100-40gb", "--num-requests", "40",
                     "--allocator", "vllm", "--cost-model", str(out), "--no-save"]) == 0
    assert "step times: mine (fitted)" in capsys.readouterr().out


def test_run_rejects_an_unknown_cost_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["run", "--num-requests", "10", "--cost-model", "magic", "--no-save"]) == 2
    assert "no such preset or file" in capsys.readouterr().err


def kernel_rows(read_gbps: float = 3000.0, launch_s: float = 8e-6) -> list[dict[str, float | str]]:
    rows: list[dict[str, float | str]] = []
    for batch in (1, 16, 64):
        for context in (512, 2048, 8192):
            nbytes = 2 * batch * context * 32 * 128 * 2
            for layout, slow in (("contiguous", 1.0), ("paged", 1.1)):
                rows.append({"batch": batch, "context": context, "layout": layout, "bytes": nbytes,
                             "ms": (launch_s + slow * nbytes / (read_gbps * 1e9)) * 1e3})
    return rows


def test_attention_term_from_kernel_times(tmp_path: Path) -> None:
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps({"kernels": {"rows": kernel_rows()}}))   # gpu_check's report shape
    kv = get_model("opt-13b").kv_bytes_per_token
    per_token, info = calibrate.attention_from_kernels(path, kv)
    assert info["read_gbps"] == pytest.approx(3000 / 1.1, rel=1e-9)
    assert per_token == pytest.approx(kv * 1.1 / 3000e9, rel=1e-9)
    path.write_text(json.dumps(kernel_rows()[:2]))
    with pytest.raises(FragsimError, match="need at least two paged rows"):
        calibrate.attention_from_kernels(path, kv)


def test_calibrate_holds_the_measured_attention_term(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    kernels = tmp_path / "kernels.json"
    kernels.write_text(json.dumps(kernel_rows()))
    steps = tmp_path / "steps.csv"
    synthetic_steps().to_csv(steps, index=False)
    out = tmp_path / "m.toml"
    assert cli_main(["calibrate", str(steps), "--model", "opt-13b", "--gpu", "a100-40gb",
                     "--attention-times", str(kernels), "--out", str(out)]) == 0
    assert "measured attention" in capsys.readouterr().err
    m = load_cost_model(out)
    assert m.context_token_s == pytest.approx(get_model("opt-13b").kv_bytes_per_token * 1.1 / 3000e9)
    assert m.fit is not None and m.fit["attention_times"]["rows"] == 9


def test_calibrate_reports_the_error_on_another_file(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    fit_on, other = tmp_path / "monday.csv", tmp_path / "tuesday.csv"
    synthetic_steps(seed=1).to_csv(fit_on, index=False)
    synthetic_steps(seed=2, noise=0.05).to_csv(other, index=False)
    out = tmp_path / "m.toml"
    assert cli_main(["calibrate", str(fit_on), "--evaluate", str(other), "--out", str(out)]) == 0
    assert "error on tuesday.csv (not fitted)" in capsys.readouterr().out
    m = load_cost_model(out)
    assert m.fit is not None
    held = m.fit["evaluated"]["tuesday.csv"]
    assert held["rows"] == 300 and 0.02 < held["mape"] < 0.08   # the other file's own noise


def test_a_point_replayed_as_a_transient_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """ShareGPT at 2 req/s under the vllm-paper-transient step costs: past vLLM's capacity, its queue
    grows for as long as requests arrive, so the mean batch of a short replay is a
    transient. The command names the point and writes nothing, unless told to."""
    monkeypatch.setenv("COLUMNS", "200")  # the table's last column whole
    path = tmp_path / "points.toml"
    path.write_text('[system]\nmodel = "opt-13b"\ngpu = "a100-40gb"\nmax_seq_len = 2048\n'
                    'cost_model = "vllm-paper-transient"\n\n'
                    '[[points]]\nlabel = "ShareGPT 2 req/s"\ntrace = "sharegpt-paper"\nrate = 2.0\n'
                    'num_requests = 400\nallocator = "vllm"\nmean_running = 30.0\n\n'
                    '[[points]]\nlabel = "ShareGPT 0.5 req/s"\ntrace = "sharegpt-paper"\nrate = 0.5\n'
                    'duration_s = 800\nallocator = "vllm"\nmean_running = 8.0\n')
    m, _ = calibrate.load_measurements(path)
    assert list(m.table["num_requests"]) == [400, 400]
    out = tmp_path / "fit.toml"
    args = ["calibrate", str(path), "--prior", "vllm-paper-transient", "--free", "per_seq_s", "--max-evaluations", "6",
            "--out", str(out)]
    assert cli_main(args) != 0
    captured = capsys.readouterr()
    assert "1 fitted point(s) replayed as a transient" in captured.err and "ShareGPT 2 req/s." in captured.err
    assert "growing: +" in captured.out and not out.exists()
    assert cli_main([*args, "--allow-transient"]) == 0
    fit = load_cost_model(str(out)).fit
    assert fit is not None
    assert [p["steady"] for p in fit["points"].values()] == [False, True]


def test_queue_trend_tells_a_growing_queue_from_a_steady_one() -> None:
    from fragsim.steady import queue_trend

    t = np.arange(0.0, 100.0, 1.0)
    flat = pd.DataFrame({"time_s": t, "covered_s": 1.0, "waiting": 20 + 3 * np.sin(t)})
    ramp = pd.DataFrame({"time_s": t, "covered_s": 1.0, "waiting": t})
    assert not queue_trend(flat, 100.0).growing
    grow = queue_trend(ramp, 100.0)
    assert grow.growing and grow.growth == pytest.approx(50.0) and grow.mean_waiting == pytest.approx(74.5)


def test_a_points_duration_needs_a_rate(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text('duration_s = 3600\n[[points]]\ntrace = "alpaca-paper"\nallocator = "vllm"\nmean_running = 3\n')
    with pytest.raises(FragsimError, match=r"#1: duration_s needs the point's rate"):
        calibrate.load_measurements(path)
    path.write_text('[[points]]\ntrace = "alpaca-paper"\nrate = 2.0\nduration_s = 10\nnum_requests = 5\n'
                    'allocator = "vllm"\nmean_running = 3\n')
    with pytest.raises(FragsimError, match=r"#1: give num_requests or duration_s, not both"):
        calibrate.load_measurements(path)
