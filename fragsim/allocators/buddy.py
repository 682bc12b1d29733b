"""Binary buddy allocation, as Orca's reservation is modelled in the vLLM paper.

A block of *order* ``k`` is ``2**k`` slots at an offset that is a multiple of
``2**k``. A request of ``n`` slots owns ``max(min_block, next_pow2(n))``.

The pool is covered by *top-level blocks*, the binary decomposition of
``capacity`` from offset 0, each its own buddy tree (never merged across)::

    capacity 13 = 0b1101 -> order 3 at 0, order 2 at 8, order 0 at 12

    slot   0 1 2 3 4 5 6 7 | 8 9 10 11 | 12
           order 3         | order 2   | order 0

Every top-level base is a multiple of its own size (it is a sum of larger
powers of two), so the buddy arithmetic below works on absolute offsets. The
top-level block holding offset ``o`` has order ``(o ^ capacity).bit_length() - 1``:
the highest bit where ``o`` and ``capacity`` differ is one that ``capacity``
has and ``o`` lacks, and it is the size of the block ``o`` falls in (``o = 9``:
``9 ^ 13 = 0b0100``, order 2, the block at 8).

The buddy of the block at ``offset`` of order ``k`` is::

    buddy = offset ^ (1 << k)

If the block is #8 of order 1, its buddy is #10; merged, they are #8 of order 2,
whose buddy is #12 (``8 ^ 4``); #12 of order 2 has buddy #8. The merged block
starts at ``offset & ~(1 << k)``, the lower of the two.

allocate takes the smallest free block of order >= the one needed, lowest
offset first, and splits it down, keeping the lower half and freeing the upper
half at each order::

    capacity 16, allocate(a, 3): need order 2; only order 4 at 0 is free
    split 16@0 -> 8@0 + free 8@8;  split 8@0 -> 4@0 + free 4@4;  a owns 4@0
    free lists: order 2 [4], order 3 [8]

free coalesces with the buddy while the buddy is free at the same order and the
merged block stays inside its top-level block; so no free block ever has a free
buddy of its order (``check`` asserts it).

Free lists are sorted lists of negated offsets, so the lowest offset is at the
end (``pop()``) and any block can be removed by ``bisect``; a bit mask of
non-empty orders finds the smallest usable order without a loop.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from fragsim.allocators.base import Extent, new_extent
from fragsim.allocators.extents import ExtentBook
from fragsim.allocators.reservation import UPFRONT_POLICIES, check_int


class BuddyAllocator(ExtentBook):
    """Binary buddy system over ``capacity`` slots (see the module docstring)."""

    __slots__ = (
        "min_block",
        "_min_order",
        "_free_lists",
        "_free_order",
        "_nonempty",
        "_extents",
        "_requested",
        "_num_free",
    )

    def __init__(
        self,
        capacity: int,
        *,
        min_block: int = 1,
        max_seq_len: int = 2048,
        reserve: str = "max",
        name: str = "buddy",
    ) -> None:
        check_int("capacity", capacity, 1)
        check_int("min_block", min_block, 1)
        if min_block & (min_block - 1):
            raise ValueError(f"min_block must be a power of two, got {min_block}")
        if capacity < min_block:
            raise ValueError(f"capacity must be >= min_block={min_block}, got {capacity}")
        # NOTE: blocks smaller than min_block could never be handed out, so the
        # pool is the capacity rounded down to whole min_blocks (as paged does).
        self._init_contract(name=name, placement="buddy", capacity=capacity - capacity % min_block,
                            max_seq_len=max_seq_len, reserve=reserve, reserves=UPFRONT_POLICIES,
                            grows_on_demand=False)
        self.min_block = min_block
        self._min_order = min_block.bit_length() - 1
        top_order = self.capacity.bit_length() - 1
        self._free_lists: list[list[int]] = [[] for _ in range(top_order + 1)]
        self._free_order: dict[int, int] = {}
        self._nonempty = 0
        self._extents: dict[int, Extent] = {}
        self._requested: dict[int, int] = {}
        self._num_free = self.capacity
        for offset, order in self.top_blocks():
            self._push(offset, order)

    def top_blocks(self) -> list[tuple[int, int]]:
        """``(offset, order)`` of the top-level blocks, largest (lowest offset) first."""
        blocks = []
        offset = 0
        for order in range(self.capacity.bit_length() - 1, -1, -1):
            if self.capacity >> order & 1:
                blocks.append((offset, order))
                offset += 1 << order
        return blocks

    def _push(self, offset: int, order: int) -> None:
        insort(self._free_lists[order], -offset)
        self._free_order[offset] = order
        self._nonempty |= 1 << order

    def _remove(self, offset: int, order: int) -> None:
        free_list = self._free_lists[order]
        del free_list[bisect_left(free_list, -offset)]
        del self._free_order[offset]
        if not free_list:
            self._nonempty &= ~(1 << order)

    def _order_for(self, num_slots: int) -> int:
        order = (num_slots - 1).bit_length()
        return order if order > self._min_order else self._min_order

    def rounded(self, num_slots: int) -> int:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        return 1 << self._order_for(num_slots)

    def can_allocate(self, num_slots: int) -> bool:
        return self.rounded(num_slots) <= self.largest_allocatable()

    def allocate(self, seq_id: int, num_slots: int) -> Extent | None:
        if seq_id in self._requested:
            raise ValueError(f"sequence {seq_id} is already allocated")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        need = self._order_for(num_slots)
        usable = self._nonempty >> need << need
        if not usable:
            return None
        order = (usable & -usable).bit_length() - 1
        free_list = self._free_lists[order]
        offset = -free_list.pop()
        del self._free_order[offset]
        if not free_list:
            self._nonempty &= ~(1 << order)
        while order > need:
            order -= 1
            self._push(offset + (1 << order), order)
        size = 1 << need
        self._num_free -= size
        return self._record(seq_id, new_extent(offset, size), num_slots)

    def free(self, seq_id: int) -> None:
        extent = self._forget(seq_id)
        offset = extent.offset
        size = extent.length
        self._num_free += size
        order = size.bit_length() - 1
        top_order = (offset ^ self.capacity).bit_length() - 1
        free_order = self._free_order
        while order < top_order:
            buddy = offset ^ (1 << order)
            if free_order.get(buddy) != order:
                break
            self._remove(buddy, order)
            offset &= ~(1 << order)
            order += 1
        self._push(offset, order)

    def num_free(self) -> int:
        return self._num_free

    def largest_allocatable(self) -> int:
        return 1 << (self._nonempty.bit_length() - 1) if self._nonempty else 0

    def free_lists(self) -> dict[int, list[int]]:
        """Free block offsets per order (non-empty orders only), lowest offset first."""
        return {
            order: [-key for key in reversed(keys)]
            for order, keys in enumerate(self._free_lists)
            if keys
        }

    def check(self) -> None:
        capacity = self.capacity
        blocks = [
            (offset, order, "free")
            for order, offsets in self.free_lists().items()
            for offset in offsets
        ]
        blocks += [
            (e.offset, e.length.bit_length() - 1, f"seq {s}") for s, e in self._extents.items()
        ]
        for order, keys in enumerate(self._free_lists):
            assert keys == sorted(set(keys)), f"free list of order {order} unsorted or duplicated"
            assert bool(keys) == bool(self._nonempty >> order & 1), (
                f"non-empty mask wrong at order {order}"
            )
        assert self._nonempty >> len(self._free_lists) == 0, (
            "non-empty mask has orders past the top"
        )
        want_orders = {offset: order for offset, order, what in blocks if what == "free"}
        assert self._free_order == want_orders, "offset -> order map disagrees with the free lists"
        for seq_id, extent in self._extents.items():
            assert extent.length & (extent.length - 1) == 0 and extent.length >= self.min_block, (
                f"seq {seq_id} owns {extent.length} slots, not a power of two >= {self.min_block}"
            )
        for offset, order, what in blocks:
            size = 1 << order
            assert 0 <= offset < capacity, f"{what} block {offset} outside the pool"
            assert offset % size == 0, (
                f"{what} block {offset} of order {order} not aligned to {size}"
            )
            top_order = (offset ^ capacity).bit_length() - 1
            assert order <= top_order, (
                f"{what} block {offset} of order {order} crosses its top-level block of order {top_order}"
            )
            if what == "free" and order < top_order:
                buddy = offset ^ size
                assert self._free_order.get(buddy) != order, (
                    f"free blocks {offset} and {buddy} of order {order} are buddies, not coalesced"
                )
        position = 0
        for offset, order, what in sorted(blocks):
            assert offset == position, (
                f"{what} block at {offset}: slots from {position} overlap or are lost"
            )
            position = offset + (1 << order)
        assert position == capacity, f"blocks end at {position}, not {capacity}"
        free = sum(1 << order for _, order, what in blocks if what == "free")
        assert self._num_free == free, (
            f"free counter {self._num_free} != {free} slots in free blocks"
        )
        for seq_id, requested in self._requested.items():
            owned = self._extents[seq_id].length
            assert 1 <= requested <= owned, f"seq {seq_id}: requested {requested} > owned {owned}"
        assert self._requested.keys() == self._extents.keys(), "requested and extents disagree"
