"""Random allocate/extend/free sequences against an independent shadow model.

For each allocator a hypothesis state machine keeps a *shadow*: per live
sequence, the set of slots its placement covers and the slots it asked for.
From the shadow alone (a boolean array of free slots, and for paged a FIFO
queue of block ids) the test recomputes what the allocator must do:

    static       a request fits iff it is <= max_seq_len and a row is free;
                 it lands on the lowest free row
    contiguous   largest_allocatable == the longest run of free slots; first fit
                 lands on the first run that fits, best fit on the shortest
    buddy        largest_allocatable == the largest aligned free power-of-two
                 block inside one top-level block; the request lands on the
                 smallest such maximal block that fits, lowest offset first
    paged        a request fits iff enough blocks are free; it gets the head
                 of the FIFO free list

and checks every step: ``check()``, disjoint shadows, owned counts from the
rounding rules, free + owned == capacity. Freeing everything must give back
the initial pool.

Example counts follow the loaded hypothesis profile: ``ci`` (and the default)
run a few hundred examples per allocator; ``--hypothesis-profile=long`` ten
times more. The profiles are registered here only when nobody has registered
them already, so another module's settings are never overwritten.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from fragsim.allocators import Allocator, BlockTable, Extent, create
from fragsim.allocators.holes import FirstFitIndex

for _name, _examples in (("ci", 200), ("long", 2000)):
    try:
        settings.get_profile(_name)
    except InvalidArgument:
        settings.register_profile(_name, max_examples=_examples, deadline=None)

LONG = settings.get_current_profile_name() == "long"
MACHINE_SETTINGS = settings(
    max_examples=2000 if LONG else 200,
    stateful_step_count=80 if LONG else 40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

#: label -> (factory, largest request drawn)
CASES: dict[str, tuple[Callable[[], Allocator], int]] = {
    "static": (lambda: create("static", 6 * 8 + 3, max_seq_len=8), 10),
    "static-max-num-seqs": (lambda: create("static", 6 * 8, max_seq_len=8, max_num_seqs=4), 8),
    "contiguous-first": (lambda: create("contiguous", 64, fit="first"), 20),
    "contiguous-best": (lambda: create("contiguous", 64, fit="best"), 20),
    "buddy": (lambda: create("buddy", 64), 20),
    "buddy-non-pow2": (lambda: create("buddy", 45), 20),
    "buddy-min-block": (lambda: create("buddy", 50, min_block=4), 20),
    "paged": (lambda: create("paged", 16 * 4 + 3, block_size=4), 20),
}


def next_pow2(n: int) -> int:
    size = 1
    while size < n:
        size *= 2
    return size


def slots_of(placement: Extent | BlockTable) -> set[int]:
    if isinstance(placement, Extent):
        return set(range(placement.offset, placement.offset + placement.length))
    size = placement.block_size
    return {b * size + i for b in placement.block_ids for i in range(size)}


def free_runs(free: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs of free slots as (offset, length), lowest offset first."""
    runs, start = [], None
    for i, is_free in enumerate([*free, False]):
        if is_free and start is None:
            start = i
        elif not is_free and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def buddy_free_blocks(free: list[bool], capacity: int, min_block: int) -> list[tuple[int, int]]:
    """(size, offset) of the maximal aligned all-free blocks, never crossing a top block."""
    blocks = []
    base = 0
    for bit in reversed(range(capacity.bit_length())):
        top = 1 << bit
        if not capacity & top:
            continue

        def walk(offset: int, size: int) -> None:
            if all(free[offset : offset + size]):
                blocks.append((size, offset))
            elif size > min_block:
                walk(offset, size // 2)
                walk(offset + size // 2, size // 2)

        walk(base, top)
        base += top
    return blocks


class AllocatorMachine(RuleBasedStateMachine):
    """Shared rules; ``make`` and ``max_request`` come from the parametrised subclass."""

    make: Callable[[], Allocator]
    max_request: int
    #: Any: the shadow reads each placement's own extras (free_lists, block_size, ...)
    pool: Any

    @initialize()
    def start(self) -> None:
        self.pool = type(self).make()
        self.kind = self.pool.placement_name
        self.slots: dict[int, set[int]] = {}
        self.requested: dict[int, int] = {}
        self.next_id = 0
        if self.kind == "paged":
            self.queue = deque(range(self.pool.num_blocks))
        self.initial = self.snapshot()

    # -- what the shadow says ----------------------------------------------

    def free_slots(self) -> list[bool]:
        free = [True] * self.pool.capacity
        for slots in self.slots.values():
            for slot in slots:
                free[slot] = False
        return free

    def expected_owned(self, requested: int) -> int:
        pool = self.pool
        if self.kind == "static":
            return pool.max_seq_len
        if self.kind == "buddy":
            return max(pool.min_block, next_pow2(requested))
        if self.kind == "paged":
            size = pool.block_size
            return -(-requested // size) * size
        return requested

    def expected_largest(self) -> int:
        free = self.free_slots()
        if self.kind == "static":
            return self.pool.max_seq_len if len(self.slots) < self.pool.num_entries else 0
        if self.kind == "contiguous":
            return max((length for _, length in free_runs(free)), default=0)
        if self.kind == "buddy":
            blocks = buddy_free_blocks(free, self.pool.capacity, self.pool.min_block)
            return max((size for size, _ in blocks), default=0)
        return len(self.queue) * self.pool.block_size

    def expected_placement(self, n: int) -> int | tuple[int, ...] | None:
        """Offset (or block ids) the allocator must choose for ``n`` slots; None: must fail."""
        pool = self.pool
        free = self.free_slots()
        if self.kind == "static":
            used = {min(slots) // pool.max_seq_len for slots in self.slots.values()}
            rows = [r for r in range(pool.num_entries) if r not in used]
            return rows[0] * pool.max_seq_len if rows and n <= pool.max_seq_len else None
        if self.kind == "contiguous":
            runs = [(length, offset) for offset, length in free_runs(free) if length >= n]
            if not runs:
                return None
            if pool.fit == "first":
                return min(offset for _, offset in runs)
            return min(runs)[1]
        if self.kind == "buddy":
            need = self.expected_owned(n)
            blocks = buddy_free_blocks(free, pool.capacity, pool.min_block)
            fitting = [block for block in blocks if block[0] >= need]
            return min(fitting)[1] if fitting else None
        count = -(-n // pool.block_size)
        return tuple(list(self.queue)[:count]) if count <= len(self.queue) else None

    def snapshot(self) -> object:
        pool = self.pool
        if self.kind == "contiguous":
            return pool.holes()
        if self.kind == "buddy":
            return pool.free_lists()
        if self.kind == "paged":
            return sorted(pool.free_block_ids())
        return pool.free_entries()

    # -- rules ---------------------------------------------------------------

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(1, type(self).max_request), label="num_slots")
        seq_id = self.next_id
        self.next_id += 1
        want = self.expected_placement(n)
        assert self.pool.can_allocate(n) == (want is not None)
        placement = self.pool.allocate(seq_id, n)
        if want is None:
            assert placement is None, f"allocate({n}) should fail, got {placement}"
            return
        assert placement is not None, f"allocate({n}) failed; expected {want}"
        if isinstance(placement, BlockTable):
            assert placement.block_ids == want
            for _ in want:
                self.queue.popleft()
        else:
            assert placement.offset == want
        slots = slots_of(placement)
        for other_id, other in self.slots.items():
            assert slots.isdisjoint(other), f"seq {seq_id} overlaps seq {other_id}"
        assert len(slots) == self.expected_owned(n) == self.pool.num_owned(seq_id)
        assert placement == self.pool.placement(seq_id)
        self.slots[seq_id] = slots
        self.requested[seq_id] = n

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.slots)), label="seq_id")
        k = data.draw(st.integers(1, 12), label="num_slots")
        total = self.requested[seq_id] + k
        before = self.pool.placement(seq_id)
        if self.pool.grows_on_demand:
            extra = self.expected_owned(total) // self.pool.block_size - len(before.block_ids)
            ok = extra <= len(self.queue)
        else:
            ok = total <= len(self.slots[seq_id])
        assert self.pool.extend(seq_id, k) == ok
        after = self.pool.placement(seq_id)
        if not ok:
            assert after == before and self.pool.num_requested(seq_id) == total - k
            return
        self.requested[seq_id] = total
        if isinstance(after, BlockTable):
            assert isinstance(before, BlockTable)
            new_blocks = after.block_ids[len(before.block_ids) :]
            assert after.block_ids[: len(before.block_ids)] == before.block_ids
            assert new_blocks == tuple(self.queue.popleft() for _ in range(extra))
            slots = slots_of(after)
            for other_id, other in self.slots.items():
                assert other_id == seq_id or slots.isdisjoint(other), (
                    f"{seq_id} grew into {other_id}"
                )
            self.slots[seq_id] = slots
        else:
            assert after == before  # contiguous placements never move or grow
        assert self.pool.num_owned(seq_id) == len(self.slots[seq_id])
        assert self.pool.num_owned(seq_id) == max(
            self.expected_owned(total), self.expected_owned(total - k)
        )

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.free_one(data.draw(st.sampled_from(sorted(self.slots)), label="seq_id"))

    @precondition(lambda self: self.slots)
    @rule()
    def free_everything(self) -> None:
        for seq_id in list(self.slots):
            self.free_one(seq_id)
        self.pool.check()
        assert self.snapshot() == self.initial
        assert self.pool.num_free() == self.pool.capacity
        assert self.pool.seq_ids() == []

    def free_one(self, seq_id: int) -> None:
        placement = self.pool.placement(seq_id)
        self.pool.free(seq_id)
        if isinstance(placement, BlockTable):
            self.queue.extend(placement.block_ids)
        del self.slots[seq_id]
        del self.requested[seq_id]

    # -- invariants ------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        pool = self.pool
        pool.check()
        owned = sum(len(slots) for slots in self.slots.values())
        assert pool.num_free() + owned == pool.capacity
        assert sorted(pool.seq_ids()) == sorted(self.slots)
        for seq_id, requested in self.requested.items():
            assert pool.num_requested(seq_id) == requested <= pool.num_owned(seq_id)
        assert pool.largest_allocatable() == self.expected_largest()


@pytest.mark.parametrize("case", sorted(CASES))
def test_allocator_state_machine(case: str) -> None:
    make, max_request = CASES[case]
    machine = type(
        f"{case.title().replace('-', '')}Machine",
        (AllocatorMachine,),
        {"make": staticmethod(make), "max_request": max_request},
    )
    run_state_machine_as_test(machine, settings=MACHINE_SETTINGS)


@settings(max_examples=1000 if LONG else 100, deadline=None)
@given(
    chunk=st.integers(1, 4),
    fill=st.lists(st.tuples(st.integers(0, 199), st.integers(1, 30)), max_size=60),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 199), st.integers(1, 30)), max_size=100),
)
def test_first_fit_index_matches_a_sorted_list(
    chunk: int, fill: list[tuple[int, int]], ops: list[tuple[bool, int, int]]
) -> None:
    """Tiny chunks, so that splits happen that a 64-slot pool never needs."""
    index = FirstFitIndex(chunk)
    holes: dict[int, int] = {}
    for add, offset, size in [(True, o, s) for o, s in fill] + ops:
        if add and offset not in holes:
            holes[offset] = size
            index.add(offset, size)
        elif not add and holes:
            victim = sorted(holes)[offset % len(holes)]
            index.remove(victim, holes.pop(victim))
        index.check(sorted(holes.items()))
        fitting = [o for o, s in holes.items() if s >= size]
        assert index.find(size) == (min(fitting) if fitting else None)
        assert index.largest() == max(holes.values(), default=0)


def test_first_fit_index_splits_and_rechunks() -> None:
    index = FirstFitIndex(chunk=4)
    for offset in range(0, 400, 10):
        index.add(offset, offset // 10 + 1)
    # appending past 2 * 4 holes splits off the last chunk's upper part
    assert index.starts == [
        [0, 10, 20, 30],
        [40, 50, 60, 70],
        [80, 90, 100, 110],
        [120, 130, 140, 150],
        [160, 170, 180, 190],
        [200, 210, 220, 230],
        [240, 250, 260, 270],
        [280, 290, 300, 310],
        [320, 330, 340, 350, 360, 370, 380, 390],
    ]
    for chunk in [list(c) for c in index.starts]:
        for offset in chunk[1:]:
            index.remove(offset, offset // 10 + 1)
    assert index.starts == [[0], [40], [80], [120], [160], [200], [240], [280], [320]]
    assert index.maxima == [1, 5, 9, 13, 17, 21, 25, 29, 33]
    # emptying a chunk leaves 8 chunks for 8 holes, over 2 * 8 / 4 + 2 = 6: lay out again
    index.remove(0, 1)
    assert index.starts == [[40, 80, 120, 160], [200, 240, 280, 320]]
    assert (index.firsts, index.maxima) == ([40, 200], [17, 33])
    index.check([(o, o // 10 + 1) for o in range(40, 360, 40)])


@settings(max_examples=150, deadline=None)
@given(block_size=st.sampled_from([1, 4, 16]),
       prompts=st.lists(st.integers(1, 40), min_size=1, max_size=8),
       grows=st.lists(st.tuples(st.integers(0, 7), st.integers(1, 20)), min_size=1, max_size=12),
       capacity_blocks=st.integers(4, 60))
def test_paged_extend_many_is_the_extends_one_by_one(block_size: int, prompts: list[int],
                                                     grows: list[tuple[int, int]],
                                                     capacity_blocks: int) -> None:
    """The engine's batched growth: the same blocks in the same order as extends one by
    one, or None with nothing changed when they would run out."""
    def fresh() -> Any:
        a = create("paged", capacity_blocks * block_size, block_size=block_size, max_seq_len=4096)
        live = [i for i, p in enumerate(prompts) if a.allocate(i, p) is not None]
        return a, live

    batched, live = fresh()
    one_by_one, _ = fresh()
    if not live:
        return
    seqs = [live[i % len(live)] for i, _ in grows]
    slots = [n for _, n in grows]
    before = ({s: batched.placement(s) for s in live}, batched.free_block_ids())
    totals, requested = [], {s: batched.num_requested(s) for s in live}
    for s, n in zip(seqs, slots, strict=True):
        requested[s] += n
        totals.append(requested[s])
    result = batched.extend_many(seqs, totals)
    owned_after: list[int] = []
    ok = True
    for s, n in zip(seqs, slots, strict=True):
        if not one_by_one.extend(s, n):
            ok = False
            break
        owned_after.append(one_by_one.num_owned(s))
    if result is None:
        assert not ok
        assert ({s: batched.placement(s) for s in live}, batched.free_block_ids()) == before
    else:
        assert ok
        assert {s: batched.placement(s) for s in live} == {s: one_by_one.placement(s) for s in live}
        assert batched.free_block_ids() == one_by_one.free_block_ids()
        assert result == owned_after
    batched.check()
