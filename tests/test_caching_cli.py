"""``fragsim caching`` end to end, on short simulated runs."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from fragsim.caching.workloads import WORKLOADS
from fragsim.cli import main
from fragsim.cli.caching import WORKLOAD_NAMES


def test_workload_choices_match_the_presets() -> None:
    assert WORKLOAD_NAMES == tuple(sorted(WORKLOADS))


def test_summary_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["caching", "--hours", "0.02"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rag-longtail: llama-2-13b on 31.5 GiB, 0.02 h simulated, seed 0")
    assert "OOMs: 1, of which 1 with total free memory >= the request" in out
    assert "first such OOM at 29.3 s (r41:probs32): needed 372.3 MiB with 406.6 MiB free, " \
           "largest free block 10.0 MiB" in out
    assert "fragmentation ratio: peak" in out


def test_json_plot_and_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png, out_dir = tmp_path / "f.png", tmp_path / "run"
    assert main(["caching", "--hours", "0.02", "--json", "--plot", str(png), "--out", str(out_dir),
                 "--max-split-size-mb", "128"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["max_split_size_mb"] == 128 and summary["workload"] == "rag-longtail"
    assert {"num_ooms", "num_ooms_enough_total_free", "peak_fragmentation_ratio",
            "time_above_danger_s", "first_enough_free_oom"} <= set(summary)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "config.json", "fragmentation.png", "ooms.csv", "summary.json", "timeseries.csv"]
    assert json.loads((out_dir / "summary.json").read_text()) == summary
    config = json.loads((out_dir / "config.json").read_text())
    assert (config["max_split_size_mb"], config["seed"], config["fragsim_version"]) == (128, 0, "0.1.0")
    ts = pd.read_csv(out_dir / "timeseries.csv")
    assert len(ts) > 10 and "fragmentation_ratio" in ts


@pytest.mark.parametrize(("argv", "message"), [
    (["--device-gb", "4"], "too small for the weights"),
    (["--max-split-size-mb", "8"], '"max_split_size_mb" must be None or an integer >= 20'),
    (["--hours", "-1"], '"hours" must be > 0'),
    (["--model", "gpt-9"], "unknown model 'gpt-9'"),
])
def test_bad_options(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["caching", "--hours", "0.01", *argv]) == 2  # a later --hours wins
    err = capsys.readouterr().err
    assert err.startswith("fragsim: error: ") and message in err
