"""Worked examples: every allocator driven through a short script, exact states asserted.

Layout comments draw the pool after the step they follow; ``--`` is free.
"""

from __future__ import annotations

import pytest

from fragsim.allocators import (
    Allocator,
    BlockTable,
    BuddyAllocator,
    ContiguousAllocator,
    Extent,
    PagedAllocator,
    StaticAllocator,
    create,
)


def ext_frag(allocator: Allocator) -> float:
    """The seed's ratio: 1 - largest allocatable / total free."""
    free = allocator.num_free()
    return 1 - allocator.largest_allocatable() / free if free else 0.0


# -- seed 000: external fragmentation ------------------------------------------


@pytest.mark.parametrize("fit", ["first", "best"])
def test_seed000_contiguous_holes_refuse_what_paged_places(fit: str) -> None:
    requests = [(seq_id, 512) for seq_id in range(8)]
    pool = ContiguousAllocator(4096, fit=fit)
    for seq_id, n in requests:
        assert pool.allocate(seq_id, n) == Extent(seq_id * 512, 512)
    for seq_id in (1, 3, 5, 7):
        pool.free(seq_id)
    pool.check()
    # slot/512   0    1    2    3    4    5    6    7
    #            s0   --   s2   --   s4   --   s6   --
    assert pool.holes() == [(512, 512), (1536, 512), (2560, 512), (3584, 512)]
    assert pool.num_free() == 2048
    assert pool.largest_allocatable() == 512
    assert pool.allocate(8, 1024) is None  # 2048 free, nowhere to put 1024
    assert ext_frag(pool) == 1 - 512 / 2048 == 0.75
    pool.check()

    paged = create("paged", 4096, block_size=16)
    for seq_id, n in requests:
        assert paged.allocate(seq_id, n) is not None
    for seq_id in (1, 3, 5, 7):
        paged.free(seq_id)
    assert paged.largest_allocatable() == paged.num_free() == 2048
    assert ext_frag(paged) == 0.0
    assert paged.allocate(8, 1024) is not None  # 64 blocks, wherever they are
    assert paged.num_free() == 1024
    paged.check()


# -- seed 000: internal fragmentation -------------------------------------------


def test_seed000_static_row_of_2048_for_a_300_token_request() -> None:
    pool = create("static", 4 * 2048, max_seq_len=2048)
    assert pool.allocate(0, 100) == Extent(0, 2048)  # the prompt
    for _ in range(200):  # decode, one token a step
        assert pool.extend(0, 1)
    assert pool.num_requested(0) == 300
    assert pool.num_owned(0) == 2048
    assert pool.num_owned(0) - 300 == 1748  # never filled
    assert pool.extend(0, 1748)
    assert not pool.extend(0, 1)  # a row never grows past max_seq_len
    assert pool.num_requested(0) == 2048
    pool.check()


def test_static_takes_lowest_free_entry_and_leftover_is_free_but_unusable() -> None:
    pool = StaticAllocator(4 * 8 + 5, max_seq_len=8)
    # entry   0        1        2        3        leftover
    # slots   [0, 8)   [8, 16)  [16, 24) [24, 32) [32, 37)
    assert pool.num_entries == 4
    assert [pool.allocate(s, 5) for s in range(3)] == [Extent(0, 8), Extent(8, 8), Extent(16, 8)]
    pool.free(1)
    pool.free(0)
    assert pool.free_entries() == [0, 1, 3]
    assert pool.allocate(3, 1) == Extent(0, 8)
    assert pool.allocate(4, 8) == Extent(8, 8)
    assert pool.allocate(5, 9) is None  # longer than a row
    assert (pool.rounded(1), pool.rounded(8), pool.rounded(9)) == (8, 8, 16)
    assert pool.allocate(5, 2) == Extent(24, 8)
    assert pool.allocate(6, 2) is None  # all 4 rows taken; 5 leftover slots free
    assert pool.num_free() == 5
    assert pool.largest_allocatable() == 0
    assert pool.seq_ids() == [2, 3, 4, 5]
    pool.check()


def test_static_max_num_seqs_limits_the_rows() -> None:
    pool = create("static", 10 * 8, max_seq_len=8, max_num_seqs=2)
    assert pool.allocate(0, 1) is not None and pool.allocate(1, 1) is not None
    assert not pool.can_allocate(1)
    assert pool.num_free() == 80 - 16
    pool.check()


# -- contiguous: fit policies and coalescing ------------------------------------


def test_first_fit_and_best_fit_pick_different_holes() -> None:
    pools = {fit: ContiguousAllocator(100, fit=fit) for fit in ("first", "best")}
    for pool in pools.values():
        for seq_id, n in enumerate([10, 30, 10, 20, 10]):
            pool.allocate(seq_id, n)
        pool.free(1)
        pool.free(3)
        # slot/10  0   1   2   3   4   5   6   7   8   9
        #          s0  --  --  --  s2  --  --  s4  --  --
        assert pool.holes() == [(10, 30), (50, 20), (80, 20)]
    assert pools["first"].allocate(9, 20) == Extent(10, 20)  # lowest offset that fits
    assert pools["best"].allocate(9, 20) == Extent(50, 20)  # smallest; 50 before 80
    assert pools["first"].holes() == [(30, 10), (50, 20), (80, 20)]
    assert pools["best"].holes() == [(10, 30), (80, 20)]
    for pool in pools.values():
        pool.check()


def test_contiguous_free_coalesces_both_neighbours() -> None:
    pool = ContiguousAllocator(40)
    for seq_id in range(4):
        pool.allocate(seq_id, 10)
    pool.free(0)
    pool.free(2)
    # s0 free | s1 | s2 free | s3
    assert pool.holes() == [(0, 10), (20, 10)]
    pool.free(1)
    assert pool.holes() == [(0, 30)]
    pool.free(3)
    assert pool.holes() == [(0, 40)]
    pool.check()


def test_contiguous_extend_only_inside_the_extent() -> None:
    pool = ContiguousAllocator(64)
    assert pool.allocate(0, 10) == Extent(0, 10)
    assert pool.extend(0, 10) is False  # not reserved, never grows in place
    assert pool.num_requested(0) == 10
    pool.free(0)
    assert pool.allocate(1, 20) == Extent(0, 20)  # reserve 20 up front ...
    pool.free(1)
    pool.allocate(1, 1)
    assert pool.num_owned(1) == 1
    pool.check()


# -- buddy -----------------------------------------------------------------------


def test_buddy_split_chain_and_full_coalesce() -> None:
    A, B, C, D = range(4)
    pool = BuddyAllocator(16)
    assert pool.free_lists() == {4: [0]}
    assert pool.allocate(A, 3) == Extent(0, 4)
    # 16@0 -> 8@0 + 8@8 -> 4@0 + 4@4;  a = 4@0
    # slot  0 1 2 3 | 4 5 6 7 | 8 ... 15
    #       a a a a | --      | --
    assert pool.free_lists() == {2: [4], 3: [8]}
    assert pool.allocate(B, 1) == Extent(4, 1)
    # 4@4 -> 2@4 + 2@6 -> 1@4 + 1@5
    assert pool.free_lists() == {0: [5], 1: [6], 3: [8]}
    assert pool.allocate(C, 5) == Extent(8, 8)
    assert pool.allocate(D, 2) == Extent(6, 2)
    # slot  0 1 2 3 4 5 6 7 8 ... 15
    #       a a a a b - d d c ... c
    assert pool.free_lists() == {0: [5]}
    assert (pool.num_free(), pool.largest_allocatable()) == (1, 1)
    assert pool.num_owned(A) - pool.num_requested(A) == 1
    pool.check()
    pool.free(B)
    assert pool.free_lists() == {1: [4]}  # #4 and #5 merge; #6 (d) is live
    pool.free(D)
    assert pool.free_lists() == {2: [4]}  # #4 and #6 of order 1 merge; #0 (a) is live
    pool.free(A)
    assert pool.free_lists() == {3: [0]}
    pool.free(C)
    assert pool.free_lists() == {4: [0]}
    pool.check()


def test_buddy_non_power_of_two_capacity_keeps_top_blocks_apart() -> None:
    pool = BuddyAllocator(13)
    # 13 = 8 + 4 + 1:  [0, 8) order 3 | [8, 12) order 2 | [12] order 0
    assert pool.top_blocks() == [(0, 3), (8, 2), (12, 0)]
    assert pool.free_lists() == {0: [12], 2: [8], 3: [0]}
    assert pool.allocate(0, 1) == Extent(12, 1)  # the smallest block that fits
    assert pool.allocate(1, 3) == Extent(8, 4)
    assert pool.allocate(2, 2) == Extent(0, 2)  # 8@0 -> 4@0 + 4@4 -> 2@0 + 2@2
    assert pool.free_lists() == {1: [2], 2: [4]}
    assert (pool.num_free(), pool.largest_allocatable()) == (6, 4)
    assert pool.allocate(3, 5) is None
    pool.free(1)  # 8@2 is a top block: its "buddy" #12 is another tree
    assert pool.free_lists() == {1: [2], 2: [4, 8]}
    pool.free(0)
    pool.free(2)
    assert pool.free_lists() == {0: [12], 2: [8], 3: [0]}
    pool.check()


def test_buddy_min_block_rounds_capacity_and_requests() -> None:
    pool = BuddyAllocator(50, min_block=4)
    assert pool.capacity == 48
    assert pool.top_blocks() == [(0, 5), (32, 4)]
    assert pool.rounded(1) == 4 and pool.rounded(5) == 8
    assert pool.allocate(0, 1) == Extent(32, 4)
    assert pool.free_lists() == {2: [36], 3: [40], 5: [0]}
    pool.check()


# -- paged -------------------------------------------------------------------------


def test_paged_block_tables_and_free_list_order() -> None:
    pool = PagedAllocator(8 * 4 + 3, block_size=4)
    assert (pool.capacity, pool.num_blocks) == (32, 8)
    assert pool.allocate(0, 3) == BlockTable(4, (0,))
    assert pool.allocate(1, 3) == BlockTable(4, (1,))
    assert pool.extend(0, 3)
    # block   0    1    2    3 .. 7
    #         s0   s1   s0   --
    assert pool.block_table(0) == [0, 2]
    assert pool.allocate(2, 9) == BlockTable(4, (3, 4, 5))
    assert pool.extend(1, 1) and pool.block_table(1) == [1]  # 4 tokens, one block
    assert pool.extend(1, 1) and pool.block_table(1) == [1, 6]
    assert pool.free_block_ids() == [7]
    assert pool.allocate(3, 5) is None  # 2 blocks needed, 1 free
    assert pool.extend(2, 4) and pool.block_table(2) == [3, 4, 5, 7]
    assert pool.extend(0, 3) is False  # needs a third block: none, nothing changes
    assert (pool.num_requested(0), pool.block_table(0)) == (6, [0, 2])
    pool.free(0)  # back to the tail, in logical order
    pool.free(2)
    assert pool.free_block_ids() == [0, 2, 3, 4, 5, 7]
    assert pool.allocate(3, 5) == BlockTable(4, (0, 2))
    assert pool.free_block_ids() == [3, 4, 5, 7]
    assert pool.num_free_blocks() == 4
    assert pool.num_owned(1) - pool.num_requested(1) == 3  # the tail of its last block
    assert pool.placement(3).slot(5) == 2 * 4 + 1
    pool.check()
