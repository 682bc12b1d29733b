"""Offload tiers: the tier's rules, its policies, and the request-order hit-rate replay."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fragsim.cli import main as cli_main
from fragsim.offload import Lookup, RequestAccess, Tier, hit_rates
from fragsim.offload.replay import chunk_keys, prefix_seen, replay
from fragsim.traces import Trace


def access_for(keys: list[int]) -> RequestAccess:
    return RequestAccess({k: i + 1 for i, k in enumerate(keys)})


# --- the tier ---


def test_store_is_pending_until_complete_then_readable() -> None:
    tier = Tier(4)
    a = access_for([1, 2])
    out = tier.prepare_store([1, 2], a)
    assert out is not None and out.stored == [1, 2] and out.evicted == []
    assert tier.lookup(1) is Lookup.PENDING
    tier.complete_store([1, 2])
    assert tier.lookup(1) is Lookup.HIT and tier.lookup(3) is Lookup.MISS
    assert tier.num_idle == 2 and tier.num_free == 2


def test_failed_write_frees_the_slot() -> None:
    tier = Tier(2)
    tier.prepare_store([1, 2], access_for([1, 2]))
    tier.complete_store([1], success=False)
    tier.complete_store([2])
    assert tier.lookup(1) is Lookup.MISS and tier.num_free == 1


def test_store_fails_whole_when_too_few_idle_chunks() -> None:
    tier = Tier(3)
    first = access_for([1, 2, 3])
    tier.prepare_store([1, 2, 3], first)
    tier.complete_store([1, 2])  # 3 stays write-pending: not evictable
    reader = access_for([1])
    tier.prepare_load([1], reader)  # 1 is being read: not evictable
    assert tier.prepare_store([7, 8], access_for([7, 8])) is None  # only 2 is idle
    assert tier.counters.failed_stores == 1
    out = tier.prepare_store([7], access_for([7]))
    assert out is not None and out.evicted == [2]
    tier.complete_load([1])
    assert tier.num_idle == 1


def test_offered_keys_are_never_evicted_for_their_own_store() -> None:
    tier = Tier(2)
    tier.prepare_store([1, 2], access_for([1, 2]))
    tier.complete_store([1, 2])
    # 1 is resident and offered again with a new key: 1 is protected, so 2 goes.
    out = tier.prepare_store([1, 9], access_for([1, 9]))
    assert out is not None and out.stored == [9] and out.evicted == [2]


def test_store_threshold_stores_on_the_second_offer() -> None:
    tier = Tier(4, store_threshold=2)
    out = tier.prepare_store([5], access_for([5]))
    assert out is not None and out.stored == [] and tier.counters.skipped_stores == 1
    out = tier.prepare_store([5], access_for([5]))
    assert out is not None and out.stored == [5]


def test_bad_calls_are_refused() -> None:
    tier = Tier(2)
    tier.prepare_store([1], access_for([1]))
    with pytest.raises(ValueError, match="still being written"):
        tier.prepare_load([1], access_for([1]))
    with pytest.raises(ValueError, match="unknown policy"):
        Tier(2, "fifo")


# --- policies, by hand ---


def test_lru_by_hand() -> None:
    # capacity 2: [a b] stored; [a c] hits a and evicts b (a was just read); [b] evicts c
    # (a is the most recent head); [a c] hits a only, c is gone.
    a, b, c = 1, 2, 3
    hits, tier = replay([[a, b], [a, c], [b], [a, c]], 2, "lru")
    assert hits == [0, 1, 0, 1]
    assert tier.counters.evicted == 3


def test_lru_keeps_a_requests_head_over_its_tail() -> None:
    # One request stores 1 2 3; a new key must evict one: the tail (3) goes, not the head.
    hits, _ = replay([[1, 2, 3], [9], [1, 2, 3]], 3, "lru")
    assert hits == [0, 0, 2]


def test_arc_promotes_reused_chunks_to_t2_and_keeps_them_over_scans() -> None:
    # 1 is reused (T2); a scan of new keys then only cycles through T1.
    trace = [[1], [1]] + [[100 + i] for i in range(6)] + [[1]]
    assert replay(trace, 3, "arc")[0][-1] == 1
    assert replay(trace, 3, "lru")[0][-1] == 0


def test_arc_ghost_hit_moves_the_target() -> None:
    tier = Tier(1, "arc")
    for key in (1, 2, 1):  # 1 is evicted into B1 by 2, then stored again: a B1 ghost hit
        a = access_for([key])
        out = tier.prepare_store([key], a)
        assert out is not None
        tier.complete_store(out.stored)
        tier.finish(a)
    assert tier.policy.target_t1 == 1.0  # type: ignore[attr-defined]


# --- LRU against a plain ordered-dict oracle, in request order ---


def lru_oracle(requests: list[list[int]], capacity: int) -> list[int]:
    """Request-order LRU: hits are refreshed tail first at the load, every resident key of
    the request head-most-recent at its end; a store evicts the oldest keys it did not offer."""
    order: OrderedDict[int, None] = OrderedDict()
    out = []
    for keys in requests:
        hit = 0
        while hit < len(keys) and keys[hit] in order:
            hit += 1
        for key in reversed(keys[:hit]):
            order.move_to_end(key)
        offered = keys[hit:]
        absent = [k for k in offered if k not in order]
        need = len(absent) - (capacity - len(order))
        victims = [k for k in order if k not in offered][:max(need, 0)]
        if absent and len(victims) >= need:
            for key in victims:
                del order[key]
            for key in absent:
                order[key] = None
        for key in reversed(keys):
            if key in order:
                order.move_to_end(key)
        out.append(hit)
    return out


@settings(max_examples=150, deadline=None)
@given(
    families=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=8), min_size=1, max_size=5),
    picks=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 8), st.integers(0, 3)),
                   min_size=1, max_size=40),
    capacity=st.integers(0, 12),
)
def test_lru_matches_the_oracle(families: list[list[int]], picks: list[tuple[int, int, int]],
                                capacity: int) -> None:
    requests = []
    for r, (family, shared, own) in enumerate(picks):
        base = list(dict.fromkeys(families[family % len(families)]))
        requests.append(base[:shared] + [1000 + r * 10 + i for i in range(own)])
    assert replay(requests, capacity, "lru")[0] == lru_oracle(requests, capacity)


# --- the replay ---


def hashed_trace(hashes: list[tuple[int, ...]], prompt: list[int]) -> Trace:
    n = len(prompt)
    return Trace("t", "test", np.arange(n, dtype=float), prompt, [1] * n,
                 block_hashes=hashes, block_hash_size=512)


def test_only_full_chunks_have_keys_and_keys_follow_the_prefix() -> None:
    trace = hashed_trace([(1, 2), (1, 3), (1, 2, 4)], [1000, 1024, 1300])
    keys = chunk_keys(trace, 512)
    assert [len(k) for k in keys] == [1, 2, 2]
    assert keys[0][0] == keys[1][0] == keys[2][0]  # the shared first 512 tokens
    assert keys[1][1] != keys[2][1]  # same place, different content
    assert chunk_keys(trace, 256)[0][:2] == chunk_keys(trace, 256)[2][:2]


def test_max_hit_rate_is_an_unbounded_tier() -> None:
    trace = hashed_trace([(1, 2, 3), (1, 2, 9), (5, 2, 3), (1, 2, 3)], [1536] * 4)
    (unbounded,) = hit_rates(trace, [10**9])
    assert unbounded.hit_blocks_per_request == [0, 2, 0, 3]
    assert unbounded.hit_rate == unbounded.max_hit_rate == 5 / 12
    assert prefix_seen(chunk_keys(trace, 512)) == (5, 5)


def test_hits_cli_json_keys_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": i, "input_length": 1100, "output_length": 3, "hash_ids": [7, 8, 100 + i]}
            for i in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli_main(["trace", "hits", str(path), "--capacity-tokens", "512,1e4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [o["capacity_tokens"] for o in out] == [512, 10000]
    assert set(out[0]) >= {"capacity_tokens", "policy", "block_size", "requests", "block_refs",
                           "hit_blocks", "hit_rate", "max_hit_rate", "cache_ratio", "evictions",
                           "hit_blocks_per_request"}
    assert out[1]["hit_blocks_per_request"] == [0, 2, 2, 2, 2]
    # One chunk of room and two new chunks per request: every store fails whole, as vLLM's.
    assert out[0]["hit_blocks_per_request"] == [0, 0, 0, 0, 0]
    assert out[0]["failed_stores"] == 5
    plot = tmp_path / "h.png"
    assert cli_main(["trace", "hits", str(path), "--policy", "arc", "--plot", str(plot)]) == 0
    assert "every chunk kept" in capsys.readouterr().out and plot.stat().st_size > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--capacity-tokens", "1e6,x"], "expected numbers like 1e6,3e6"),
        (["--capacity-tokens", "0"], "a capacity must be >= 1 token"),
        (["--block-size", "0"], "must be >= 1"),
    ],
)
def test_hits_cli_bad_options(argv: list[str], message: str,
                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["trace", "hits", "azure-conv", *argv])
    assert message in capsys.readouterr().err


def test_hits_cli_refuses_a_trace_without_hashes(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["trace", "hits", "azure-conv", "--num-requests", "5"]) != 0
    assert "no content hashes" in capsys.readouterr().err
