"""``fragsim trace stats`` through ``fragsim.cli.main``, as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fragsim.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "traces"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["trace", "stats", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)  # the whole of stdout is one object


def test_json_for_a_bundled_trace(capsys: pytest.CaptureFixture[str]) -> None:
    stats = run_json(capsys, "azure-code")
    assert stats["num_requests"] == 8_819
    assert stats["rate_req_per_s"] == pytest.approx(2.57, abs=0.005)
    assert round(stats["interarrival_cv"]) == 13
    assert stats["output_len_p99"] == pytest.approx(251.46)
    for key in ("duration_s", "prompt_len_mean", "prompt_len_p50", "prompt_len_p90",
                "prompt_len_p99", "prompt_len_max", "output_len_mean", "output_len_max",
                "num_block_refs", "num_distinct_blocks"):  # fmt: skip
        assert key in stats


def test_table_is_readable(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "azure-conv")
    assert code == 0
    for text in (
        "requests",
        "19,366",
        "3,501.7 s",
        "5.53 req/s",
        "inter-arrival CV",
        "1,154.7",
        "14,050",
    ):
        assert text in out


def test_block_figures_for_a_mooncake_file(capsys: pytest.CaptureFixture[str]) -> None:
    stats = run_json(capsys, str(FIXTURES / "mooncake_small.jsonl"))
    assert (stats["num_block_refs"], stats["num_distinct_blocks"]) == (6, 3)
    code, out, _ = run(capsys, str(FIXTURES / "mooncake_small.jsonl"))
    assert "distinct blocks" in out


def test_length_only_reports_no_rate_unless_given_one(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(FIXTURES / "lengths_small.csv")
    stats = run_json(capsys, path)
    assert stats["rate_req_per_s"] is None and stats["interarrival_cv"] is None
    assert stats["has_timestamps"] is False
    code, out, _ = run(capsys, path)
    assert "--rate" in out
    timed = run_json(capsys, path, "--rate", "2", "--arrival", "gamma", "--cv", "2", "--seed", "1")
    assert timed["has_timestamps"] is True and timed["rate_req_per_s"] > 0


def test_workload_with_rate(capsys: pytest.CaptureFixture[str]) -> None:
    stats = run_json(capsys, "sharegpt-paper", "--num-requests", "5000", "--rate", "8")
    assert stats["num_requests"] == 5000
    assert stats["rate_req_per_s"] == pytest.approx(8.0, rel=0.05)
    assert stats["prompt_len_mean"] == pytest.approx(161.31, rel=0.05)


def test_num_requests_keeps_the_first_rows_of_a_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_json(capsys, "azure-conv", "--num-requests", "100")["num_requests"] == 100


def test_plot_writes_a_png_atomically(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "azure.png"
    code, out, _ = run(capsys, str(FIXTURES / "azure_small.csv"), "--plot", str(target))
    assert code == 0 and f"wrote {target}" in out
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["azure.png"]
    lengths = tmp_path / "lengths.png"
    assert run(capsys, str(FIXTURES / "lengths_small.csv"), "--plot", str(lengths))[0] == 0
    assert lengths.stat().st_size > 0


def test_bad_file_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("num_prefill_tokens,num_decode_tokens\n3,4\n5,-1\n")
    code, out, err = run(capsys, str(bad), "--json")
    assert code == 2 and out == ""
    assert err == (
        f"fragsim: error: {bad}: row 2: field 'num_decode_tokens': "
        "expected a positive integer, got '-1'\n"
    )


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["no/such/file.csv"], "no such file"),
        (["azure-code", "--cv", "2"], "need --rate"),
        (["azure-code", "--seed", "2"], "needs --rate"),
        (["azure-code", "--rate", "2", "--cv", "2"], "applies to gamma arrivals only"),
        (["azure-code", "--rate", "-1"], "rate must be a positive number"),
        (["azure-code", "--num-requests", "0"], "--num-requests must be >= 1"),
        (["azure-code", "--plot", "no/such/dir/x.png"], "cannot write the plot"),
    ],
)
def test_bad_options_exit_2(
    argv: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and match in err


def test_unsorted_warning_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "u.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n2,1,1\n1,1,1\n")
    code, out, err = run(capsys, str(path), "--json")
    assert code == 0 and json.loads(out)["duration_s"] == 1.0
    assert err.startswith(f"fragsim: warning: {path}: 1 of 2 rows arrive earlier")
    assert err.count("\n") == 1


def test_trace_without_subcommand_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace"]) == 0
    assert "stats" in capsys.readouterr().out
