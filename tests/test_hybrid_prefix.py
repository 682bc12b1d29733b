"""Prefix caching in vLLM's hybrid KV cache manager: each kind's own hit rule,
the reconciled hit, the free queue's eviction order, and the byte split with
blocks shared between sequences."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import hybrid_split_by_position, hybrid_split_by_position_check

from fragsim.catalog import get_gpu, get_model
from fragsim.errors import FragsimError
from fragsim.hybrid import VllmHybridManager, VllmPrefixManager
from fragsim.simulate import RunSpec, load_workload, make_engine, simulate
from fragsim.vllm_plan import plan_vllm

GiB = 1 << 30
H100 = get_gpu("h100-80gb")


def make_manager(model: str = "gpt-oss-20b", blocks: int = 64) -> VllmPrefixManager:
    """A pool of exactly ``blocks`` usable blocks (and the null block)."""
    m = get_model(model)
    bpb = plan_vllm(m, H100, GiB, max_model_len=1024, prefix_caching=True).bytes_per_block
    plan = plan_vllm(m, H100, (blocks + 1) * bpb, max_model_len=1024, prefix_caching=True)
    assert plan.num_gpu_blocks == blocks + 1
    return VllmPrefixManager(plan, max_seq_len=1024)


def assert_split(m: VllmPrefixManager, computed: dict[int, int]) -> np.ndarray:
    seqs = np.array(list(computed), dtype=np.int64)
    f = np.array(list(computed.values()), dtype=np.int64)
    fast, slow = m.split(seqs, f), hybrid_split_by_position(m, seqs, f)
    np.testing.assert_array_equal(fast, slow)
    assert int(fast.sum()) == m.capacity and int(fast.min()) >= 0
    m.check()
    return fast


# gpt-oss-20b: group 0 sliding 128, group 1 full; 16-token blocks, so a sliding hit
# needs ceil(127 / 16) = 8 cached blocks in a row. Request A: a 320-token prompt
# (20 full blocks, keys 100..119), 21 blocks a group: sliding 1..21, full 22..42.
KEYS_A = [100 + i for i in range(20)]
KEYS_B = KEYS_A + [200 + i for i in range(5)]          # 400 tokens, A's prompt first


def with_a(m: VllmPrefixManager) -> None:
    assert m.allocate(0, 321, None, 320) is not None
    assert m.placement(0) == (tuple(range(1, 22)), tuple(range(22, 43)))
    m.cache_blocks(0, KEYS_A)
    # Full attention keys every block; the sliding window only the 8 before A's replay
    # boundary (319 // 16 = 19): positions 11..18, blocks 12..19.
    assert sorted(m.pool.cached_keys(1)) == KEYS_A
    assert sorted(m.pool.cached_keys(0)) == KEYS_A[11:19]


def test_full_scans_left_to_right_sliding_right_to_left() -> None:
    m = make_manager()
    with_a(m)
    hit = m.lookup(KEYS_B[:24], 399)
    # full: positions 0..19 cached, 20 not: 320 tokens. sliding (right to left from
    # block 23): 23..19 miss, 18..11 hit, 8 in a row: 19 × 16 = 304. Agreed: 304; the
    # full group's 320 is the junction where B will keep its own window.
    assert hit.by_kind == {"full": 320, "sliding": 304}
    assert (hit.tokens, hit.junction) == (304, 320)
    assert hit.blocks == (tuple(range(12, 20)), tuple(range(22, 41)))
    assert m.allocate(1, 401, hit, 400) is not None
    assert m.pool.dup == [8, 19]
    assert m.num_free_blocks() == 64 - 42 - 14
    split = assert_split(m, {0: 320, 1: 304})
    # A shared block counts once: token states are A's 320 positions in the full group
    # (B holds nothing more that it has computed).
    assert split[1, 0] == 320 * m.rows[1].token_bytes
    # B computes the rest; it keys its window at its replay boundary (399 // 16 = 24:
    # positions 16..23) and at the junction (320 // 16 = 20: 12..19), those it holds
    # of its own (19..23).
    m.cache_blocks(1, KEYS_B)
    assert sorted(m.pool.cached_keys(0)) == KEYS_B[11:24]
    assert_split(m, {0: 320, 1: 400})
    # A third request finds the rightmost run of 8: positions 16..23 (not 11..18).
    keys_c = KEYS_B + [300 + i for i in range(12)]
    hit = m.lookup(keys_c[:37], 599)
    assert hit.by_kind == {"full": 400, "sliding": 384}
    assert hit.tokens == 384
    assert [m.pool.key_of(b) for b in hit.blocks[0]] == KEYS_B[16:24]


def test_eviction_order_and_a_window_without_its_earlier_blocks() -> None:
    m = make_manager()
    with_a(m)
    m.free(0)
    # Per group, last block first: blocks without a key to the front (reused first),
    # keyed ones to the back; the full group's free comes after the sliding group's.
    assert m.pool.free_order() == ([42, 21, 20] + list(range(11, 0, -1)) + list(range(43, 65))
                             + list(range(19, 11, -1)) + list(range(41, 21, -1)))
    assert m.pool.num_evictable_blocks() == 28
    # A filler takes the 14 unkeyed and 20 never-used blocks: A's early sliding blocks
    # are gone, its window's 8 are not, so B still hits.
    assert m.allocate(9, 17 * 16) is not None
    assert m.pool.num_evictions == 0
    assert m.lookup(KEYS_B[:24], 399).tokens == 304
    # Two more blocks each evict the sliding group's last two (positions 18 and 17):
    # 6 in a row is no window, and nothing hits from block 0 either.
    assert m.allocate(10, 2 * 16) is not None
    assert m.pool.num_evictions == 2
    hit = m.lookup(KEYS_B[:24], 399)
    assert hit.by_kind == {"full": 320, "sliding": 0}
    assert (hit.tokens, hit.blocks) == (0, ((), ()))
    assert_split(m, {9: 0, 10: 0})


def test_a_hit_on_free_blocks_takes_them_back() -> None:
    m = make_manager()
    with_a(m)
    m.free(0)
    hit = m.lookup(KEYS_B[:24], 399)
    free = m.num_free_blocks()
    assert m.allocate(1, 401, hit, 400) is not None
    # 8 + 19 evictable blocks leave the queue, and 2 × 7 new ones are taken.
    assert m.num_free_blocks() == free - 27 - 14
    assert m.pool.dup == [0, 0]
    assert_split(m, {1: 304})


def test_a_failed_extension_frees_its_window_first() -> None:
    m = make_manager(blocks=30)
    assert m.allocate(0, 161, None, 160) is not None              # 11 blocks a group
    m.cache_blocks(0, [7 + i for i in range(10)])
    assert m.allocate(1, 64) is not None                          # 4 a group: none free
    assert m.num_free_blocks() == 0
    # Every 16 tokens sequence 0 takes a block a group and its window frees one: at
    # 209 tokens (208 computed, window from 82: 5 blocks out) the 2 new blocks do not
    # fit the 1 free one. vLLM frees the window's block before it checks; so does this.
    while m.extend(0, 1):
        pass
    assert m.num_requested(0) == 208
    assert m.blocks_held(0) == [13 - 5, 13]
    assert m.num_free_blocks() == 1
    assert_split(m, {0: 207, 1: 63})
    m.free(1)
    assert m.extend(0, 1)
    assert m.blocks_held(0) == [14 - 5, 14]
    assert_split(m, {0: 208})


def test_state_layers_and_other_managers_refuse_prefix_caching() -> None:
    with pytest.raises(ValueError, match="align"):
        make_manager("jamba-mini-1.5")
    spec = RunSpec(trace="azure-conv", model="gpt-oss-20b", gpu="h100-80gb", num_requests=10,
                   kv_cache_memory_bytes=GiB, prefix_caching=True)
    with pytest.raises(FragsimError, match="vllm-hybrid only"):
        make_engine(load_workload(spec), "paged-uniform", spec)


# ------------------------------------------------------------------ in the engine

def _spec(model: str, pool: float, n: int, **kw: object) -> RunSpec:
    return RunSpec(trace="azure-conv", model=model, gpu="h100-80gb", max_seq_len=4096, num_requests=n,
                   kv_cache_memory_bytes=int(pool * GiB), rate=20.0, system_prompt_len=700,
                   **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("model, pool", [("gpt-oss-20b", 0.3), ("gemma-3-27b", 0.6)])
def test_split_identity_with_shared_blocks(model: str, pool: float) -> None:
    """check=True rebuilds the split position by position from the block tables at every
    step (a shared block once) and compares; the pool is small enough to evict and preempt."""
    spec = _spec(model, pool, 60, prefix_caching=True)
    engine = make_engine(load_workload(spec), "vllm-hybrid", spec, check=True)
    engine.checks.append(hybrid_split_by_position_check)
    seen: list[int] = []
    split = engine.kv.current_split

    def spy(live: object) -> np.ndarray:
        seen.append(sum(engine.kv.manager.pool.dup))  # type: ignore[attr-defined]
        return split(live)  # type: ignore[arg-type]

    engine.kv.current_split = spy  # type: ignore[method-assign]
    engine.run()
    assert max(seen) > 0
    assert engine.num_prefix_hits > 0
    assert engine.kv.manager.pool.num_evictions > 0  # type: ignore[attr-defined]
    assert engine.rec.counters.num_preemptions_recompute > 0


@pytest.mark.parametrize("model", ["gpt-oss-20b", "gemma-3-27b"])
def test_stretches_make_the_exact_steps_decisions(model: str) -> None:
    spec = _spec(model, 0.5, 200, prefix_caching=True)
    trace = load_workload(spec)
    fast = make_engine(trace, "vllm-hybrid", spec)
    fast.run()
    exact = make_engine(trace, "vllm-hybrid", RunSpec(**{**spec.to_dict(), "exact_steps": True,
                                                         "time_window_s": None}))
    exact.run()
    assert fast.num_steps == exact.num_steps
    assert fast.num_events < exact.num_events
    np.testing.assert_array_equal(fast.requests.first_token, exact.requests.first_token)
    np.testing.assert_array_equal(fast.requests.finish, exact.requests.finish)
    np.testing.assert_array_equal(fast.requests.preemptions, exact.requests.preemptions)
    assert fast.num_prefix_hits == exact.num_prefix_hits > 0  # type: ignore[attr-defined]
    np.testing.assert_allclose(fast.kv.split_rec.means(), exact.kv.split_rec.means(), rtol=1e-9, atol=1e-3)


def test_prefix_caching_off_is_the_manager_of_before() -> None:
    """Off, the plain manager runs, with the numbers it gave before prefix caching existed
    (counts exactly, means to 1e-9: the order of a float sum may differ, as in the
    reference results)."""
    want = {"gpt-oss-20b": (3279, 200126, 9.359087567292937, 427385308.6776225, 3),
            "gemma-3-27b": (840, 8387, 4.229052815107403, 379211970.41713613, 0)}
    for model, expected in want.items():
        spec = _spec(model, 0.5, 150)
        engine = make_engine(load_workload(spec), "vllm-hybrid", spec)
        assert type(engine.kv.manager) is VllmHybridManager
        s = simulate(load_workload(spec), "vllm-hybrid", spec).summary
        got = (s["num_steps"], s["num_prefill_tokens"], s["mean_ttft_s"], s["mean_token_states_bytes"],
               s["num_preemptions_recompute"])
        assert got == pytest.approx(expected, rel=1e-9), model
        assert [type(x) for x in got] == [type(x) for x in expected], model
        assert (got[0], got[1], got[4]) == (expected[0], expected[1], expected[4]), model
        assert s["prefix_cache_hit_rate"] == 0.0


def test_summary_keys_per_kind() -> None:
    spec = _spec("gpt-oss-20b", 0.5, 80, prefix_caching=True)
    s = simulate(load_workload(spec), "vllm-hybrid", spec).summary
    assert 0 < s["prefix_cache_hit_rate"] < 1
    assert s["prefix_cache_hits"] <= s["prefix_cache_queries"]
    assert s["num_prefix_cache_evictions"] >= 0
    by_kind = s["by_kind"]
    # Each kind on its own hits at least the agreed hit; the system prompt's 700 tokens
    # hold 43 full blocks, the window's 8 before the prompt's end are keyed.
    assert by_kind["full"]["prefix_cache_hit_rate"] >= s["prefix_cache_hit_rate"]
    assert by_kind["sliding"]["prefix_cache_hit_rate"] >= s["prefix_cache_hit_rate"]


def test_mooncake_sliding_hits_less_than_full(shared_traces) -> None:  # type: ignore[no-untyped-def]
    """On a multi-turn trace the sliding window hits only where an earlier request kept
    its window (its prompt's end, its junction): less than full attention alone."""
    spec = RunSpec(trace=str(shared_traces / "mooncake_conversation.jsonl"), model="gpt-oss-20b",
                   gpu="h100-80gb", tp=4, max_seq_len=131072, num_requests=200,
                   kv_cache_memory_bytes=4 * GiB, max_num_batched_tokens=8192, prefix_caching=True)
    s = simulate(load_workload(spec), "vllm-hybrid", spec).summary
    full, sliding = (s["by_kind"][k]["prefix_cache_hit_rate"] for k in ("full", "sliding"))
    assert 0 < s["prefix_cache_hit_rate"] <= sliding < full


# ------------------------------------------------------------- random operations

@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 7), st.integers(1, 30)), min_size=1,
                max_size=60))
def test_random_operations_keep_the_split_exact(ops: list[tuple[int, int, int]]) -> None:
    """Admissions with hits on three prompt families, prefills that key their blocks,
    decode steps and frees, in any order: the pool's invariants, and the fast split
    against the rebuilt one, after every operation."""
    m = make_manager(blocks=48)
    live: dict[int, list[int]] = {}       # seq -> [prompt, computed]
    keys: dict[int, list[int]] = {}
    nxt = 0
    for op, a, b in ops:
        if op == 0:                                   # admit: family a % 3, b·8 + 1 tokens
            prompt = b * 8 + 1
            family = a % 3
            ks = [family * 1000 + i if i < 6 + a else 10**6 + nxt * 100 + i for i in range(prompt // 16)]
            hit = m.lookup(ks[: (prompt - 1) // 16], prompt - 1)
            if m.allocate(nxt, prompt + 1, hit, prompt) is not None:
                live[nxt], keys[nxt] = [prompt, hit.tokens], ks
            nxt += 1
        elif live:
            seq = sorted(live)[a % len(live)]
            prompt, f = live[seq]
            if op == 1 and f < prompt:                # the prefill: keys for its full blocks
                live[seq][1] = prompt
                m.cache_blocks(seq, keys[seq])
            elif op == 2 and f >= prompt:             # a decode step
                if m.extend(seq, 1):
                    live[seq][1] = m.num_requested(seq) - 1
                else:
                    m.free(seq)
                    del live[seq]
            elif op == 3:
                m.free(seq)
                del live[seq]
        assert_split(m, {s: v[1] for s, v in live.items()})
