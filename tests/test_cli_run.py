"""`fragsim run` as a user runs it: JSON Lines, the results folder, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from fragsim.cli import main

JSON_KEYS = {
    "allocator", "num_requests", "num_finished", "num_refused", "num_preemptions",
    "num_blocked_fragmentation", "num_blocked_capacity", "capacity_slots",
    "mean_token_states_slots", "mean_reservation_slots", "mean_internal_fragmentation_slots",
    "mean_free_slots", "token_states_frac", "reservation_frac", "internal_fragmentation_frac",
    "free_frac", "mean_external_fragmentation_ratio", "peak_external_fragmentation_ratio",
    "mean_running", "peak_running", "throughput_tokens_per_s", "throughput_requests_per_s",
    "mean_ttft_s", "p99_ttft_s", "mean_tpot_s", "mean_normalized_latency_s", "sim_time_s",
    "wall_time_s",
}


def test_json_lines_one_object_per_allocator(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "--num-requests", "120", "--allocator", "vllm,orca-pow2,contiguous",
                 "--json", "--out", str(tmp_path), "--plot"])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["allocator"] for r in rows] == ["vllm", "orca-pow2", "contiguous"]
    for row in rows:
        assert JSON_KEYS <= row.keys()
        fracs = row["token_states_frac"] + row["reservation_frac"] \
            + row["internal_fragmentation_frac"] + row["free_frac"]
        assert fracs == pytest.approx(1.0, abs=1e-12)
        assert row["num_finished"] + row["num_refused"] == row["num_requests"] == 120
    (folder,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "summary.json", "memory_split.png", "memory_over_time.png",
            "address_map.png", "requests-vllm.parquet", "timeseries-vllm.parquet"} <= names
    config = json.loads((folder / "config.json").read_text())
    assert config["seed"] == 0 and config["allocators"] == ["vllm", "orca-pow2", "contiguous"]
    requests = pd.read_parquet(folder / "requests-vllm.parquet")
    assert len(requests) == 120 and {"ttft_s", "normalized_latency_s", "status"} <= set(requests.columns)


def test_table_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--num-requests", "60", "--allocator", "vllm,ft-static", "--no-save"]) == 0
    out = capsys.readouterr().out
    assert "token states" in out and "vllm" in out and "ft-static" in out


@pytest.mark.parametrize("argv,message", [
    (["--allocator", "magic"], "--allocator: unknown magic"),
    (["--max-num-batched-tokens", "8"], "max_num_batched_tokens (8) must be >= max_num_seqs"),
    (["--trace", "sharegpt-paper"], "needs --rate"),
    (["--model", "gpt-5"], "gpt-5"),
    (["--kv-slots", "3", "--allocator", "vllm"], "block"),
])
def test_bad_options_give_one_line_errors(argv: list[str], message: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "--num-requests", "10", "--no-save", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("fragsim: error:") and "\n" not in err
    assert message in err


def test_argparse_rejects_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", "--rate", "-1"])
    assert exc.value.code == 2
    assert "--rate: must be > 0" in capsys.readouterr().err


def _json_rows(out: str) -> list[dict]:
    rows = [json.loads(line) for line in out.strip().splitlines()]
    for row in rows:   # the host's time, not the model's
        row.pop("wall_time_s")
        row.pop("real_time_factor", None)
    return rows


def test_workers_run_allocators_in_parallel_with_the_same_results(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--num-requests", "150", "--allocator", "vllm,buddy,vllm,orca-pow2", "--json", "--no-save"]
    assert main(argv) == 0
    serial = _json_rows(capsys.readouterr().out)
    assert main([*argv, "--workers", "3"]) == 0
    parallel = _json_rows(capsys.readouterr().out)
    assert [r["allocator"] for r in parallel] == ["vllm", "buddy", "vllm", "orca-pow2"]
    assert parallel == serial


def test_workers_hybrid_managers_and_results_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", "gpt-oss-20b", "--gpu", "a100-80gb", "--max-seq-len", "4096",
                 "--num-requests", "120", "--allocator", "paged-uniform,jenga", "--workers", "2",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "paged-uniform" in out and "jenga" in out and "out of window" in out
    (folder,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert {"requests-paged-uniform.parquet", "requests-jenga.parquet"} <= {p.name for p in folder.iterdir()}


def test_a_failing_run_in_a_worker_gives_the_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "--num-requests", "10", "--no-save", "--kv-slots", "3", "--allocator", "vllm,buddy",
                 "--workers", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("fragsim: error:") and "\n" not in err and "block" in err


def test_overload_note_names_the_hybrid_managers_reason() -> None:
    from types import SimpleNamespace

    from fragsim.cli.run import overload_notes

    def summary(name: str, waiting: float) -> dict:
        return {"allocator": name, "mean_waiting": waiting, "mean_running": 50.0, "p99_ttft_s": 9.0 + waiting,
                "throughput_requests_per_s": 1.0 / (1.0 + waiting)}

    spec = SimpleNamespace(max_seq_len=8192)
    (hybrid,) = overload_notes([summary("paged-uniform", 400.0), summary("jenga", 10.0)], spec)
    assert hybrid.startswith("paged-uniform could not keep up") and "while jenga served" in hybrid
    assert "every layer's KV for every token" in hybrid and "reservation" not in hybrid
    (dense,) = overload_notes([summary("ft-static", 400.0), summary("vllm", 0.0)], spec)
    assert "max-length reservation is --max-seq-len, 8,192 tokens" in dense
    from fragsim.cli.run import HYBRID_WHY
    from fragsim.hybrid import MANAGERS

    assert set(HYBRID_WHY) == set(MANAGERS)   # every manager has its reason
    (gpu,) = overload_notes([summary("vllm-hybrid", 400.0), summary("jenga", 300.0)], spec)
    assert gpu.startswith("the trace offers more load than this GPU serves: vllm-hybrid's queue")


def test_default_allocators_follow_the_model_and_the_sharing() -> None:
    from fragsim.catalog import MODELS
    from fragsim.cli.run_options import DENSE_DEFAULT, HYBRID_DEFAULT, default_allocators
    from fragsim.simulate import RunSpec

    llama, oss = MODELS["llama-3.1-8b"], MODELS["gpt-oss-20b"]
    assert default_allocators(llama, RunSpec()) == (list(DENSE_DEFAULT), None)
    assert default_allocators(oss, RunSpec()) == (list(HYBRID_DEFAULT), None)
    kept, note = default_allocators(oss, RunSpec(prefix_caching=True))
    assert kept == ["vllm-hybrid"] and note is not None
    assert "prefix caching" in note and "leaving out jenga, static-partition, paged-uniform" in note
    kept, note = default_allocators(llama, RunSpec(num_samples=4))
    assert kept == ["vllm"] and "parallel sampling" in note and "ft-static" in note
    # beams are not modelled for the hybrid managers: the dense paged allocator runs
    kept, note = default_allocators(oss, RunSpec(beam_width=2))
    assert kept == ["vllm"] and "beam search" in note and "vllm-hybrid" in note


def test_a_hybrid_model_with_no_allocator_compares_the_hybrid_managers(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", "gpt-oss-20b", "--num-requests", "30", "--no-save", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["allocator"] for r in rows] == ["vllm-hybrid", "jenga", "static-partition", "paged-uniform"]


def test_prefix_caching_with_the_default_list_runs_what_can_share(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--num-requests", "30", "--no-save", "--json", "--prefix-caching",
                 "--system-prompt-len", "64"]) == 0
    captured = capsys.readouterr()
    assert [json.loads(line)["allocator"] for line in captured.out.splitlines()] == ["vllm"]
    assert "leaving out ft-static, orca-max, orca-pow2, orca-oracle" in captured.err
