"""Per-request session ids: validated on the trace, read and written by the loaders,
kept aligned by every transform."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fragsim.cli import main as cli_main
from fragsim.errors import FragsimError
from fragsim.prefix import with_system_prompt
from fragsim.traces import Trace, assign_arrivals, load_trace, save_trace, scale_load, slice_trace
from fragsim.traces.loaders import save_mooncake
from fragsim.traces.sessions import SessionSpec, make_sessions


def make_trace(session: list[int] | None, hashes: bool = False) -> Trace:
    n = 5 if session is None else len(session)
    return Trace("t", "test", np.arange(n, dtype=float), np.arange(1, n + 1) * 100, np.full(n, 3),
                 block_hashes=[(i,) for i in range(n)] if hashes else None,
                 block_hash_size=512 if hashes else None, session=session)  # type: ignore[arg-type]


def test_session_is_a_frozen_int64_column() -> None:
    trace = make_trace([4, 0, 4, 2, 9])
    assert trace.session is not None
    assert trace.session.dtype == np.int64
    assert trace.session.tolist() == [4, 0, 4, 2, 9]
    with pytest.raises(ValueError, match="read-only"):
        trace.session[0] = 1
    assert make_trace(None).session is None


@pytest.mark.parametrize(
    ("session", "match"),
    [
        ([0, 1], "one id per row"),
        ([[0, 1, 2]], "one id per row"),
        ([0, 1, -1], ">= 0"),
        ([0.0, 1.5, 2.0], "integers"),
    ],
)
def test_trace_rejects_bad_session_ids(session: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Trace("t", "test", np.zeros(3), np.ones(3), np.ones(3), session=np.array(session))


def test_positional_construction_still_works() -> None:
    trace = Trace("t", "test", np.zeros(2), np.array([1, 2]), np.array([1, 1]), None, None, False)
    assert trace.session is None
    assert not trace.has_timestamps


def test_to_frame_adds_session_id_only_when_present() -> None:
    assert list(make_trace(None).to_frame().columns) == ["arrival_time_s", "prompt_len", "output_len"]
    frame = make_trace([7, 7, 1, 0, 1]).to_frame()
    assert list(frame.columns) == ["arrival_time_s", "prompt_len", "output_len", "session_id"]
    assert frame["session_id"].tolist() == [7, 7, 1, 0, 1]


# --- files ---------------------------------------------------------------------------------


def test_mooncake_round_trip_keeps_the_sessions(tmp_path: Path) -> None:
    trace = make_trace([3, 1, 3, 2**40, 0], hashes=True)
    path = tmp_path / "t.jsonl"
    save_mooncake(trace, path, {"turn": [0, 0, 1, 0, 0]})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["session"] for r in records] == [3, 1, 3, 2**40, 0]
    assert [r["turn"] for r in records] == [0, 0, 1, 0, 0]
    loaded = load_trace(path)
    assert loaded.session is not None
    assert loaded.session.tolist() == [3, 1, 3, 2**40, 0]
    assert loaded.block_hashes == trace.block_hashes


def test_plain_csv_round_trip_keeps_the_sessions(tmp_path: Path) -> None:
    trace = make_trace([5, 5, 0, 2, 1], hashes=True)
    path = tmp_path / "t.csv"
    save_trace(trace, path)
    assert path.read_text().splitlines()[:2] == [
        "arrival_time_s,prompt_len,output_len,block_hashes,session_id",
        "0.0,100,3,0,5",
    ]
    loaded = load_trace(path)
    assert loaded.session is not None
    assert loaded.session.tolist() == [5, 5, 0, 2, 1]


def test_files_without_sessions_load_none_and_save_no_column(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    save_trace(make_trace(None), path)
    assert path.read_text().splitlines()[0] == "arrival_time_s,prompt_len,output_len"
    assert load_trace(path).session is None
    save_mooncake(make_trace(None), tmp_path / "t.jsonl")
    assert "session" not in json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])
    assert load_trace(tmp_path / "t.jsonl").session is None


def test_extra_fields_may_not_clash_with_the_session(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'session'"):
        save_mooncake(make_trace([0, 1, 2, 3, 4]), tmp_path / "t.jsonl", {"session": [0] * 5})


def record(stamp: int, **extra: object) -> str:
    return json.dumps({"timestamp": stamp, "input_length": 10, "output_length": 2, **extra}) + "\n"


@pytest.mark.parametrize("key", ["session", "session_id", "conversation_id", "chat_id"])
def test_each_session_key_is_read(tmp_path: Path, key: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(record(0, **{key: 8}) + record(1000, **{key: 2}))
    loaded = load_trace(path)
    assert loaded.session is not None
    assert loaded.session.tolist() == [8, 2]


def test_the_first_session_key_in_order_wins(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(record(0, chat_id=1, session_id=10) + record(1000, chat_id=2, session_id=20))
    loaded = load_trace(path)
    assert loaded.session is not None
    assert loaded.session.tolist() == [10, 20]


def test_csv_session_column_is_read_and_sorted_with_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "v.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens,session\n"
                    "2.0,10,1,7\n0.0,20,1,4\n1.0,30,1,5\n")
    with pytest.warns(UserWarning, match="sorted"):
        loaded = load_trace(path)
    assert loaded.prompt_len.tolist() == [20, 30, 10]
    assert loaded.session is not None
    assert loaded.session.tolist() == [4, 5, 7]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (record(0, session=1) + record(1, session=-2),
         "t.jsonl: line 2: field 'session': expected a non-negative integer, got '-2'"),
        (record(0, chat_id=1) + "\n" + record(1, chat_id="4"),
         "t.jsonl: line 3: field 'chat_id': expected a non-negative integer, got '\"4\"'"),
        (record(0, session_id=1) + record(1, session_id=1.5),
         "t.jsonl: line 2: field 'session_id': expected a non-negative integer, got '1.5'"),
        (record(0, session=True) + record(1, session=1),
         "t.jsonl: line 1: field 'session': expected a non-negative integer, got 'true'"),
        (record(0) + record(1, conversation_id=3),
         "t.jsonl: line 1: field 'conversation_id': missing (line 2 has it; "
         "a session id goes on every record or on none)"),
    ],
)
def test_bad_jsonl_session_names_the_line_and_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    with pytest.raises(FragsimError) as caught:
        load_trace(path)
    assert str(caught.value) == f"{tmp_path / 't.jsonl'}: {message.split(': ', 1)[1]}"


def test_bad_csv_session_names_the_row_and_field(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("arrival_time_s,prompt_len,output_len,session_id\n0,1,1,0\n1,1,1,x\n")
    with pytest.raises(FragsimError) as caught:
        load_trace(path)
    assert str(caught.value) == f"{path}: row 2: field 'session_id': expected a non-negative integer, got 'x'"


# --- transforms ----------------------------------------------------------------------------


def test_load_scale_keeps_sessions_distinct_across_copies() -> None:
    trace = make_trace([0, 1, 0, 2, 1])
    scaled = scale_load(trace, 3, seed=1)
    assert scaled.session is not None
    # Copy j adds j * 3 (largest id 2, plus 1); each copy keeps its own rows' pairing.
    assert sorted(scaled.session.tolist()) == sorted([0, 1, 0, 2, 1, 3, 4, 3, 5, 4, 6, 7, 6, 8, 7])
    pairs = sorted(zip(scaled.session.tolist(), scaled.prompt_len.tolist(), strict=True))
    assert pairs == sorted((s + 3 * j, p) for j in range(3)
                           for s, p in zip([0, 1, 0, 2, 1], [100, 200, 300, 400, 500], strict=True))


def test_load_scale_renumbers_ids_too_large_to_shift() -> None:
    big = 2**62
    scaled = scale_load(make_trace([big, 5, big, 5, 9]), 3, seed=0)
    assert scaled.session is not None
    # Renumbered 5 -> 0, 9 -> 1, 2**62 -> 2, then shifted by 3 per copy.
    assert sorted(set(scaled.session.tolist())) == list(range(9))
    pairs = sorted(zip(scaled.session.tolist(), scaled.prompt_len.tolist(), strict=True))
    assert pairs[:5] == [(0, 200), (0, 400), (1, 500), (2, 100), (2, 300)]


def test_slicing_keeps_sessions_aligned_with_rows() -> None:
    trace = make_trace([10, 11, 12, 13, 14])
    head = slice_trace(trace, num_requests=3)
    assert head.session is not None
    assert head.session.tolist() == [10, 11, 12]
    window = slice_trace(trace, start_s=1.0, end_s=4.0, offset=1)
    assert window.session is not None
    assert window.prompt_len.tolist() == [300, 400]
    assert window.session.tolist() == [12, 13]


def test_other_transforms_carry_the_sessions() -> None:
    trace = make_trace([3, 2, 1, 0, 4])
    for derived in (assign_arrivals(trace, 2.0, seed=1), with_system_prompt(trace, 64)):
        assert derived.session is not None
        assert derived.session.tolist() == [3, 2, 1, 0, 4]


# --- session traces ------------------------------------------------------------------------


def test_make_sessions_puts_its_session_column_on_the_trace() -> None:
    sessions = make_sessions(SessionSpec(30, 2.0, turns_mean=4, seed=5))
    assert sessions.trace.session is not None
    assert np.array_equal(sessions.trace.session, sessions.session)
    # Rows are sorted by arrival, so a session's turns interleave with others'.
    assert len(set(sessions.session.tolist())) == 30
    assert not np.all(np.diff(sessions.session) >= 0)


def test_trace_sessions_cli_writes_each_session_once_and_loads_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s.jsonl"
    assert cli_main(["trace", "sessions", str(out), "--num-sessions", "12", "--seed", "2"]) == 0
    capsys.readouterr()
    lines = out.read_text().splitlines()
    assert all(line.count('"session"') == 1 for line in lines)
    expected = make_sessions(SessionSpec(12, 1.0, seed=2))
    loaded = load_trace(out)
    assert loaded.session is not None
    assert loaded.session.tolist() == expected.session.tolist()
