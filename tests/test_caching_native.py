"""The native-replay comparison logic, on fake device snapshots (no CUDA needed);
the replay itself runs only where a CUDA device is present."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpu_backend.native_caching import (
    compare_replays,
    compare_states,
    first_difference,
    main,
    replay_model,
    replay_native,
)

MiB = 1 << 20
GiB = 1 << 30
OPS: list[tuple[Any, ...]] = [
    ("malloc", "a", 3 * MiB), ("malloc", "b", 3 * MiB), ("malloc", "c", 1000),
    ("free", "a"), ("malloc", "d", 25 * MiB),
]


def device_view(state: dict[str, Any], shift: int = 0x1_0000_0000) -> dict[str, Any]:
    """The same state as a device would report it: other addresses, the C++ state
    name for pending frees, extra keys."""
    out = copy.deepcopy(state)
    for seg in out["segments"]:
        seg["address"] += shift
        seg["frames"] = [{"filename": "x.py", "line": 1, "name": "f"}]
        for b in seg["blocks"]:
            b["address"] += shift
    out["ptrs"] = {k: v + shift for k, v in out["ptrs"].items()}
    return out


@pytest.fixture
def run() -> dict[str, Any]:
    return replay_model(OPS, GiB)


def test_replay_model_records_the_end_state(run: dict[str, Any]) -> None:
    end = run["states"][4]
    assert run["ooms"] == []
    assert set(end["ptrs"]) == {"b", "c", "d"}
    assert end["reserved_bytes"] == 20 * MiB + 2 * MiB + 26 * MiB
    assert sorted(s["total_size"] for s in end["segments"]) == [2 * MiB, 20 * MiB, 26 * MiB]


def test_identical_states_have_no_difference(run: dict[str, Any]) -> None:
    model = run["states"][4]
    assert compare_states(model, device_view(model)) == []


def test_every_kind_of_difference_is_reported(run: dict[str, Any]) -> None:
    model = run["states"][4]
    native = device_view(model)
    native["reserved_bytes"] += 2 * MiB
    # the device placed b at the start of its segment and left the hole after it
    large = next(s for s in native["segments"] if s["total_size"] == 20 * MiB)
    first, second, third = large["blocks"]
    second["address"], first["address"] = first["address"], first["address"] + 3 * MiB
    native["ptrs"]["b"] = second["address"]
    native["segments"].append({"address": 0x9000_0000_0000, "total_size": 2 * MiB, "segment_type": "small",
                               "blocks": [{"address": 0x9000_0000_0000, "size": 2 * MiB, "state": "inactive"}]})
    kinds = {d["kind"]: d for d in compare_states(model, native, op_index=4)}
    assert set(kinds) == {"reserved_bytes", "segments", "free_blocks", "placement"}
    assert kinds["placement"]["model"] == ["large", 20 * MiB, 3 * MiB, 3 * MiB]
    assert kinds["placement"]["native"] == ["large", 20 * MiB, 0, 3 * MiB]
    assert kinds["segments"]["native"] == [("small", 2 * MiB, False)] and kinds["segments"]["model"] == []
    assert kinds["reserved_bytes"]["op_index"] == 4


def _seg(addr: int, *blocks: tuple[int, str]) -> dict[str, Any]:
    out, offset = [], 0
    for size, state in blocks:
        out.append({"address": addr + offset, "size": size, "state": state})
        offset += size
    return {"address": addr, "total_size": offset, "segment_type": "large", "blocks": out}


def test_colocation_and_live_key_differences(run: dict[str, Any]) -> None:
    model = run["states"][4]
    native = device_view(model)
    del native["ptrs"]["c"]
    assert {d["kind"] for d in compare_states(model, native)} == {"live_keys"}
    # x and y share a segment in the model; on the device each has a segment of
    # the same size at the same offset: every placement agrees, the grouping not.
    a, b = 0x1000_0000, 0x2000_0000
    m_state = {"reserved_bytes": 40 * MiB, "allocated_bytes": 6 * MiB, "ptrs": {"x": a, "y": a + 3 * MiB},
               "segments": [_seg(a, (3 * MiB, "active_allocated"), (3 * MiB, "active_allocated"),
                                 (14 * MiB, "inactive")),
                            _seg(b, (3 * MiB, "inactive"), (17 * MiB, "inactive"))]}
    n_state = {"reserved_bytes": 40 * MiB, "allocated_bytes": 6 * MiB, "ptrs": {"x": a, "y": b + 3 * MiB},
               "segments": [_seg(a, (3 * MiB, "active_allocated"), (3 * MiB, "inactive"),
                                 (14 * MiB, "inactive")),
                            _seg(b, (3 * MiB, "inactive"), (3 * MiB, "active_allocated"),
                                 (14 * MiB, "inactive"))]}
    kinds = {d["kind"]: d for d in compare_states(m_state, n_state)}
    assert set(kinds) == {"colocation", "free_blocks"}
    assert (kinds["colocation"]["model"], kinds["colocation"]["native"]) == (1, 2)


def test_compare_replays_reports_oom_points(run: dict[str, Any]) -> None:
    native = {"ooms": [3], "states": {4: device_view(run["states"][4])}}
    (diff,) = compare_replays(run, native)
    assert (diff["kind"], diff["op_index"], diff["model"], diff["native"]) == ("ooms", 3, [], [3])


def test_replay_model_oom_and_free_of_failed_key() -> None:
    ops = [("malloc", 1, 30 * MiB), ("malloc", 2, 30 * MiB), ("free", 2), ("malloc", None, 1000)]
    r = replay_model(ops, 40 * MiB, check_every=2)
    assert r["ooms"] == [1]
    assert sorted(r["states"]) == [1, 3]
    assert len(r["states"][3]["ptrs"]) == 2  # key 1 and the anonymous malloc


@pytest.mark.parametrize("bad", [[("malloc", 1)], [("alloc", 1, 5)], [("free", 1, 2)], [("malloc", 1, 0)]])
def test_bad_ops(bad: list[tuple[Any, ...]]) -> None:
    with pytest.raises(ValueError, match="op 0"):
        replay_model(bad, GiB)


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.skipif(_cuda(), reason="checks the no-CUDA path")
def test_without_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        replay_native(OPS)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        first_difference(OPS, device_bytes=GiB)
    ops = tmp_path / "ops.json"
    ops.write_text(json.dumps(OPS))
    assert main(["--ops", str(ops), "--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_native_replay_matches_the_model(tmp_path: Path) -> None:
    """In a fresh process, so that no tensor of another test sits in the allocator."""
    ops = tmp_path / "ops.json"
    ops.write_text(json.dumps(OPS + [("free", "b"), ("free", "c"), ("free", "d")]))
    cmd = [sys.executable, "-m", "gpu_backend.native_caching", "--ops", str(ops), "--device-gb", "1",
           "--check-every", "1", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    report = json.loads((tmp_path / "native_caching.json").read_text())
    assert done.returncode == 0, report["differences"]
    assert report["ok"] and report["native_ooms"] == report["model_ooms"] == []
    workload = [sys.executable, "-m", "gpu_backend.native_caching", "--workload", "rag-longtail",
                "--hours", "0.01", "--out", str(tmp_path / "w")]
    assert subprocess.run(workload, capture_output=True, timeout=600).returncode in (0, 1)
    first = subprocess.run(cmd[:7] + ["--first-difference", "--out", str(tmp_path)], capture_output=True,
                           text=True, timeout=300)
    found = json.loads((tmp_path / "first_difference.json").read_text())
    assert first.returncode == 0 and found["first_difference"] is None, found
    assert (tmp_path / "w" / "native_caching.json").exists()
