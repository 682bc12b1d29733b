"""Reading PyTorch memory snapshots: both file shapes, both pending-free state
names, older versions, bad and hostile files, and ``fragsim snapshot``."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

from fragsim.caching.model import CachingAllocatorModel
from fragsim.caching.snapshot import analyze, load_snapshot
from fragsim.cli import main
from fragsim.errors import FragsimError

MiB = 1 << 20
BASE = 0x7F0000000000


def block(addr: int, size: int, state: str, requested: int | None = None) -> dict[str, Any]:
    b: dict[str, Any] = {"address": addr, "size": size, "state": state, "frames": []}
    if requested is not None:
        b["requested_size"] = requested
    return b


def segments() -> list[dict[str, Any]]:
    """Two segments, as torch.cuda.memory_snapshot() lists them::

        large, 20 MiB at BASE
        +------------------+-------------+------------------+---------------+
        | 4 MiB alloc      | 2 MiB free  | 3 MiB pending    | 11 MiB free   |
        | (requested 4M-1K)|             | (awaiting_free)  |               |
        +------------------+-------------+------------------+---------------+
        small, 2 MiB at BASE + 20 MiB
        +------+--------------------------------------+
        | 1 KiB| 2 MiB - 1 KiB free                   |
        | (req | (pending_free name, C++ binding)     |
        |  1000)                                      |
        +------+--------------------------------------+
    """
    large = [block(BASE, 4 * MiB, "active_allocated", 4 * MiB - 1024),
             block(BASE + 4 * MiB, 2 * MiB, "inactive", 0),
             block(BASE + 6 * MiB, 3 * MiB, "active_awaiting_free", 3 * MiB),
             block(BASE + 9 * MiB, 11 * MiB, "inactive", 0)]
    small_base = BASE + 20 * MiB
    small = [block(small_base, 1024, "active_allocated", 1000),
             block(small_base + 1024, 2 * MiB - 1024, "active_pending_free", 0)]
    return [
        {"device": 0, "address": BASE, "total_size": 20 * MiB, "allocated_size": 4 * MiB,
         "active_size": 7 * MiB, "requested_size": 7 * MiB - 1024, "stream": 0,
         "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
         "blocks": large},
        {"device": 0, "address": small_base, "total_size": 2 * MiB, "allocated_size": 1024,
         "active_size": 2 * MiB, "requested_size": 1000, "stream": 0, "segment_type": "small",
         "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": small},
    ]


def write(path: Path, obj: object) -> Path:
    path.write_bytes(pickle.dumps(obj))
    return path


EXPECTED = {
    "reserved_bytes": 22 * MiB,
    "allocated_bytes": 4 * MiB + 1024,
    "requested_bytes": 4 * MiB - 1024 + 1000,
    "internal_bytes": 1024 + 24,
    "pending_free_bytes": 3 * MiB + 2 * MiB - 1024,
    "external_bytes": 13 * MiB,
    "inactive_split_bytes": 13 * MiB,
    "releasable_bytes": 0,
    "largest_free_bytes": 11 * MiB,
    "num_segments": 2,
    "num_blocks": 6,
    "num_free_blocks": 2,
}


@pytest.mark.parametrize("shape", ["list", "dump"])
def test_both_file_shapes_give_the_exact_figures(tmp_path: Path, shape: str) -> None:
    segs = segments()
    obj = segs if shape == "list" else {
        "segments": segs, "device_traces": [[{"action": "alloc", "addr": BASE, "size": 4 * MiB},
                                              {"action": "oom", "size": 30 * MiB, "device_free": 0}]],
        "allocator_settings": {"expandable_segments": False}}
    s = analyze(load_snapshot(write(tmp_path / "s.pickle", obj)))
    for key, value in EXPECTED.items():
        assert getattr(s, key) == value, key
    assert s.fragmentation_ratio == pytest.approx(1 - 11 / 13)
    assert s.free_blocks_by_size == {"<1MiB": 0, "1-10MiB": 1, "10-50MiB": 1, "50-100MiB": 0, ">=100MiB": 0}
    assert s.requested_known
    assert s.num_oom_traces == (1 if shape == "dump" else 0)
    table = [(x.index, x.segment_type, x.inactive_bytes, x.largest_free_bytes) for x in s.segments]
    assert table == [(0, "large", 13 * MiB, 11 * MiB), (1, "small", 0, 0)]


def test_older_snapshots_without_requested_size_or_block_addresses() -> None:
    segs = segments()
    for seg in segs:
        for b in seg["blocks"]:
            del b["address"]
            b.pop("requested_size", None)
    segs[0]["blocks"][0]["history"] = [{"addr": BASE, "real_size": 4 * MiB - 100}]  # torch 2.0
    s = analyze(segs)
    assert not s.requested_known
    # block 0 recovered from history; the small allocated block counts as fully used
    assert (s.requested_bytes, s.internal_bytes) == (4 * MiB - 100 + 1024, 100)
    assert s.external_bytes == EXPECTED["external_bytes"]


def test_device_filter_and_whole_free_segments() -> None:
    segs = segments()
    segs.append({"device": 1, "address": BASE, "total_size": 4 * MiB, "segment_type": "large",
                 "blocks": [block(BASE, 4 * MiB, "inactive")]})
    assert analyze(segs, device=1).releasable_bytes == 4 * MiB
    assert analyze(segs, device=1).inactive_split_bytes == 0
    assert analyze(segs, device=0).reserved_bytes == 22 * MiB
    assert analyze(segs).reserved_bytes == 26 * MiB


def test_reads_the_models_own_snapshot(tmp_path: Path) -> None:
    m = CachingAllocatorModel(1 << 30)
    for n in (1000, 3 * MiB, 25 * MiB):
        m.malloc(n)
    s = analyze(load_snapshot(write(tmp_path / "m.pickle", m.snapshot())))
    stats = m.stats()
    assert (s.reserved_bytes, s.allocated_bytes, s.requested_bytes, s.external_bytes) == (
        stats["reserved_bytes"], stats["allocated_bytes"], stats["requested_bytes"], stats["inactive_bytes"])


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda s: s[1].pop("total_size"), "segment 1: missing key 'total_size'"),
    (lambda s: s[0]["blocks"][2].update(state="freed"), "segment 0 block 2: key 'state' must be one of"),
    (lambda s: s[0]["blocks"][1].update(size=-5), "segment 0 block 1: key 'size' must be an integer >= 0"),
    (lambda s: s[0].update(total_size=21 * MiB), "segment 0: blocks sum to 20971520 bytes but 'total_size' is"),
    (lambda s: s[1].update(blocks="none"), "segment 1: key 'blocks' must be a list"),
    (lambda s: s.append(7), "segment 2: expected a dict, got int"),
    (lambda s: s[0]["blocks"][0].update(requested_size=5 * MiB), "segment 0 block 0: requested_size"),
    (lambda s: s[0]["blocks"][3].update(address=BASE), "segment 0 block 3: address"),
])
def test_bad_structure_names_segment_and_key(tmp_path: Path, mutate: Any, message: str) -> None:
    segs = segments()
    mutate(segs)
    path = write(tmp_path / "bad.pickle", segs)
    with pytest.raises(FragsimError, match="^" + str(path).replace("\\", "\\\\") + ": " + message.replace("(", r"\(")):
        analyze(load_snapshot(path), source=f"{path}: ")


@pytest.mark.parametrize(("content", "message"), [
    (b"not a pickle at all", "not a pickle file"),
    (pickle.dumps(42), "expected a dict with 'segments' or a list of segments, got int"),
    (pickle.dumps({"device_traces": []}), "got \\['device_traces'\\]"),
    (pickle.dumps({"segments": 3}), "'segments' must be a list"),
    (b"", "not a pickle file"),
])
def test_bad_files(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "x.pickle"
    path.write_bytes(content)
    with pytest.raises(FragsimError, match=message):
        load_snapshot(path)
    with pytest.raises(FragsimError, match="cannot read"):
        load_snapshot(tmp_path / "missing.pickle")


class _Exploit:
    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (os.getpid, ())  # harmless stand-in for os.system


def test_hostile_pickle_is_refused_not_run(tmp_path: Path) -> None:
    path = write(tmp_path / "evil.pickle", {"segments": [_Exploit()]})
    with pytest.raises(FragsimError, match="refusing to load global (posix|nt|os).getpid"):
        load_snapshot(path)


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "s.pickle", {"segments": segments(), "device_traces": []})
    assert main(["snapshot", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key, value in EXPECTED.items():
        assert out[key] == value, key
    assert out["fragmentation_ratio"] == pytest.approx(2 / 13)
    assert out["segments"][0]["inactive_bytes"] == 13 * MiB and "blocks" not in out["segments"][0]


def test_cli_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "s.pickle", segments())
    png = tmp_path / "map.png"
    assert main(["snapshot", str(path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "fragmentation ratio (1 - largest free / free): 15.4%" in out
    assert "13,631,488" in out and "segment map written to" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x.pickle"
    path.write_bytes(b"garbage")
    assert main(["snapshot", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fragsim: error: ") and "not a pickle file" in err and err.count("\n") == 1
    good = write(tmp_path / "s.pickle", segments())
    assert main(["snapshot", str(good), "--plot", str(tmp_path / "no" / "dir.png")]) == 2
    assert "no directory" in capsys.readouterr().err
