"""Multi-turn session traces: growing prompts, shared prefixes, seeded draws, the CLI."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from fragsim.cli import main as cli_main
from fragsim.errors import FragsimError
from fragsim.traces import load_trace
from fragsim.traces.sessions import SessionSpec, make_sessions

FIXTURES = Path(__file__).parent / "fixtures" / "traces"


def by_session(spec: SessionSpec) -> dict[int, list[tuple[float, int, int, tuple[int, ...]]]]:
    s = make_sessions(spec)
    t = s.trace
    assert t.block_hashes is not None
    out: dict[int, list] = {}
    for i in np.lexsort((s.turn, s.session)).tolist():
        out.setdefault(int(s.session[i]), []).append(
            (float(t.arrival_s[i]), int(t.prompt_len[i]), int(t.output_len[i]), t.block_hashes[i]))
    return out


def test_each_turn_carries_the_whole_conversation() -> None:
    sessions = by_session(SessionSpec(40, 2.0, turns_mean=5, system_prompt_len=700, seed=3))
    assert max(len(turns) for turns in sessions.values()) > 3
    for turns in sessions.values():
        for (t0, p0, o0, h0), (t1, p1, _o1, h1) in itertools.pairwise(turns):
            assert t1 >= t0
            assert p1 > p0 + o0  # the earlier prompt, its answer, and a new message
            full = p0 // 512
            assert h1[:full] == h0[:full]  # full blocks keep their ids in later turns
            if p0 % 512:
                assert h0[full] not in h1  # the partial block was never seen again
        for _, p, _, h in turns:
            assert len(h) == -(-p // 512)
    firsts = [turns[0][3][0] for turns in sessions.values()]
    assert set(firsts) == {0}  # the system prompt's first 512 tokens, shared by all
    seconds = [turns[0][3][1] for turns in sessions.values()]
    assert len(set(seconds)) == len(seconds)  # tokens 512-1023 mix system and message: own ids


def test_seeded_and_sorted() -> None:
    a = make_sessions(SessionSpec(30, 1.0, seed=5)).trace
    b = make_sessions(SessionSpec(30, 1.0, seed=5)).trace
    c = make_sessions(SessionSpec(30, 1.0, seed=6)).trace
    assert np.array_equal(a.prompt_len, b.prompt_len) and a.block_hashes == b.block_hashes
    assert not np.array_equal(a.prompt_len[:20], c.prompt_len[:20])
    assert np.all(np.diff(a.arrival_s) >= 0) and a.arrival_s[0] == 0


def test_max_len_ends_sessions_and_lengths_from_a_file() -> None:
    spec = SessionSpec(50, 1.0, turns_mean=8, max_len=1500, lengths=str(FIXTURES / "lengths_small.csv"))
    trace = make_sessions(spec).trace
    assert int((trace.prompt_len + trace.output_len).max()) <= 1500
    source = load_trace(str(FIXTURES / "lengths_small.csv"))
    first_turns = make_sessions(SessionSpec(50, 1.0, turns_mean=1, lengths=spec.lengths)).trace
    assert set(first_turns.output_len.tolist()) <= set(source.output_len.tolist())


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (SessionSpec(0, 1.0), "num_sessions must be >= 1"),
        (SessionSpec(2, 0.0), "session_rate must be > 0"),
        (SessionSpec(2, 1.0, turns_mean=0.5), "turns_mean must be >= 1"),
        (SessionSpec(2, 1.0, lengths="nope"), "no such file"),
        (SessionSpec(2, 1.0, max_len=2, system_prompt_len=5), "no turn fits"),
    ],
)
def test_bad_specs(spec: SessionSpec, message: str) -> None:
    with pytest.raises(FragsimError, match=message):
        make_sessions(spec)


def test_cli_writes_a_trace_every_command_reads(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.jsonl"
    assert cli_main(["trace", "sessions", str(out), "--num-sessions", "20", "--session-rate", "3",
                     "--system-prompt-len", "600", "--seed", "2"]) == 0
    assert "prefix seen before" in capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {"timestamp", "input_length", "output_length", "hash_ids", "session", "turn"} <= set(records[0])
    trace = load_trace(str(out))
    assert len(trace) == len(records) and trace.block_hash_size == 512
    assert cli_main(["trace", "hits", str(out), "--capacity-tokens", "1e5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["hit_blocks"] > 0
    with pytest.raises(SystemExit):
        cli_main(["trace", "sessions", str(out), "--think-time", "-1"])
    assert "must be >= 0" in capsys.readouterr().err
