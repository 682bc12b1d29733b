"""``fragsim sweep``: journaled runs resume after a crash; executors agree; Ray runs it too."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from fragsim.cli import main as cli_main
from fragsim.errors import FragsimError
from fragsim.experiments import expand, load_study, run_study
from fragsim.studies import runner

# 2 rates x 2 allocators = 4 runs of 40 requests with a constant step time: fast.
STUDY = """
[study]
description = "four runs"
seed = 0
allocators = ["orca-oracle", "vllm"]

[fixed]
trace = "azure-conv"
num_requests = 40            # requests
cost_model = "fixed"
step_time_s = 0.01           # seconds per step

[sweep]
rate = [2.0, 4.0]            # requests/s

[[figures]]
kind = "lines"
file = "latency.png"
x = "rate"
y = "mean_normalized_latency_s"

[[figures]]
kind = "split_bars"
file = "split.png"
panels = "rate"
"""


@pytest.fixture
def study_file(tmp_path: Path) -> Path:
    path = tmp_path / "four.toml"
    path.write_text(STUDY)
    return path


def same_table(a: pd.DataFrame, b: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(a.drop(columns="wall_time_s"), b.drop(columns="wall_time_s"))


def test_sweep_writes_table_figures_manifest_and_journal(study_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_study(load_study(study_file), out=out)
    folder = out / "four"
    assert sorted(p.name for p in folder.iterdir()) == [
        "latency.png", "points", "results.parquet", "split.png", "study.toml", "sweep.json"]
    runs = expand(load_study(study_file))
    assert sorted(p.name for p in (folder / "points").iterdir()) == sorted(f"{r.run_id}.json" for r in runs)
    table = pd.read_parquet(folder / "results.parquet")
    same_table(table, result.table)
    assert list(zip(table["rate"], table["allocator"], strict=True)) == [
        (2.0, "orca-oracle"), (2.0, "vllm"), (4.0, "orca-oracle"), (4.0, "vllm")]
    assert {"study", "case", "point_id", "model", "gpu", "seed", "token_states_frac",
            "mean_running", "refusal_rate", "mean_blocks_per_request"} <= set(table.columns)
    assert table["num_requests"].tolist() == [40] * 4
    manifest = json.loads((folder / "sweep.json").read_text())
    assert manifest["key_columns"] == ["case", "rate", "allocator"]
    assert manifest["command"] == "fragsim sweep experiments/four.toml"
    assert not list(folder.glob(".*"))  # no temporary files left behind


def test_rerun_after_deleting_results_runs_only_the_missing_points(study_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    study = load_study(study_file)
    first = run_study(study, out=out)
    assert (len(first.ran), first.cached) == (4, [])
    runs = expand(study)
    lost = [runs[1].run_id, runs[2].run_id]
    for run_id in lost:
        (out / "four" / "points" / f"{run_id}.json").unlink()
    (out / "four" / "results.parquet").unlink()
    second = run_study(study, out=out)
    assert sorted(second.ran) == sorted(lost)
    assert second.cached == [runs[0].run_id, runs[3].run_id]
    same_table(first.table, second.table)
    third = run_study(study, out=out)
    assert (third.ran, len(third.cached)) == ([], 4)
    assert len(run_study(study, out=out, force=True).ran) == 4


def test_a_crash_mid_sweep_keeps_finished_runs_and_resumes(study_file: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    study = load_study(study_file)
    runs = expand(study)
    real = runner.run_one

    def crash_on_third(run):  # type: ignore[no-untyped-def]
        if run.run_id == runs[2].run_id:
            raise RuntimeError("worker died")
        return real(run)

    monkeypatch.setattr(runner, "run_one", crash_on_third)
    with pytest.raises(RuntimeError, match="worker died"):
        run_study(study, out=out)
    done = sorted(p.stem for p in (out / "four" / "points").glob("*.json"))
    assert done == sorted([runs[0].run_id, runs[1].run_id])
    assert not (out / "four" / "results.parquet").exists()
    monkeypatch.setattr(runner, "run_one", real)
    resumed = run_study(study, out=out)
    assert resumed.ran == [runs[2].run_id, runs[3].run_id]
    assert len(resumed.table) == 4


def test_process_pool_gives_the_serial_table(study_file: Path) -> None:
    study = load_study(study_file)
    same_table(run_study(study).table, run_study(study, executor="local", workers=2).table)


def test_cli_sweep_runs_resumes_and_reports(study_file: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    args = ["sweep", str(study_file), "--out", str(out), "--workers", "1", "--scale", "0.5",
            "--min-requests", "10"]
    assert cli_main(args) == 0
    captured = capsys.readouterr()
    assert "four: 4 runs (4 ran, 0 cached)" in captured.err
    assert captured.out.splitlines()[0] == str(out / "four")
    table = pd.read_parquet(out / "four" / "results.parquet")
    assert table["num_requests"].tolist() == [20] * 4
    assert json.loads((out / "four" / "sweep.json").read_text())["command"] == (
        "fragsim sweep experiments/four.toml --scale 0.5 --min-requests 10")
    assert cli_main(args) == 0
    assert "(0 ran, 4 cached)" in capsys.readouterr().err


def test_cli_dry_run_lists_runs_and_errors_are_one_line(study_file: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["sweep", str(study_file), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "four: 4 runs"
    assert len(lines) == 5 and "rate=2.0" in lines[1]
    bad = tmp_path / "bad.toml"
    bad.write_text(STUDY.replace("rate = [2.0, 4.0]", "rate = []"))
    assert cli_main(["sweep", str(bad)]) == 2
    assert capsys.readouterr().err.strip() == (
        "fragsim: error: bad.toml: [sweep] rate: expected a non-empty list")


def test_ray_executor_runs_a_four_point_sweep(study_file: Path, tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="Ray is the optional `distributed` extra (pip install ray)")
    study = load_study(study_file)
    result = run_study(study, out=tmp_path / "out", executor="ray", workers=2)
    assert (len(result.ran), result.cached) == (4, [])
    same_table(result.table, run_study(study).table)


def test_ray_missing_is_a_clear_error(study_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "ray":
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(FragsimError, match=r"--executor ray needs Ray.*pip install 'fragsim\[distributed\]'"):
        run_study(load_study(study_file), executor="ray")
