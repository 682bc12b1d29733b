"""A tier under vLLM's hybrid KV manager (fragsim.offload.groups): each group's chunks are
keyed apart, full attention is looked up from the GPU hit and a window from the hit's
end, a load brings each group what its blocks hold, the split holds at every step, and
what vLLM 0.33 does not offload is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from oracles import held_by_position_check, hybrid_split_by_position_check

from fragsim.errors import FragsimError
from fragsim.offload.groups import HIT, MISS, PENDING, TierGroup, hit_tokens
from fragsim.simulate import RunSpec, make_engine, simulate
from fragsim.traces import Trace
from fragsim.traces.sessions import SessionSpec, make_sessions

STEP = 0.02
PCIE = 64e9                  # the h100-80gb preset's host link, B/s
#: gpt-oss-20b: 12 sliding (128) and 12 full layers, 8 KV heads × 64 × 2 (K, V) × 2 bytes each
PAGE = 16 * 12 * 8 * 64 * 2 * 2   # one 16-token block of one group's 12 layers


def spec(**kw: object) -> RunSpec:
    base: dict[str, object] = dict(model="gpt-oss-20b", gpu="h100-80gb", max_seq_len=8192,
                                   cost_model="fixed", step_time_s=STEP, kv_offloading_size=1.0)
    base.update(kw)
    return RunSpec(**base)  # type: ignore[arg-type]


def states(held: str):  # noqa: ANN201
    """A state function from one string per group: H held, P being written, . missing."""
    rows = held.split()
    return lambda g, i: {"H": HIT, "P": PENDING, ".": MISS}[rows[g][i]]


FULL, SLIDING = TierGroup("full"), TierGroup("sliding", window=32)   # 2 chunks of 16


def test_full_attention_runs_from_the_gpu_hit_to_the_first_miss() -> None:
    assert hit_tokens((FULL,), 16, 0, 96, states("HHH.HH"))[0] == 48
    assert hit_tokens((FULL,), 16, 16, 96, states("HHH.HH"))[0] == 32      # from chunk 1
    assert hit_tokens((FULL,), 16, 16, 96, states("H.HHHH"))[0] == 0       # its first chunk misses


def test_a_window_takes_the_rightmost_run_of_its_chunks() -> None:
    # Chunks 0-5, a hit may end at 95 (a window stops a token short). The window needs
    # 2 chunks held at the end.
    assert hit_tokens((SLIDING,), 16, 0, 95, states("..HHHH"))[0] == 95
    assert hit_tokens((SLIDING,), 16, 0, 95, states("HHH..H"))[0] == 48    # chunks 1-2 end the run
    assert hit_tokens((SLIDING,), 16, 0, 95, states("H....H"))[0] == 16    # only the run from the start


def test_a_window_shortened_by_full_attention_is_looked_up_at_the_new_end() -> None:
    # Full attention holds chunks 0-2; the window must then hold chunks ending by 48.
    assert hit_tokens((FULL, SLIDING), 16, 0, 95, states("HHH... ..HHHH"))[0] == 0
    assert hit_tokens((FULL, SLIDING), 16, 0, 95, states("HHH... .HH.HH"))[0] == 48


def test_two_windows_converge() -> None:
    # The wide window (4 chunks) ends its run at chunk 5; the narrow one (2) at chunk 3,
    # so the wide one is asked again up to chunk 3, and finds chunks 0-3.
    wide = TierGroup("sliding", window=64)
    end, _ = hit_tokens((wide, SLIDING), 16, 0, 96, states("HHHHHH HHHH.."))
    assert end == 64


def test_a_chunk_being_written_defers_only_where_the_answer_rests_on_it() -> None:
    assert hit_tokens((FULL,), 16, 0, 64, states("HPHH"))[0] is None
    assert hit_tokens((SLIDING,), 16, 0, 63, states("P.HH"))[0] == 63       # left of the window's run


def test_a_hit_loads_each_group_what_it_holds_by_bytes_over_bandwidth() -> None:
    """gpt-oss-20b, one 1,024-token prompt twice: the first stores its 64 chunks in both
    groups; the second finds them all, and a window model stops a token short (1,023).
    Full attention loads every chunk, the sliding group those from its first placed
    block (the window of the last token: blocks 56-63)."""
    trace = Trace("twice", "test", np.array([0.0, 5.0]), np.array([1024, 1024]), np.array([1, 1]),
                  block_hashes=[(7, 8), (7, 8)], block_hash_size=512)
    engine = make_engine(trace, "vllm-hybrid", spec(), check=True)
    engine.run()
    tier = engine.connector.summary()[0]  # type: ignore[union-attr]
    assert tier["store_bytes"] == 128 * PAGE
    assert tier["store_time_s"] == pytest.approx(128 * PAGE / PCIE)
    loaded = (64 + 8) * PAGE
    assert tier["load_bytes"] == loaded and tier["hits_tokens"] == 1023
    assert tier["load_time_s"] == pytest.approx(loaded / PCIE)
    ttft = engine.requests.first_token - engine.requests.arrival
    assert ttft[1] == pytest.approx(loaded / PCIE + STEP)
    assert engine.num_prefill_tokens == 1024 + 1
    # The first request finished with its prefill; its KV stayed held until its stores
    # landed: 1,025 positions of full attention, the 127 a sliding layer still reads.
    held = (1025 + 127) * PAGE // 16
    assert engine.rec.peak_held() == held
    assert engine.rec.mean_held() * engine.rec.span_s == pytest.approx(held * 128 * PAGE / PCIE)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_the_split_holds_at_every_step_with_eviction_and_a_disk(policy: str) -> None:
    trace = make_sessions(SessionSpec(num_sessions=8, session_rate=3.0, system_prompt_len=700, seed=5)).trace
    run = spec(kv_offloading_size=0.05, kv_offloading_policy=policy, kv_offloading_disk_size=0.2,
               prefix_caching=True, max_num_seqs=8)
    s = simulate(trace, "vllm-hybrid", run, check=True).summary
    cpu, disk = s["tiers"]
    assert cpu["evicted_blocks"] > 0 and cpu["hits_tokens"] + disk["hits_tokens"] > 0
    assert s["external_prefix_cache_hits"] == cpu["hits_tokens"] + disk["hits_tokens"]
    for tier in (cpu, disk):
        assert sum(v for k, v in tier.items() if k.endswith("_frac")) == pytest.approx(1.0)


@pytest.mark.parametrize(("allocator", "kw", "named"), [
    ("jenga", {}, "vllm-hybrid"),
    ("vllm-hybrid", {"model": "nemotron-h-56b", "tp": 2}, "state layers"),
    ("vllm-hybrid", {"kv_offloading_backend": "lmcache"}, "native backend"),
])
def test_what_vllm_does_not_offload_is_refused_by_name(allocator: str, kw: dict, named: str) -> None:
    trace = Trace("one", "test", np.array([0.0]), np.array([100]), np.array([2]))
    with pytest.raises(FragsimError, match=named):
        simulate(trace, allocator, spec(**kw))


def test_blocks_held_for_stores_that_running_requests_share_are_theirs() -> None:
    """Prompts that share 1,024 tokens and stop at once, with steps shorter than their
    stores: finished requests are held for their stores while later ones run on the
    blocks they share. What is held for stores is what would go with the held ones,
    position by position at every step."""
    n = 40
    trace = Trace("shared", "test", np.arange(n) * 0.05, np.full(n, 1536), np.ones(n, dtype=np.int64),
                  block_hashes=[(1, 2, 3 + i) for i in range(n)], block_hash_size=512)
    engine = make_engine(trace, "vllm-hybrid", spec(prefix_caching=True, step_time_s=0.0005), check=True)
    engine.checks += [hybrid_split_by_position_check, held_by_position_check]
    engine.run()
    assert engine.rec.peak_held() > 0 and engine.num_prefix_hits > 0
