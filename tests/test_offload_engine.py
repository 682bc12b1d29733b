"""A CPU tier in the engine (fragsim.offload.connector): load and store times by hand,
blocks held for pending stores, lookups after the GPU hit, the tier split at every
step, and refusals by name."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fragsim.errors import FragsimError
from fragsim.simulate import RunSpec, make_engine, simulate
from fragsim.traces import Trace
from fragsim.traces.sessions import SessionSpec, make_sessions

KV_BYTES = 131072            # llama-3.1-8b: 32 layers × 8 KV heads × 128 × 2 (K, V) × 2 bytes
PCIE = 32e9                  # the a100-40gb preset's host link, B/s
STEP = 0.02                  # fixed step time


def spec(**kw: object) -> RunSpec:
    base: dict[str, object] = dict(model="llama-3.1-8b", gpu="a100-40gb", max_seq_len=8192,
                                   cost_model="fixed", step_time_s=STEP, kv_offloading_size=1.0)
    base.update(kw)
    return RunSpec(**base)  # type: ignore[arg-type]


def same_prompt_twice(gap_s: float, output: int = 1) -> Trace:
    """Two requests with one 1,024-token prompt (two 512-token content blocks)."""
    return Trace("twice", "test", np.array([0.0, gap_s]), np.array([1024, 1024]), np.array([output, output]),
                 block_hashes=[(7, 8), (7, 8)], block_hash_size=512)


def test_a_hit_loads_over_the_host_link_and_the_prompt_was_stored_by_bytes_over_bandwidth() -> None:
    engine = make_engine(same_prompt_twice(5.0), "vllm", spec(), check=True)
    engine.run()
    tier = engine.connector.summary()[0]  # type: ignore[union-attr]
    store_s = 1024 * KV_BYTES / PCIE          # 64 blocks of 16 tokens, the first request's prompt
    load_s = 1024 * KV_BYTES / PCIE           # the whole prompt; its last token is computed again
    assert tier["store_time_s"] == pytest.approx(store_s)
    assert tier["load_time_s"] == pytest.approx(load_s)
    assert tier["hits_tokens"] == 1024
    assert tier["store_bytes"] == 1024 * KV_BYTES and tier["load_bytes"] == 1024 * KV_BYTES
    reqs = engine.requests
    ttft = reqs.first_token - reqs.arrival
    assert ttft[0] == pytest.approx(STEP)
    # The second request waits for its load, then computes its last token in one step.
    assert ttft[1] == pytest.approx(load_s + STEP)
    assert engine.num_prefill_tokens == 1024 + 1


def test_a_finished_request_holds_its_blocks_until_its_stores_land() -> None:
    engine = make_engine(same_prompt_twice(5.0), "vllm", spec(), check=True)
    engine.run()
    store_s = 1024 * KV_BYTES / PCIE
    # The first request finishes with its prefill (one output token); its 65 blocks
    # hold 1,025 tokens, 15 slots of the last one never filled (internal).
    assert engine.rec.peak_held() == 1025
    assert engine.rec.mean_held() * engine.rec.span_s == pytest.approx(1025 * store_s)
    assert engine.requests.finish[0] == pytest.approx(STEP)  # it finished; its memory lingered


def test_the_tier_is_asked_only_past_the_gpu_hit() -> None:
    # The GPU still caches the prompt when the second request comes, all but its last
    # block (the GPU's hit leaves a token to compute). The tier is asked from there,
    # holds that block, and loads it; the request then computes its last token again.
    engine = make_engine(same_prompt_twice(0.5), "vllm", spec(prefix_caching=True), check=True)
    engine.run()
    tier = engine.connector.summary()[0]  # type: ignore[union-attr]
    assert engine.num_prefix_hits == 1008
    assert tier["hits_tokens"] == 16 and tier["load_bytes"] == 16 * KV_BYTES
    assert engine.connector.queries == 1024 + 16  # type: ignore[union-attr]  # the first prompt, the second's rest
    assert engine.num_prefill_tokens == 1024 + 1


def test_without_a_tier_nothing_changes() -> None:
    trace = make_sessions(SessionSpec(num_sessions=40, session_rate=4.0, system_prompt_len=600, seed=3)).trace
    plain = simulate(trace, "vllm", spec(kv_offloading_size=None, prefix_caching=True)).summary
    assert plain["tiers"] == [] and plain["store_pending_frac"] == 0.0
    assert plain["external_prefix_cache_hits"] == 0


@pytest.mark.parametrize(("policy", "prefix_caching", "short", "backend", "disk"), [
    ("lru", False, False, "native", None),
    ("arc", False, True, "native", None),
    ("lru", True, True, "lmcache", 0.5),
    ("arc", True, False, "lazy", 0.5),
    ("lru", True, False, "native", 0.5),
])
def test_the_tier_split_holds_at_every_step_under_pressure(policy: str, prefix_caching: bool, short: bool,
                                                          backend: str, disk: float | None) -> None:
    trace = make_sessions(SessionSpec(num_sessions=40, session_rate=6.0, system_prompt_len=700, seed=5)).trace
    if short:  # one-token answers: requests finish while their stores are in flight
        trace = Trace(trace.name, trace.source, trace.arrival_s, trace.prompt_len,
                      np.minimum(trace.output_len, 1), block_hashes=trace.block_hashes,
                      block_hash_size=trace.block_hash_size)
    # A small GPU pool (preemptions) and a tier of a few thousand tokens (evictions).
    run = spec(kv_slots=6000, kv_offloading_size=0.25, kv_offloading_policy=policy,
               kv_offloading_block_size=64 if backend == "native" else None, prefix_caching=prefix_caching,
               kv_offloading_backend=backend, kv_offloading_disk_size=disk)
    result = simulate(trace, "vllm", run, check=True)
    s = result.summary
    assert len(s["tiers"]) == (2 if disk else 1)
    parts = ("cached_hit_later", "cached_never_hit", "write_pending", "read_pending", "chunk_tail",
             "swapped", "free")
    for tier in s["tiers"]:
        fracs = [tier[f"{p}_frac"] for p in parts]
        assert min(fracs) >= -1e-12 and math.fsum(fracs) == pytest.approx(1.0)
        assert (tier["chunk_tail_frac"] > 0) == (backend == "lmcache")
    tier = s["tiers"][0]
    assert tier["evicted_blocks"] > 0 and tier["hits_tokens"] > 0
    assert s["external_prefix_cache_hits"] == sum(t["hits_tokens"] for t in s["tiers"])
    gpu = ("token_states", "reservation", "internal_fragmentation", "free", "store_pending")
    assert math.fsum(s[f"{p}_frac"] for p in gpu) == pytest.approx(1.0)
    assert s["num_finished"] + s["num_refused"] == len(trace)
    assert s["num_preemptions"] > 0 or short
    assert (s["peak_store_pending_slots"] > 0) == (short and backend != "lazy")


@pytest.mark.parametrize(("allocator", "extra", "word"), [
    ("static-partition", {}, "vllm-hybrid"),
    ("orca-max", {}, "not paged"),
    ("vllm", {"num_samples": 2}, "sampling"),
])
def test_what_a_tier_cannot_run_with_is_refused_by_name(allocator: str, extra: dict[str, object],
                                                        word: str) -> None:
    with pytest.raises(FragsimError, match=word):
        make_engine(same_prompt_twice(1.0), allocator, spec(**extra))


def test_a_tier_block_must_be_whole_gpu_blocks() -> None:
    with pytest.raises(FragsimError, match="multiple of the GPU block size 16"):
        make_engine(same_prompt_twice(1.0), "vllm", spec(kv_offloading_block_size=24))
    with pytest.raises(FragsimError, match="holds no block"):
        make_engine(same_prompt_twice(1.0), "vllm", spec(kv_offloading_size=1e-6))


def three(prompts: list[tuple[int, tuple[int, ...]]], gap_s: float = 5.0) -> Trace:
    """Requests ``gap_s`` apart, one output token each."""
    n = len(prompts)
    return Trace("three", "test", np.arange(n) * gap_s, np.array([p for p, _ in prompts]),
                 np.ones(n, dtype=np.int64), block_hashes=[h for _, h in prompts], block_hash_size=512)


def test_a_disk_hit_is_read_by_an_io_thread_then_crosses_the_host_link() -> None:
    # The CPU tier holds one prompt (64 blocks); the second prompt evicts the first,
    # which the third request then finds on disk only.
    cpu_gib = 64 * 16 * KV_BYTES / 2**30
    run = spec(kv_offloading_size=cpu_gib, kv_offloading_disk_size=1.0, kv_offloading_disk_threads=4,
               kv_offloading_disk_read_gbps=3.0)
    engine = make_engine(three([(1024, (7, 8)), (1024, (9, 10)), (1024, (7, 8))]), "vllm", run, check=True)
    engine.run()
    cpu, disk = engine.connector.summary()  # type: ignore[union-attr]
    assert cpu["hits_tokens"] == 0 and disk["hits_tokens"] == 1024
    assert cpu["evicted_blocks"] == 64 and disk["stored_blocks"] == 128
    read_s = 1024 * KV_BYTES * 4 / 3e9      # one of four I/O threads: a quarter of 3 GB/s
    link_s = 1024 * KV_BYTES / PCIE
    ttft = engine.requests.first_token - engine.requests.arrival
    assert ttft[2] == pytest.approx(read_s + link_s + STEP)
    assert disk["load_time_s"] == pytest.approx(read_s + link_s)
    assert disk["store_time_s"] == pytest.approx(2 * 1024 * KV_BYTES * 4 / 2e9)


def test_lmcache_stores_the_partial_last_chunk_and_counts_its_tail() -> None:
    run = spec(kv_offloading_backend="lmcache")
    engine = make_engine(three([(1000, (7, 8)), (1000, (7, 8))]), "vllm", run, check=True)
    engine.run()
    (cpu,) = engine.connector.summary()  # type: ignore[union-attr]
    assert cpu["block_size"] == 256 and cpu["stored_blocks"] == 4  # 3 whole chunks and a 232-token tail
    assert cpu["hits_tokens"] == 1000         # the tail too: the same content and length
    assert cpu["store_bytes"] == 1000 * KV_BYTES
    assert cpu["chunk_tail_frac"] > 0
    # a chunk slot holds 256 tokens: the tail's 24 unused ones are 24/1024 of the used slots
    used = 1 - cpu["free_frac"]
    assert cpu["chunk_tail_frac"] / used == pytest.approx(24 / 1024)


def test_lazy_stores_what_the_gpu_prefix_cache_evicts() -> None:
    # 68 GPU blocks. The first request frees its blocks tail first (as vLLM does), so
    # the second prompt's 65 blocks are the 3 never used, the first's partial block and
    # its cached blocks 63 down to 3: those 61 go to the tier. The third request hits
    # blocks 0-2 on the GPU and 3-63 in the tier (and computes its last token again).
    run = spec(kv_offloading_backend="lazy", prefix_caching=True, kv_slots=68 * 16)
    engine = make_engine(three([(1024, (7, 8)), (1024, (9, 10)), (1024, (7, 8))]), "vllm", run, check=True)
    engine.run()
    (cpu,) = engine.connector.summary()  # type: ignore[union-attr]
    assert engine.num_prefix_hits == 3 * 16
    assert cpu["hits_tokens"] == 61 * 16
    with pytest.raises(FragsimError, match="needs --prefix-caching"):
        make_engine(three([(1024, (7, 8))]), "vllm", spec(kv_offloading_backend="lazy"))


def test_a_hit_still_being_written_defers_the_request_as_vllm_does() -> None:
    # An 8,192-token prompt takes 33.6 ms to store. The second request, the same prompt,
    # comes while the store is in flight: its lookup finds the chunks pending, so it
    # is skipped (vLLM's HIT_PENDING) until they land, then loads them all.
    hashes = tuple(range(16))
    trace = Trace("pending", "test", np.array([0.0, 0.03]), np.array([8192, 8192]), np.array([50, 50]),
                  block_hashes=[hashes, hashes], block_hash_size=512)
    engine = make_engine(trace, "vllm", spec(max_seq_len=16384), check=True)
    engine.run()
    store_s = load_s = 8192 * KV_BYTES / PCIE
    assert STEP < store_s < 2 * STEP
    (tier,) = engine.connector.summary()  # type: ignore[union-attr]
    assert tier["hits_tokens"] == 8192
    # Skipped at the step at 0.04; admitted at 0.06 (the store landed at 0.0536); its
    # load lands at 0.0936, seen at the step at 0.10, whose end brings its first token.
    assert 0.06 + load_s < 0.10
    assert engine.requests.first_token[1] == pytest.approx(0.12)
    assert engine.num_prefill_tokens == 8192 + 1


def test_swap_space_is_taken_from_the_cpu_tier() -> None:
    # One host pool: sequences swapped out take whole chunks of the tier (evicting idle
    # ones), and --swap-space-gb plays no part.
    trace = make_sessions(SessionSpec(num_sessions=40, session_rate=6.0, system_prompt_len=700, seed=5)).trace
    run = spec(kv_slots=6000, kv_offloading_size=0.5, preemption="swap", swap_space_gb=0.0)
    result = simulate(trace, "vllm", run, check=True)
    s = result.summary
    (tier,) = s["tiers"]
    assert s["num_preemptions_swap"] > 0
    assert tier["swapped_frac"] > 0
    parts = ("cached_hit_later", "cached_never_hit", "write_pending", "read_pending", "chunk_tail",
             "swapped", "free")
    assert math.fsum(tier[f"{p}_frac"] for p in parts) == pytest.approx(1.0)
    assert s["num_finished"] + s["num_refused"] == len(trace)


def test_a_loading_request_is_out_of_the_running_set_and_waits_for_a_slot_once_loaded() -> None:
    """vLLM 0.33 keeps a request whose KV is loading out of ``running``: ``max_num_seqs``
    does not count it, so a later request starts meanwhile; once loaded it waits for a
    running slot, and takes the first one ahead of any waiting request."""
    tr = Trace("slots", "test", np.array([0.0, 5.0, 5.0, 5.0]), np.array([1024, 1024, 512, 512]),
               np.array([1, 1, 3, 1]), block_hashes=[(7, 8), (7, 8), (9,), (10,)], block_hash_size=512)
    engine = make_engine(tr, "vllm", spec(max_num_seqs=1), check=True)
    engine.run()
    reqs = engine.requests
    load_s = 1024 * KV_BYTES / PCIE
    # The second request loads; the third runs beside it (one slot: the third's).
    assert reqs.first_token[2] == pytest.approx(5.0 + STEP)
    assert load_s < STEP
    # Loaded during the third's first step, the second waits for the slot, then takes it
    # before the fourth, which arrived with it but is still waiting.
    assert reqs.first_token[1] == pytest.approx(reqs.finish[2] + STEP)
    assert reqs.first_token[3] == pytest.approx(reqs.finish[1] + STEP)
