"""Contiguous allocation: one extent per sequence from a coalescing heap.

The seed's external fragmentation in its plainest form. Free space is a set of
*holes*, maximal runs of free slots; a sequence gets ``num_slots`` slots at the
start of one hole, and its extent never grows (``extend`` succeeds only inside
what ``allocate`` took, so growth must be reserved up front)::

    capacity 16, after allocate(a, 4), allocate(b, 4), allocate(c, 4), free(b)

    slot   0 1 2 3 4 5 6 7 8 9 . . . . . 15
           a a a a . . . . c c c c . . . .
    holes  [4, 8) and [12, 16): 8 free, largest 4, a 5-slot request fails

``fit="first"`` takes the lowest-offset hole that fits; ``fit="best"`` the
smallest hole that fits, ties to the lowest offset. Freeing coalesces with the
holes on both sides, so no two holes ever touch.

Holes live in two dicts, ``start -> size`` and ``end -> start``, so coalescing
is two lookups, and in one index per policy that finds the hole to use
(:mod:`fragsim.allocators.holes`).
"""

from __future__ import annotations

from fragsim.allocators.base import Extent, new_extent
from fragsim.allocators.extents import ExtentBook
from fragsim.allocators.holes import BestFitIndex, FirstFitIndex
from fragsim.allocators.reservation import UPFRONT_POLICIES, check_choice, check_int

FITS = ("first", "best")


class ContiguousAllocator(ExtentBook):
    """One extent per sequence, first or best fit, holes coalesced on free."""

    __slots__ = (
        "fit",
        "_index",
        "_hole_size",
        "_hole_at_end",
        "_extents",
        "_requested",
        "_num_free",
    )

    def __init__(
        self,
        capacity: int,
        *,
        fit: str = "first",
        max_seq_len: int = 2048,
        reserve: str = "max",
        name: str = "contiguous",
    ) -> None:
        self._init_contract(name=name, placement="contiguous",
                            capacity=check_int("capacity", capacity, 1), max_seq_len=max_seq_len,
                            reserve=reserve, reserves=UPFRONT_POLICIES, grows_on_demand=False)
        self.fit = check_choice("fit", fit, FITS)
        self._index = FirstFitIndex() if fit == "first" else BestFitIndex(capacity)
        self._hole_size: dict[int, int] = {0: capacity}
        self._hole_at_end: dict[int, int] = {capacity: 0}
        self._index.add(0, capacity)
        self._extents: dict[int, Extent] = {}
        self._requested: dict[int, int] = {}
        self._num_free = capacity

    def rounded(self, num_slots: int) -> int:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        return num_slots

    def can_allocate(self, num_slots: int) -> bool:
        return self.rounded(num_slots) <= self._index.largest()

    def allocate(self, seq_id: int, num_slots: int) -> Extent | None:
        if seq_id in self._requested:
            raise ValueError(f"sequence {seq_id} is already allocated")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        index = self._index
        offset = index.find(num_slots)
        if offset is None:
            return None
        size = self._hole_size.pop(offset)
        index.remove(offset, size)
        hole_at_end = self._hole_at_end
        if size > num_slots:  # the rest of the hole stays a hole, ending where it did
            rest = offset + num_slots
            self._hole_size[rest] = size - num_slots
            hole_at_end[offset + size] = rest
            index.add(rest, size - num_slots)
        else:
            del hole_at_end[offset + size]
        self._num_free -= num_slots
        return self._record(seq_id, new_extent(offset, num_slots), num_slots)

    def free(self, seq_id: int) -> None:
        extent = self._forget(seq_id)
        start = extent.offset
        end = start + extent.length
        self._num_free += extent.length
        hole_size = self._hole_size
        hole_at_end = self._hole_at_end
        index = self._index
        left = hole_at_end.pop(start, None)
        if left is not None:  # a hole ends where we start: it grows to the right
            index.remove(left, start - left)
            start = left  # its start -> size entry is overwritten below
        right_size = hole_size.pop(end, None)
        if right_size is not None:  # a hole starts where we end: swallow it
            index.remove(end, right_size)
            end += right_size  # its end -> start entry is overwritten below
        hole_size[start] = end - start
        hole_at_end[end] = start
        index.add(start, end - start)

    def num_free(self) -> int:
        return self._num_free

    def largest_allocatable(self) -> int:
        return self._index.largest()

    def holes(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every hole, lowest offset first."""
        return sorted(self._hole_size.items())

    def check(self) -> None:
        holes = self.holes()
        for (offset, size), (next_offset, _) in zip(holes, holes[1:], strict=False):
            assert offset + size < next_offset, (
                f"holes at {offset} (+{size}) and {next_offset} overlap or touch (not coalesced)"
            )
        assert all(size >= 1 for _, size in holes), f"empty hole in {holes}"
        assert self._hole_at_end == {o + s: o for o, s in holes}, (
            "end -> start map disagrees with holes"
        )
        self._index.check(holes)
        assert self._requested.keys() == self._extents.keys(), "requested and extents disagree"
        runs = sorted(holes + [(e.offset, e.length) for e in self._extents.values()])
        position = 0
        for offset, size in runs:
            assert offset == position, f"slot {min(offset, position)} is free and live, or neither"
            position = offset + size
        assert position == self.capacity, (
            f"holes and extents end at {position}, not {self.capacity}"
        )
        free = sum(size for _, size in holes)
        assert self._num_free == free, f"free counter {self._num_free} != {free} slots in holes"
        for seq_id, requested in self._requested.items():
            owned = self._extents[seq_id].length
            assert 1 <= requested <= owned, f"seq {seq_id}: requested {requested} > owned {owned}"
