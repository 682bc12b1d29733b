"""The engine with shared blocks: parallel samples, beams and prefix caching.

Hand-computed runs with every step's split, fast mode against exact mode for every
option, and prefix-cache hits on a Mooncake slice against an independent count
from its hash ids.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from oracles import dense_split_by_slot

from fragsim.allocators import SharedPagedAllocator, create
from fragsim.cli import main as cli_main
from fragsim.costmodel import FixedCostModel
from fragsim.engine import Engine, EngineConfig
from fragsim.engine_views import prefix_cache_stats
from fragsim.errors import FragsimError
from fragsim.simulate import RunSpec, load_workload, make_engine, simulate, summarize
from fragsim.traces import Trace, load_trace, slice_trace


def make_trace(arrival: list[float], prompt: list[int], output: list[int],
               hashes: list[tuple[int, ...]] | None = None, hash_size: int | None = None) -> Trace:
    return Trace("test", "test", np.array(arrival, dtype=float), np.array(prompt), np.array(output),
                 block_hashes=hashes, block_hash_size=hash_size)


def sharing_engine(trace: Trace, capacity: int, block_size: int = 4, **config: Any) -> Engine:
    """The engine over a forking paged allocator, its split checked slot by slot every step."""
    alloc = SharedPagedAllocator(capacity, block_size=block_size)
    alloc.log_copies = True
    engine = Engine(trace, alloc, FixedCostModel(0.1), EngineConfig(check=True, **config))
    engine.checks.append(dense_split_by_slot)
    return engine


def first_beam_wins(num_beams: int, width: int = 2) -> np.ndarray:
    """A stand-in for the token draw: the first beam of every group (lowest sequence id)
    is sure of its next two tokens; every other beam's best token is far less likely,
    so both survivors are always the first beam's."""
    log_p = np.tile([-5.0, -6.0], (num_beams, 1))
    log_p[::width] = [0.0, -0.1]
    return log_p


def test_two_samples_by_hand() -> None:
    """One request, prompt 6, output 3, two samples, blocks of 4, steps of 0.1 s.

    admission: seq 0 takes 7 slots (blocks 0 1); seq 1 forks the prompt's 6
    (blocks 0 1) and takes room for its first token: block 1 is shared and
    partly filled, so it is copied to block 2. Shared: block 0 (4 slots).

    step  seq 0 blocks / filled   seq 1 blocks / filled   tokens  reserv.  internal  physical
    0     0 1 / (prefill)         0 2 /                   0       12       0         12
    1     0 1 / 7                 0 2 / 7                 10      2        0         12
    2     0 1 3 / 8               0 2 4 / 8               12      2        6         20
    step 1: 14 filled − 4 shared; step 2: final 9 leaves 3 slots of each 12 internal.
    """
    engine = sharing_engine(make_trace([0.0], [6], [3]), 16 * 4, num_samples=2).run()
    means = engine.rec.means()
    assert engine.rec.span_s == pytest.approx(0.3)
    assert means["token_states"] == pytest.approx((0 + 10 + 12) / 3)
    assert means["reservation"] == pytest.approx((12 + 2 + 2) / 3)
    assert means["internal_fragmentation"] == pytest.approx(6 / 3)
    assert means["free"] == pytest.approx(64 - (12 + 12 + 20) / 3)
    assert engine.rec.mean_shared() == pytest.approx(4)
    assert engine.kv.alloc.take_copies() == [(1, 2)]
    np.testing.assert_allclose(engine.requests.first_token, [0.1])
    np.testing.assert_allclose(engine.requests.finish, [0.3])
    assert engine.kv.alloc.num_free() == 64


def test_beam_search_by_hand() -> None:
    """Prompt 6, output 4, width 2, blocks of 4; every step both survivors extend beam 0.

    step 0: as two samples (seq 0: blocks 0 1, seq 1: 0 2, copy 1 -> 2).
    step 1: seq 1 pruned (block 2 free); seq 2 forked from seq 0 over its 7 slots
            (0 1); seq 0 writes position 7 into shared block 1: copy to 3; seq 2
            keeps 1.                   tokens 14 − 4 = 10, physical 12, internal 0
    step 2: seq 2 pruned; seq 3 forked from seq 0 (0 3, both full); new blocks 4, 5.
                                       tokens 16 − 8 = 8, physical 16, internal 2 + 2
    step 3: seq 3 pruned; seq 4 forked from seq 0 (0 3 4); seq 0 copies block 4 to
            block 6 (the queue's head).  tokens 18 − 8 = 10, physical 16, internal 4
    """
    engine = sharing_engine(make_trace([0.0], [6], [4]), 16 * 4, beam_width=2)
    engine.beams.token_logprobs = first_beam_wins  # type: ignore[method-assign,union-attr]
    engine.run()
    means = engine.rec.means()
    assert engine.rec.span_s == pytest.approx(0.4)
    assert means["token_states"] == pytest.approx((0 + 10 + 8 + 10) / 4)
    assert means["internal_fragmentation"] == pytest.approx((0 + 0 + 4 + 4) / 4)
    assert means["reservation"] == pytest.approx((12 + 2 + 4 + 2) / 4)
    assert engine.rec.mean_shared() == pytest.approx((4 + 4 + 8 + 8) / 4)
    assert engine.kv.alloc.take_copies() == [(1, 2), (1, 3), (4, 6)]
    np.testing.assert_allclose(engine.requests.finish, [0.4])


def test_prefix_cache_hit_by_hand() -> None:
    """Two requests whose prompts share their first 8 tokens (one content hash of 8).

    A (t=0): prompt 10, nothing cached: prefill 10 tokens in blocks 0 1 2; blocks 0
    and 1 are full prompt blocks and get cached at the end of the step. A ends at
    t=0.2 and frees them (they stay cached). B (t=1): 2 of its (10 − 1) // 4 = 2
    lookup blocks hit; prefill starts at token 8: 2 tokens. Queries 20, hits 8.
    """
    trace = make_trace([0.0, 1.0], [10, 10], [2, 2], hashes=[(7,), (7,)], hash_size=8)
    engine = sharing_engine(trace, 16 * 4, prefix_caching=True).run()
    assert prefix_cache_stats(engine) == {"prefix_cache_queries": 20, "prefix_cache_hits": 8,
                                           "prefix_cache_hit_rate": 0.4}
    assert engine.num_prefill_tokens == 12
    np.testing.assert_allclose(engine.requests.finish, [0.2, 1.2])
    # different content: no hit
    trace = make_trace([0.0, 1.0], [10, 10], [2, 2], hashes=[(7,), (8,)], hash_size=8)
    assert sharing_engine(trace, 16 * 4, prefix_caching=True).run().num_prefix_hits == 0


def test_live_prefix_blocks_are_shared_and_counted_once() -> None:
    """B hits A's prompt blocks while A still decodes: one copy of them in the split."""
    trace = make_trace([0.0, 0.15], [16, 16], [20, 3], hashes=[(1,), (1,)], hash_size=16)
    engine = sharing_engine(trace, 32 * 4, prefix_caching=True).run()  # check=True: slot by slot
    assert engine.num_prefix_hits == 12  # (16 − 1) // 4 = 3 blocks
    assert engine.rec.peak_shared() == 12


def test_sharing_machinery_without_sharing_is_the_plain_engine() -> None:
    spec = RunSpec(trace="azure-conv", num_requests=150)
    trace = load_workload(spec)
    runs = []
    for alloc in (create("vllm", 3000), SharedPagedAllocator(3000)):
        engine = Engine(trace, alloc, FixedCostModel(0.02), EngineConfig(check=True)).run()
        assert engine.rec.counters.num_preemptions > 0
        runs.append((engine.rec.means(), engine.rec.counters.to_dict(), engine.requests.finish.tolist(),
                     engine.num_prefill_tokens))
    assert runs[0] == runs[1]


# --------------------------------------------------------------- fast == exact

CASES = [
    ("alpaca-paper", {"num_samples": 3, "rate": 30.0, "num_requests": 200, "kv_slots": 600}),
    ("alpaca-paper", {"num_samples": 2, "rate": 5.0, "num_requests": 150}),
    ("alpaca-paper", {"beam_width": 3, "rate": 30.0, "num_requests": 120, "kv_slots": 600}),
    ("azure-conv", {"prefix_caching": True, "system_prompt_len": 64, "num_requests": 150,
                    "kv_slots": 4000}),
    ("azure-conv", {"prefix_caching": True, "num_requests": 120, "kv_slots": 3000, "preemption": "swap",
                    "swap_space_gb": 1.0}),
    ("azure-conv", {"prefix_caching": True, "num_samples": 2, "system_prompt_len": 40,
                    "num_requests": 100, "kv_slots": 3000, "max_num_batched_tokens": 512,
                    "max_num_seqs": 64, "queue_timeout_s": 30.0}),
    ("azure-conv", {"prefix_caching": True, "beam_width": 2, "system_prompt_len": 40,
                    "num_requests": 50, "kv_slots": 3000, "max_num_batched_tokens": 512,
                    "max_num_seqs": 64}),
]


def assert_same_summary(fast: dict[str, Any], exact: dict[str, Any]) -> None:
    for key, value in exact.items():
        if key in ("wall_time_s", "num_events"):
            continue
        got = fast[key]
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(got), key
        elif isinstance(value, float):
            assert got == pytest.approx(value, rel=1e-9, abs=1e-9), key
        else:
            assert got == value, key


@pytest.mark.parametrize("trace_name,options", CASES)
def test_sharing_stretches_match_exact_steps(trace_name: str, options: dict[str, Any]) -> None:
    spec = RunSpec(trace=trace_name, **options)
    trace = load_workload(spec)
    engine = make_engine(trace, "vllm", spec, check=True)
    engine.checks.append(dense_split_by_slot)
    fast = summarize(engine.run(), "vllm", 0.0, engine.cfg.kv_bytes_per_token)
    exact = simulate(trace, "vllm", RunSpec(trace=trace_name, exact_steps=True, **options))
    assert_same_summary(fast[0], exact.summary)
    for column in ("first_token_s", "finish_s", "num_preemptions"):
        np.testing.assert_array_equal(fast[1][column], exact.requests[column], err_msg=column)
    if options.get("beam_width", 1) == 1:
        # stretches ran (beam search is the documented step-by-step fallback)
        assert fast[0]["num_events"] < exact.summary["num_events"]
    else:
        assert fast[0]["num_events"] == exact.summary["num_events"]


# ----------------------------------------------------------------- figures

def test_blocks_saved_grow_with_samples_and_beams() -> None:
    """The vLLM paper's Figure 15 (OPT-13B, Alpaca): sampling saves a little, beams a lot."""
    saved = {}
    for key, options in (("n2", {"num_samples": 2}), ("n4", {"num_samples": 4}),
                         ("w2", {"beam_width": 2}), ("w4", {"beam_width": 4})):
        spec = RunSpec(trace="alpaca-paper", rate=10.0, num_requests=300, **options)
        saved[key] = simulate(load_workload(spec), "vllm", spec).summary["blocks_saved_frac"]
    assert 0.03 < saved["n2"] < saved["n4"] < 0.2
    assert 0.25 < saved["w2"] < saved["w4"] < 0.7


#: vLLM paper §6.3 (Fig. 15), memory saved for n or w = 2 .. 6: lowest and highest
PAPER_FIG15 = {
    ("alpaca-paper", "num_samples"): (0.061, 0.098),
    ("alpaca-paper", "beam_width"): (0.376, 0.552),
    ("sharegpt-paper", "num_samples"): (0.162, 0.305),
    ("sharegpt-paper", "beam_width"): (0.443, 0.663),
}


@pytest.mark.parametrize("trace_name,option", sorted(PAPER_FIG15))
def test_blocks_saved_land_near_the_papers_ranges(trace_name: str, option: str) -> None:
    """The sharing study's setting on 300 requests (1,000 in the study): n or w = 2 and 6
    within 3.5 points of the paper's range. (The study itself: within 2.)"""
    low, high = PAPER_FIG15[(trace_name, option)]
    for width in (2, 6):
        spec = RunSpec(trace=trace_name, model="opt-13b", gpu="a100-40gb", num_requests=300,
                       rate=0.25, **{option: width})
        saved = simulate(load_workload(spec), "vllm", spec).summary["blocks_saved_frac"]
        assert low - 0.035 <= saved <= high + 0.035, (width, saved)


def test_next_token_draws_are_sorted_distributions_with_the_right_confidence() -> None:
    """Poisson–Dirichlet(θ) sticks: each beam's w best log-probabilities, best first, summing
    to at most 1. At θ = 1 the largest atom's mean is the Golomb–Dickman constant 0.6243;
    a smaller θ is a more confident model."""
    top = {}
    for theta in (0.03, 0.2, 1.0):
        engine = sharing_engine(make_trace([0.0], [4], [4]), 64, beam_width=4, beam_theta=theta)
        log_p = engine.beams.token_logprobs(40_000)  # type: ignore[union-attr]
        assert log_p.shape == (40_000, 4)
        assert bool(np.all(np.diff(log_p, axis=1) <= 0))
        assert bool(np.all(np.exp(log_p).sum(axis=1) <= 1 + 1e-12))
        top[theta] = np.exp(log_p[:, 0]).mean()
    assert top[1.0] == pytest.approx(0.62433, abs=0.005)
    assert top[1.0] < top[0.2] < top[0.03]


def test_beams_survive_by_score() -> None:
    """Prompt 6, output 2, width 2. The first token's choices score 0 (seq 0) and −1
    (seq 1); then beam 0's tokens score −2, −3 and beam 1's −0.1, −0.2, so the
    candidates are −2, −3 (beam 0) and −1.1, −1.2 (beam 1): both survivors are beam
    1's. Seq 0 is pruned and seq 1 forks seq 2 over its 7 positions."""
    engine = sharing_engine(make_trace([0.0], [6], [2]), 16 * 8, beam_width=2)
    engine.fork_log = []
    draws = iter([np.array([[0.0, -1.0]]), np.array([[-2.0, -3.0], [-0.1, -0.2]])])
    engine.beams.token_logprobs = lambda num_beams: next(draws)  # type: ignore[method-assign,union-attr]
    engine.run()
    assert engine.fork_log == [(0, 1, 6), (1, 2, 7)]
    assert engine.beams.scores == {}  # type: ignore[union-attr]  # every beam finished and was forgotten
    np.testing.assert_allclose(engine.requests.finish, [0.2])


def test_a_confident_model_shares_less() -> None:
    """Small θ: beams keep their own continuations, their histories part early."""
    saved = {}
    for theta in (0.01, 0.1, 1.0):
        spec = RunSpec(trace="alpaca-paper", rate=10.0, num_requests=150, beam_width=4, beam_theta=theta)
        saved[theta] = simulate(load_workload(spec), "vllm", spec).summary["blocks_saved_frac"]
    assert saved[0.01] < saved[0.1] < saved[1.0]


def test_beam_theta_comes_from_the_spec_else_the_workload() -> None:
    from fragsim.simulate import DEFAULT_BEAM_THETA, beam_theta

    assert beam_theta(RunSpec(trace="alpaca-paper")) == 0.2
    assert beam_theta(RunSpec(trace="sharegpt-paper")) == 0.03
    assert beam_theta(RunSpec(trace="azure-conv")) == DEFAULT_BEAM_THETA == 0.1
    assert beam_theta(RunSpec(trace="alpaca-paper", beam_theta=0.5)) == 0.5
    spec = RunSpec(trace="alpaca-paper", rate=10.0, num_requests=20, beam_width=2)
    assert simulate(load_workload(spec), "vllm", spec).summary["beam_theta"] == 0.2
    with pytest.raises(ValueError, match="beam_theta must be > 0, got 0"):
        EngineConfig(beam_width=2, beam_theta=0)


def test_prefix_caching_shortens_prefill_and_ttft() -> None:
    options = {"trace": "sharegpt-paper", "rate": 0.5, "num_requests": 200, "system_prompt_len": 512}
    off = simulate(load_workload(RunSpec(**options)), "vllm", RunSpec(**options)).summary
    spec = RunSpec(prefix_caching=True, **options)
    on = simulate(load_workload(spec), "vllm", spec).summary
    assert off["prefix_cache_queries"] == off["blocks_saved_frac"] == 0
    assert off["num_preemptions"] == on["num_preemptions"] == 0  # the same prompts admitted once
    assert on["prefix_cache_hit_rate"] > 0.5
    assert on["num_prefill_tokens"] == off["num_prefill_tokens"] - on["prefix_cache_hits"]
    assert on["mean_ttft_s"] < off["mean_ttft_s"]
    assert on["blocks_saved_frac"] > 0.2


def test_prefix_hits_on_mooncake_match_an_independent_count(shared_traces: Path) -> None:
    """Requests far apart, a pool that never evicts: each request hits exactly the leading
    engine blocks whose content (the hash ids up to the block's end, and its index) an
    earlier request's prompt already had."""
    raw = slice_trace(load_trace(shared_traces / "mooncake_conversation.jsonl"), num_requests=120)
    keep = np.flatnonzero(raw.prompt_len + raw.output_len <= 32768)[:60]
    hashes = [raw.block_hashes[i] for i in keep]
    trace = Trace("mooncake-slice", "test", np.arange(len(keep)) * 1000.0, raw.prompt_len[keep],
                  raw.output_len[keep], block_hashes=hashes, block_hash_size=raw.block_hash_size)
    B, H = 16, 512
    seen: set[tuple[tuple[int, ...], int]] = set()
    queries = hits = 0
    for h, prompt in zip(hashes, trace.prompt_len.tolist(), strict=True):
        blocks = [(tuple(h[: ((k + 1) * B - 1) // H + 1]), k) for k in range(prompt // B)]
        lookup = blocks[: (prompt - 1) // B]
        found = next((i for i, block in enumerate(lookup) if block not in seen), len(lookup))
        queries, hits = queries + prompt, hits + found * B
        seen.update(blocks)
    assert hits > 0
    alloc = SharedPagedAllocator(64 * 32768, block_size=B, max_seq_len=32768)
    config = EngineConfig(max_seq_len=32768, prefix_caching=True)
    engine = Engine(trace, alloc, FixedCostModel(0.01), config).run()
    assert (engine.num_prefix_queries, engine.num_prefix_hits) == (queries, hits)
    assert alloc.num_evictions == 0


# ----------------------------------------------------------------- CLI, errors

def test_cli_sharing_options_and_json_keys(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["run", "--allocator", "vllm", "--trace", "alpaca-paper", "--rate", "10", "--num-requests",
              "60", "--no-save", "--json"]
    assert cli_main(common) == 0
    off = json.loads(capsys.readouterr().out)
    assert (off["prefix_cache_queries"], off["prefix_cache_hits"], off["prefix_cache_hit_rate"],
            off["blocks_saved_frac"]) == (0, 0, 0.0, 0.0)
    assert cli_main([*common, "--parallel-samples", "3", "--prefix-caching", "--system-prompt-len",
                     "32"]) == 0
    on = json.loads(capsys.readouterr().out)
    assert on["blocks_saved_frac"] > 0 and on["prefix_cache_hits"] > 0
    assert on["prefix_cache_hit_rate"] == on["prefix_cache_hits"] / on["prefix_cache_queries"]
    assert cli_main([*common, "--beam-width", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["blocks_saved_frac"] > 0


def test_sharing_refuses_what_it_cannot_do(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(FragsimError, match="cannot share blocks"):
        spec = RunSpec(trace="azure-conv", num_requests=10, prefix_caching=True)
        simulate(load_workload(spec), "orca-oracle", spec)
    with pytest.raises(ValueError, match="parallel sampling or beam search"):
        EngineConfig(num_samples=2, beam_width=2)
    with pytest.raises(ValueError, match="continuous batching"):
        EngineConfig(num_samples=2, batching="static")
    with pytest.raises(ValueError, match="more than max_num_seqs"):
        EngineConfig(beam_width=8, max_num_seqs=4)
    with pytest.raises(ValueError, match="can fork"):
        Engine(make_trace([0.0], [4], [4]), create("vllm", 64), FixedCostModel(0.1),
               EngineConfig(num_samples=2))
    assert cli_main(["run", "--allocator", "vattention", "--num-requests", "10", "--prefix-caching",
                     "--no-save"]) == 2
    assert "cannot share blocks" in capsys.readouterr().err
