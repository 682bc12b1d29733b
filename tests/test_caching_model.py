"""The caching-allocator model: worked layouts, the OOM path, options, invariants."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fragsim.caching.model import (
    LARGE_BUFFER,
    CachingAllocatorModel,
    MiB,
    _roundup_power2_next_division,
    allocation_size,
)
from fragsim.caching.snapshot import analyze

GiB = 1 << 30


def layout(m: CachingAllocatorModel) -> list[tuple[str, int, list[tuple[int, int, int, str]]]]:
    """(pool, segment size, [(offset, size, requested, state)]) per segment."""
    return [
        (s.pool, s.size, [(b.address - s.address, b.size, b.requested, b.state) for b in s.blocks])
        for s in m.segments()
    ]


def test_small_request_rounds_to_512_in_a_2mib_segment() -> None:
    m = CachingAllocatorModel(GiB)
    m.malloc(1000)
    #   small segment, 2 MiB
    #   +------+---------------------------+
    #   | 1024 | 2,096,128 free            |
    #   +------+---------------------------+
    assert layout(m) == [("small", 2 * MiB, [(0, 1024, 1000, "active_allocated"),
                                             (1024, 2 * MiB - 1024, 0, "inactive")])]
    assert m.stats()["internal_bytes"] == 24
    m.check()


def test_mid_request_splits_a_20mib_segment() -> None:
    m = CachingAllocatorModel(GiB)
    m.malloc(3 * MiB)
    #   large segment, 20 MiB
    #   +-------+--------------------------+
    #   | 3 MiB | 17 MiB free              |
    #   +-------+--------------------------+
    assert layout(m) == [("large", 20 * MiB, [(0, 3 * MiB, 3 * MiB, "active_allocated"),
                                              (3 * MiB, 17 * MiB, 0, "inactive")])]
    s = m.stats()
    assert (s["reserved_bytes"], s["inactive_split_bytes"], s["largest_free_block"]) == (20 * MiB, 17 * MiB, 17 * MiB)


def test_large_request_gets_a_2mib_rounded_segment_and_keeps_a_small_tail() -> None:
    m = CachingAllocatorModel(GiB)
    m.malloc(25 * MiB)
    # 25 MiB -> 26 MiB segment; the 1 MiB tail is not > kSmallSize, so no split
    assert layout(m) == [("large", 26 * MiB, [(0, 26 * MiB, 25 * MiB, "active_allocated")])]
    assert m.stats()["internal_bytes"] == 1 * MiB


@pytest.mark.parametrize(("size", "pool", "segment", "blocks"), [
    (1 * MiB, "small", 2 * MiB, [1 * MiB, 1 * MiB]),  # 1 MiB is still small
    (1 * MiB + 1, "large", 20 * MiB, [1 * MiB + 512, 19 * MiB - 512]),  # rounded, then large
    (19 * MiB, "large", 20 * MiB, [20 * MiB]),  # 1 MiB remainder: not split
    (18 * MiB + MiB // 2, "large", 20 * MiB, [18 * MiB + MiB // 2, MiB + MiB // 2]),  # 1.5 MiB: split
    (10 * MiB, "large", 10 * MiB, [10 * MiB]),  # kMinLargeAlloc: exact segment
    (10 * MiB - 1, "large", 10 * MiB, [10 * MiB]),  # rounds up to 10 MiB
    (10 * MiB - 513, "large", 20 * MiB, [10 * MiB - 512, 10 * MiB + 512]),  # below: 20 MiB segment
])
def test_pool_segment_and_split_thresholds(size: int, pool: str, segment: int, blocks: list[int]) -> None:
    m = CachingAllocatorModel(GiB)
    m.malloc(size)
    ((got_pool, got_segment, got_blocks),) = layout(m)
    assert (got_pool, got_segment, [b[1] for b in got_blocks]) == (pool, segment, blocks)


def test_free_merges_only_with_free_neighbours_of_the_same_segment() -> None:
    m = CachingAllocatorModel(GiB)
    a, b = m.malloc(3 * MiB), m.malloc(3 * MiB)
    assert a is not None and b is not None
    m.free(a)
    #   +--------+-------+------------+
    #   | 3 free | 3 (b) | 14 free    |     a's block has no free neighbour
    #   +--------+-------+------------+
    assert [(blk[1], blk[3]) for blk in layout(m)[0][2]] == [
        (3 * MiB, "inactive"), (3 * MiB, "active_allocated"), (14 * MiB, "inactive")]
    m.free(b)  # merges both ways: one whole-free 20 MiB block, releasable
    assert layout(m) == [("large", 20 * MiB, [(0, 20 * MiB, 0, "inactive")])]
    assert m.stats()["releasable_bytes"] == 20 * MiB
    m.check()
    # Two 12 MiB segments adjacent in the address space stay two free blocks.
    m = CachingAllocatorModel(GiB)
    c, d = m.malloc(12 * MiB), m.malloc(12 * MiB)
    s1, s2 = m.segments()
    assert s1.address + s1.size == s2.address
    m.free(c)  # type: ignore[arg-type]
    m.free(d)  # type: ignore[arg-type]
    assert [len(s.blocks) for s in m.segments()] == [1, 1]
    assert m.largest_free_block() == 12 * MiB
    m.check()


def test_best_fit_smallest_block_then_lowest_address() -> None:
    m = CachingAllocatorModel(GiB)
    big = [m.malloc(12 * MiB) for _ in range(2)]  # two exact 12 MiB segments
    seg14 = m.malloc(14 * MiB)
    for addr in (*big, seg14):
        assert addr is not None
        m.free(addr)
    # free blocks: 12 MiB (low address), 12 MiB (higher), 14 MiB
    assert m.malloc(11 * MiB) == big[0]  # 12 fits best; tie resolved by address
    assert m.malloc(11 * MiB) == big[1]
    assert m.malloc(11 * MiB) == seg14


def test_cudamalloc_failure_releases_whole_free_segments_and_retries() -> None:
    m = CachingAllocatorModel(64 * MiB)
    a, b = m.malloc(30 * MiB), m.malloc(30 * MiB)
    assert a is not None and b is not None
    m.free(a)
    c = m.malloc(32 * MiB)  # 60 + 32 > 64: release a's 30 MiB segment, then 30 + 32 fits
    assert c is not None
    s = m.stats()
    assert (s["reserved_bytes"], s["num_alloc_retries"], s["num_device_free"], s["num_ooms"]) == (62 * MiB, 1, 1, 0)


def test_oom_with_enough_total_free_memory() -> None:
    """The seed's paradox in miniature: 24 MiB free, no block of 10 MiB."""
    m = CachingAllocatorModel(40 * MiB)
    a, b, c, d = (m.malloc(8 * MiB) for _ in range(4))
    assert None not in (a, b, c, d)
    m.free(a)  # type: ignore[arg-type]
    m.free(c)  # type: ignore[arg-type]
    #   segment A, 20 MiB              segment B, 20 MiB
    #   +--------+-------+------+      +--------+-------+------+
    #   | 8 free | 8 (b) | 4 fr |      | 8 free | 8 (d) | 4 fr |
    #   +--------+-------+------+      +--------+-------+------+
    assert m.malloc(10 * MiB) is None
    (event,) = m.oom_events
    assert event["total_free_bytes"] == 24 * MiB and event["largest_free_block"] == 8 * MiB
    assert event["enough_total_free"] and event["device_free_bytes"] == 0
    assert event["fragmentation_ratio"] == pytest.approx(1 - 8 / 24)
    s = m.stats()
    assert (s["num_ooms"], s["reserved_bytes"], s["inactive_split_bytes"]) == (1, 40 * MiB, 24 * MiB)
    assert s["reserved_fragmentation_ratio"] == pytest.approx(2 / 3)


def test_max_split_size_keeps_oversize_blocks_whole() -> None:
    m = CachingAllocatorModel(GiB, max_split_size_mb=20)
    a = m.malloc(40 * MiB)
    assert a is not None
    m.free(a)
    b = m.malloc(12 * MiB)  # may not take the oversize 40 MiB block: new segment
    assert b != a and len(m.segments()) == 2
    c = m.malloc(30 * MiB)  # oversize request: 40 < 30 + 20, takes it whole
    assert c == a
    assert [blk[1:3] for blk in layout(m)[0][2]] == [(40 * MiB, 30 * MiB)]
    m.free(c)  # type: ignore[arg-type]
    assert m.malloc(15 * MiB + 1) is not None  # below max_split: not from the 40 MiB block
    assert layout(m)[0][2][0][3] == "inactive"
    big = CachingAllocatorModel(GiB, max_split_size_mb=20)
    x = big.malloc(60 * MiB)
    big.free(x)  # type: ignore[arg-type]
    assert big.malloc(30 * MiB) != x  # 60 >= 30 + 20: too wasteful, new segment
    without = CachingAllocatorModel(GiB)
    y = without.malloc(40 * MiB)
    without.free(y)  # type: ignore[arg-type]
    assert without.malloc(12 * MiB) == y  # default: the 40 MiB block is split


def test_max_split_size_frees_oversize_cached_segments_before_the_full_flush() -> None:
    m = CachingAllocatorModel(50 * MiB, max_split_size_mb=20)
    a = m.malloc(40 * MiB)
    m.free(a)  # type: ignore[arg-type]
    assert m.malloc(12 * MiB) is not None  # 40 + 12 > 50: frees the oversize segment first
    s = m.stats()
    assert (s["reserved_bytes"], s["num_device_free"], s["num_alloc_retries"]) == (12 * MiB, 1, 0)


@pytest.mark.parametrize("bad", [{"max_split_size_mb": 19}, {"roundup_power2_divisions": 3},
                                 {"roundup_power2_divisions": [4] * 15}])
def test_options_are_validated(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        CachingAllocatorModel(GiB, **bad)  # type: ignore[arg-type]


def test_roundup_power2_divisions() -> None:
    assert _roundup_power2_next_division(1200, 4) == 1280  # PyTorch's own example
    m = CachingAllocatorModel(GiB, roundup_power2_divisions=4)
    assert m.round_size(5 * MiB + 1) == 6 * MiB  # steps of 1 MiB between 4 and 8 MiB
    assert m.round_size(1200) == 1536  # not above 512 × 4: plain 512 rounding
    assert CachingAllocatorModel(GiB).round_size(5 * MiB + 1) == 5 * MiB + 512


def test_allocation_sizes() -> None:
    assert [allocation_size(s) for s in (512, MiB, MiB + 512, 10 * MiB - 512, 10 * MiB, 11 * MiB)] == [
        2 * MiB, 2 * MiB, LARGE_BUFFER, LARGE_BUFFER, 10 * MiB, 12 * MiB]


def test_expandable_segments_grow_in_pages_and_unmap_on_empty_cache() -> None:
    m = CachingAllocatorModel(GiB, expandable_segments=True)
    a = m.malloc(3 * MiB)
    #   one large-pool segment reserving 1.125 GiB of address space
    #   +-------+--------+------------------------- unmapped ----------+
    #   | 3 MiB | 17 free| ...                                          |
    #   +-------+--------+-----------------------------------------------+
    ((pool, _, blocks),) = layout(m)
    assert pool == "large" and [(b[1], b[3]) for b in blocks[:2]] == [(3 * MiB, "active_allocated"),
                                                                     (17 * MiB, "inactive")]
    assert blocks[2][3] == "unmapped" and m.reserved_bytes == 20 * MiB
    b = m.malloc(25 * MiB)  # 17 free + one more 20 MiB page, contiguous with a
    assert b == a + 3 * MiB  # type: ignore[operator]
    assert m.reserved_bytes == 40 * MiB
    (snap,) = m.snapshot()  # one mapped range = one segment, as PyTorch reports it
    assert (snap["total_size"], snap["is_expandable"], len(snap["blocks"])) == (40 * MiB, True, 3)
    m.free(a)  # type: ignore[arg-type]
    m.free(b)  # type: ignore[arg-type]
    m.empty_cache()
    assert (m.reserved_bytes, m.segments()) == (0, [])
    m.check()


def test_expandable_segments_unmap_free_pages_and_map_them_elsewhere() -> None:
    m = CachingAllocatorModel(110 * MiB, expandable_segments=True)
    addrs = [m.malloc(20 * MiB) for _ in range(5)]  # one 20 MiB page each
    for addr in addrs[::2]:
        m.free(addr)  # type: ignore[arg-type]
    #   +--------+------+--------+------+--------+--------- unmapped ---
    #   | 20 fr  |  20  | 20 fr  |  20  | 20 fr  |
    #   +--------+------+--------+------+--------+-----------------------
    # 50 MiB: no free run is long enough and 100 + 50 > 110, so the free pages are
    # unmapped (reserved 40) and 60 MiB mapped at the tail, after the last page.
    new = m.malloc(50 * MiB)
    assert new == addrs[4] and m.reserved_bytes == 100 * MiB
    assert [b.state for b in m.segments()[0].blocks] == [
        "unmapped", "active_allocated", "unmapped", "active_allocated", "active_allocated",
        "inactive"]  # the address space, 9/8 × 110 MiB in 20 MiB pages = 140 MiB, ends here
    assert m.oom_events == [] and m.num_alloc_retries == 1
    m.check()


def test_free_of_unknown_address_and_bad_size() -> None:
    m = CachingAllocatorModel(GiB)
    with pytest.raises(ValueError, match="not an allocated address"):
        m.free(1234)
    with pytest.raises(ValueError, match='"size"'):
        m.malloc(0)


def test_snapshot_figures_match_stats() -> None:
    m = CachingAllocatorModel(GiB)
    live = [m.malloc(n) for n in (1000, 3 * MiB, 25 * MiB, 5 * MiB, 700_000)]
    m.free(live[1])  # type: ignore[arg-type]
    s, snap = m.stats(), analyze(m.snapshot())
    for key in ("reserved_bytes", "allocated_bytes", "requested_bytes", "internal_bytes",
                "external_bytes", "inactive_split_bytes", "releasable_bytes"):
        assert getattr(snap, key) == s[key], key
    assert snap.largest_free_bytes == s["largest_free_block"]
    assert snap.fragmentation_ratio == pytest.approx(s["reserved_fragmentation_ratio"])


SIZES = st.one_of(
    st.integers(1, 1 * MiB),  # small pool
    st.integers(1 * MiB + 1, 10 * MiB - 1),  # 20 MiB segments
    st.integers(10 * MiB, 48 * MiB),  # rounded segments
)


class AllocatorMachine(RuleBasedStateMachine):
    """Random malloc/free/empty_cache; every invariant after every step."""

    options: dict[str, object] = {}

    def __init__(self) -> None:
        super().__init__()
        self.m = CachingAllocatorModel(256 * MiB, **self.options)  # type: ignore[arg-type]
        self.live: list[int] = []

    @rule(size=SIZES)
    def malloc(self, size: int) -> None:
        before = len(self.m.oom_events)
        addr = self.m.malloc(size)
        if addr is None:
            assert len(self.m.oom_events) == before + 1
            event = self.m.oom_events[-1]
            if event["pool"] == "large" and not self.options:
                # no cached block fits and no new segment of alloc_size could be made
                assert event["largest_allocatable"] < event["alloc_size"]
        else:
            assert addr not in self.live
            self.live.append(addr)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.m.free(self.live.pop(data.draw(st.integers(0, len(self.live) - 1))))

    @rule()
    def empty_cache(self) -> None:
        self.m.empty_cache()
        assert self.m.releasable_bytes == 0
        if not self.live:
            assert self.m.reserved_bytes == 0

    @invariant()
    def consistent(self) -> None:
        self.m.check()
        s = self.m.stats()
        assert s["allocated_bytes"] + s["inactive_bytes"] == s["reserved_bytes"]
        assert 0 <= s["fragmentation_ratio"] <= 1 and 0 <= s["reserved_fragmentation_ratio"] <= 1
        snap = analyze(self.m.snapshot())
        assert (snap.reserved_bytes, snap.allocated_bytes, snap.requested_bytes) == (
            s["reserved_bytes"], s["allocated_bytes"], s["requested_bytes"])

    def teardown(self) -> None:
        for addr in self.live:
            self.m.free(addr)
        self.m.empty_cache()
        self.m.check()
        assert (self.m.reserved_bytes, self.m.segments()) == (0, [])


class ExpandableMachine(AllocatorMachine):
    options = {"expandable_segments": True}


class MaxSplitMachine(AllocatorMachine):
    options = {"max_split_size_mb": 24}


_settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = _settings
TestExpandableMachine = ExpandableMachine.TestCase
TestExpandableMachine.settings = _settings
TestMaxSplitMachine = MaxSplitMachine.TestCase
TestMaxSplitMachine.settings = _settings


def test_segments_take_a_devices_addresses_and_ties_follow_them() -> None:
    # Two free 20 MiB blocks of equal size: best fit takes the lower address. With the
    # device's addresses the second segment lies lower, so it is the one taken.
    high, low = 0x7F10_0000_0000, 0x7F00_0000_0000
    for given, taken in ((None, 0), ([high, low], 1)):
        m = CachingAllocatorModel(1 << 30, segment_addresses=given)
        first, second = m.malloc(20 * MiB), m.malloc(20 * MiB)
        if given:
            assert (first, second) == (high, low)
        m.free(first)
        m.free(second)
        assert m.malloc(20 * MiB) == (first, second)[taken]
        assert m.malloc(20 * MiB) == (first, second)[1 - taken]
        # the addresses ran out: the next segment lies past every address seen
        fresh = m.malloc(20 * MiB)
        assert fresh is not None and fresh >= max(first, second) + 20 * MiB
