"""Decode stores (``--no-kv-offloading-prompt-only``): the chunks generated tokens
complete go to the CPU tier at the end of the step that computed them; a session's
next turn finds them there; stretches stop at them; the lazy backend refuses."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fragsim.errors import FragsimError
from fragsim.prefix import PrefixKeys
from fragsim.simulate import RunSpec, make_engine, simulate
from fragsim.traces import Trace, load_trace
from fragsim.traces.loaders import save_mooncake
from fragsim.traces.sessions import SessionSpec, make_sessions

KV_BYTES = 131072            # llama-3.1-8b: 32 layers × 8 KV heads × 128 × 2 (K, V) × 2 bytes
PCIE = 32e9                  # the a100-40gb preset's host link, B/s
STEP = 0.02                  # fixed step time


def spec(**kw: object) -> RunSpec:
    base: dict[str, object] = dict(model="llama-3.1-8b", gpu="a100-40gb", max_seq_len=8192,
                                   cost_model="fixed", step_time_s=STEP, kv_offloading_size=1.0,
                                   kv_offloading_prompt_only=False)
    base.update(kw)
    return RunSpec(**base)  # type: ignore[arg-type]


def one(prompt: int, output: int) -> Trace:
    return Trace("one", "test", np.array([0.0]), np.array([prompt]), np.array([output]))


def stores(trace: Trace, run: RunSpec) -> tuple[Any, list[Any]]:
    """Run ``trace`` step by step checked; the engine and every transfer it started."""
    engine = make_engine(trace, "vllm", run, check=True)
    jobs: list[Any] = []
    start = engine.connector._start  # type: ignore[union-attr]

    def record(job: Any) -> None:
        jobs.append(job)
        start(job)

    engine.connector._start = record  # type: ignore[union-attr]
    engine.run()
    return engine, jobs


@pytest.mark.parametrize("exact", [True, False])
def test_a_decode_chunk_is_stored_at_the_end_of_the_step_that_completes_it(exact: bool) -> None:
    # Prompt 40, output 30, 16-token chunks. The prefill step ends at 0.02 s with the KV
    # of 40 tokens: chunks 0 and 1 go. Decode step j ends at 0.02 + 0.02 j with the KV of
    # 40 + j tokens: chunk 2 (KV 48) at j = 8, chunk 3 (KV 64) at j = 24. The request ends
    # with 70 tokens, KV of 69: chunk 4 is never full.
    engine, jobs = stores(one(40, 30), spec(exact_steps=exact))
    chunk_s = 16 * KV_BYTES / PCIE
    assert [(j.kind, j.tokens) for j in jobs] == [("store", 32), ("store", 16), ("store", 16)]
    assert [j.start for j in jobs] == pytest.approx([STEP, STEP + 8 * STEP, STEP + 24 * STEP])
    assert [j.end - j.start for j in jobs] == pytest.approx([2 * chunk_s, chunk_s, chunk_s])
    tier = engine.connector.summary()[0]
    assert tier["stored_blocks"] == 4 and tier["store_bytes"] == 64 * KV_BYTES
    assert engine.requests.finish[0] == pytest.approx(30 * STEP)


def test_with_prompt_only_the_output_is_not_stored() -> None:
    _, jobs = stores(one(40, 30), spec(kv_offloading_prompt_only=True))
    assert [(j.kind, j.tokens) for j in jobs] == [("store", 32)]


@pytest.mark.parametrize(("output", "last_stored"), [(25, True), (24, False)])
def test_the_chunk_the_last_step_completes_is_stored_and_held_for(output: int, last_stored: bool) -> None:
    # Output 25: the request ends with 65 tokens, KV of 64, so its last step completes
    # chunk 3, whose store keeps the request's blocks until it lands. Output 24: KV of 63
    # at the end; the chunk the last sampled token would complete is never stored (vLLM:
    # that token's slot is never committed). A later request keeps the run going.
    trace = Trace("two", "test", np.array([0.0, 1.0]), np.array([40, 8]), np.array([output, 1]))
    engine, jobs = stores(trace, spec())
    mine = [j for j in jobs if j.req == 0]
    assert [j.tokens for j in mine] == ([32, 16, 16] if last_stored else [32, 16])
    assert mine[-1].start == pytest.approx(output * STEP if last_stored else 9 * STEP)
    assert engine.requests.finish[0] == pytest.approx(output * STEP)
    held = engine.rec.mean_held() * engine.rec.span_s
    assert engine.rec.peak_held() == (40 + output if last_stored else 0)
    assert held == pytest.approx((40 + output) * 16 * KV_BYTES / PCIE if last_stored else 0.0)


def test_lmcache_stores_the_prompt_tail_then_the_whole_chunk_the_output_completes() -> None:
    # 256-token chunks, prompt 300: chunk 0 and the 44-token tail at the prompt's end; the
    # output fills chunk 1 (KV 512) at decode step 212 and it is stored as a whole chunk.
    engine, jobs = stores(one(300, 250), spec(kv_offloading_backend="lmcache"))
    assert [j.tokens for j in jobs] == [256 + 44, 256]
    assert jobs[1].start == pytest.approx(STEP + 212 * STEP)
    assert len(set(jobs[0].keys) | set(jobs[1].keys)) == 3
    assert engine.connector.summary()[0]["chunk_tail_frac"] > 0


def two_turns(prompt_1: int) -> Trace:
    """A session of two turns, 32-token content blocks: turn 1 asks ``prompt_1`` tokens
    and answers 30; turn 2 asks all of that and 10 more. Block 1 is partial in turn 1's
    prompt (id 2) and full in turn 2's (id 3); block 2 holds the end of turn 1's answer
    (id 4 in the conversation, partial 5 in turn 2's prompt)."""
    p2 = prompt_1 + 30 + 10
    return Trace("turns", "test", np.array([0.0, 5.0]), np.array([prompt_1, p2]), np.array([30, 5]),
                 block_hashes=[(1, 2), (1, 3, 5)], block_hash_size=32, session=np.array([0, 0]),
                 context_hashes=[(1, 3, 4), (1, 3, 4)])


@pytest.mark.parametrize(("prompt_1", "off", "on"), [
    (40, 32, 64),   # decode chunks 2 (tokens 32-48, 8 of them output) and 3 (48-64)
    (56, 32, 80),   # prompt chunk 2 lies in block 1, partial in turn 1's prompt: with decode
                    # stores keyed by the conversation, it and decode chunks 3, 4 hit too
])
def test_the_next_turn_finds_the_answer_in_the_tier(prompt_1: int, off: int, on: int) -> None:
    # No GPU prefix cache: everything past token 0 is looked up in the tier. Turn 1's
    # KV ends at prompt_1 + 29 tokens, so its chunks up to (prompt_1 + 29) // 16 are full.
    for prompt_only, hits in ((True, off), (False, on)):
        result = simulate(two_turns(prompt_1), "vllm", spec(kv_offloading_prompt_only=prompt_only), check=True)
        assert result.summary["external_prefix_cache_hits"] == hits, prompt_only


def test_a_turns_output_blocks_key_equal_to_the_next_turns_prompt_blocks() -> None:
    trace = make_sessions(SessionSpec(num_sessions=30, session_rate=2.0, system_prompt_len=700, seed=4)).trace
    assert trace.context_hashes is not None and trace.block_hashes is not None
    H = 512
    keys = PrefixKeys(trace, 16)
    prompt_ids = {h for row in trace.block_hashes for h in row}
    pairs = 0
    for s in set(trace.session.tolist()):  # type: ignore[union-attr]
        rows = np.flatnonzero(trace.session == s).tolist()
        for i, row in enumerate(rows):
            p, o = int(trace.prompt_len[row]), int(trace.output_len[row])
            ctx = trace.context_hashes[row]
            assert len(ctx) == -(-(p + o) // H) and ctx[: p // H] == trace.block_hashes[row][: p // H]
            if i + 1 == len(rows):
                assert not set(ctx[-(-p // H) + 1:]) & prompt_ids  # no later prompt has them
                continue
            nxt = rows[i + 1]
            p2 = int(trace.prompt_len[nxt])
            mine = keys.context_keys(row, p, p + o)
            theirs = keys.context_keys(nxt, p2, p2 + int(trace.output_len[nxt]))
            assert mine == theirs[: len(mine)]  # every full block of turn t, output included
            pairs += 1
    assert pairs > 20


@pytest.mark.parametrize(("backend", "disk", "policy"), [
    ("native", None, "lru"), ("native", 0.5, "arc"), ("lmcache", 0.5, "lru"),
])
def test_the_tier_split_holds_at_every_step_with_decode_stores(backend: str, disk: float | None,
                                                              policy: str) -> None:
    trace = make_sessions(SessionSpec(num_sessions=40, session_rate=6.0, system_prompt_len=700, seed=5)).trace
    base = dict(kv_slots=6000, kv_offloading_size=0.25, kv_offloading_policy=policy, prefix_caching=True,
                kv_offloading_backend=backend, kv_offloading_disk_size=disk,
                kv_offloading_block_size=64 if backend == "native" else None)
    s = simulate(trace, "vllm", spec(**base), check=True).summary
    prompt = simulate(trace, "vllm", spec(**base, kv_offloading_prompt_only=True), check=True).summary
    parts = ("cached_hit_later", "cached_never_hit", "write_pending", "read_pending", "chunk_tail",
             "swapped", "free")
    for tier in s["tiers"]:
        fracs = [tier[f"{p}_frac"] for p in parts]
        assert min(fracs) >= -1e-12 and math.fsum(fracs) == pytest.approx(1.0)
    gpu = ("token_states", "reservation", "internal_fragmentation", "free", "store_pending")
    assert math.fsum(s[f"{p}_frac"] for p in gpu) == pytest.approx(1.0)
    assert s["num_finished"] + s["num_refused"] == len(trace)
    assert s["tiers"][0]["store_bytes"] > prompt["tiers"][0]["store_bytes"]
    assert s["external_prefix_cache_hits"] > prompt["external_prefix_cache_hits"]


def test_stretches_and_single_steps_agree_with_decode_stores() -> None:
    trace = make_sessions(SessionSpec(num_sessions=30, session_rate=3.0, system_prompt_len=300, seed=2)).trace
    run = dict(prefix_caching=True, kv_offloading_size=0.5)
    fast = simulate(trace, "vllm", spec(**run)).summary
    exact = simulate(trace, "vllm", spec(**run, exact_steps=True)).summary
    for key in ("external_prefix_cache_hits", "num_prefill_tokens", "mean_ttft_s", "store_pending_frac",
                "token_states_frac", "free_frac"):
        assert fast[key] == pytest.approx(exact[key], rel=1e-9, abs=1e-12), key
    assert fast["tiers"][0]["stored_blocks"] == exact["tiers"][0]["stored_blocks"]


def test_the_lazy_backend_refuses_decode_stores_by_name() -> None:
    with pytest.raises(FragsimError, match="--no-kv-offloading-prompt-only.*lazy backend has none"):
        make_engine(one(40, 30), "vllm", spec(kv_offloading_backend="lazy", prefix_caching=True))


def test_a_session_file_keeps_its_conversation_ids(tmp_path: Path) -> None:
    """``fragsim trace sessions`` writes each turn's conversation ids beside its hash ids,
    so a session trace read back from its file finds the answers in the tier as the
    generated one does; a record without them, where others have them, is named."""
    trace = make_sessions(SessionSpec(num_sessions=12, session_rate=2.0, system_prompt_len=700, seed=4)).trace
    path = tmp_path / "sessions.jsonl"
    save_mooncake(trace, path)
    back = load_trace(path)
    assert back.context_hashes == trace.context_hashes
    run = spec(kv_offloading_prompt_only=False)
    assert simulate(back, "vllm", run).summary["external_prefix_cache_hits"] == \
        simulate(trace, "vllm", run).summary["external_prefix_cache_hits"] > 0
    lines = path.read_text().splitlines()
    record = json.loads(lines[3])
    del record["context_hash_ids"]
    lines[3] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(FragsimError, match="line 4: field 'context_hash_ids': missing"):
        load_trace(path)
