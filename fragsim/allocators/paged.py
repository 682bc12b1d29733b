"""Paged allocation: vLLM's PagedAttention block manager.

The pool is ``num_blocks = capacity // block_size`` blocks of ``block_size`` slots
(the remainder is not part of the pool). A sequence holds a *block table*, its
physical blocks in logical order; any free block will do, so there is no
external fragmentation, and the only waste is the unfilled tail of the last
block (at most ``block_size - 1`` slots per sequence)::

    block_size 4: allocate(a, 3), allocate(b, 3), extend(a, 3)
    block    0       1       2       3
    slots    a a a a b b b . a a . . . . . .
    a.block_table = [0, 2]      b.block_table = [1]

The free list is a FIFO queue, as in vLLM: ``allocate``/``extend`` take blocks
from the head, ``free`` appends a sequence's blocks to the tail in logical
order. A fresh pool hands out 0, 1, 2, ...; after the example above, ``free(a)``
makes the queue ``[3, 0, 2]``. (vLLM appends in reverse, so that a sequence's
tail, the least likely to be a shared cached prefix, is reused first; with no
prefix caching here that buys nothing, and logical order is one slice cheaper.)
FIFO rather than LIFO spreads reuse over the whole pool, as the real system does.

The queue is a list and a head index rather than a deque: taking ``k`` blocks is
one slice, which keeps allocate O(1) per block at C speed. The consumed prefix
is dropped once it is more than half the list, so memory stays O(num_blocks).
Each sequence's BlockTable is built when its blocks change and kept beside its
requested count in one ``[requested, table]`` entry, so ``placement()``, which the
GPU side calls every step, costs nothing, and ``free()`` is one dict pop.
"""

from __future__ import annotations

from fragsim.allocators.base import AllocatorCore, BlockTable, new_block_table, whole_blocks

_tuple_new = tuple.__new__


class PagedAllocator(AllocatorCore):
    """Fixed-size blocks from a FIFO free list; a block table per sequence."""

    __slots__ = (
        "block_size",
        "num_blocks",
        "_queue",
        "_head",
        "_seqs",
    )

    def __init__(
        self,
        capacity: int,
        *,
        block_size: int = 16,
        max_seq_len: int = 2048,
        reserve: str = "demand",
        name: str = "paged",
    ) -> None:
        self.num_blocks = whole_blocks(capacity, block_size)
        self.block_size = block_size
        self._init_contract(name=name, placement="paged", capacity=self.num_blocks * block_size,
                            max_seq_len=max_seq_len, reserve=reserve, reserves=("demand",),
                            grows_on_demand=True)
        self._queue: list[int] = list(range(self.num_blocks))
        self._head = 0  # free blocks are self._queue[self._head:]
        # seq_id -> [requested slots, block table]: one dict, so free() is one pop
        self._seqs: dict[int, list] = {}

    def rounded(self, num_slots: int) -> int:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        return -(-num_slots // self.block_size) * self.block_size

    def can_allocate(self, num_slots: int) -> bool:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        return -(-num_slots // self.block_size) <= len(self._queue) - self._head

    def allocate(self, seq_id: int, num_slots: int) -> BlockTable | None:
        seqs = self._seqs
        if seq_id in seqs:
            raise ValueError(f"sequence {seq_id} is already allocated")
        head = self._head
        block_size = self.block_size
        end = head - (-num_slots // block_size)
        queue = self._queue
        if end > len(queue) or end <= head:
            if num_slots < 1:
                raise ValueError(f"num_slots must be >= 1, got {num_slots}")
            return None
        self._head = end
        # new_block_table(), inlined: this is the hottest line of a paged run.
        table = _tuple_new(BlockTable, (block_size, tuple(queue[head:end])))
        seqs[seq_id] = [num_slots, table]
        return table

    def extend(self, seq_id: int, num_slots: int) -> bool:
        entry = self._seqs.get(seq_id)
        if entry is None:
            raise ValueError(f"extend of unknown sequence {seq_id}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        requested, table = entry
        total = requested + num_slots
        missing = -(-total // self.block_size) - len(table.block_ids)
        if missing > 0:
            head = self._head
            end = head + missing
            if end > len(self._queue):
                return False
            entry[1] = new_block_table(
                self.block_size, table.block_ids + tuple(self._queue[head:end])
            )
            self._head = end
        entry[0] = total
        return True

    def free(self, seq_id: int) -> None:
        try:
            entry = self._seqs.pop(seq_id)
        except KeyError:
            raise ValueError(f"free of unknown sequence {seq_id}") from None
        queue = self._queue
        queue += entry[1][1]  # the table's block_ids
        head = self._head
        if head > 1024 and head > len(queue) >> 1:
            del queue[:head]
            self._head = 0

    def num_free_blocks(self) -> int:
        return len(self._queue) - self._head

    def num_free(self) -> int:
        return (len(self._queue) - self._head) * self.block_size

    def largest_allocatable(self) -> int:
        return (len(self._queue) - self._head) * self.block_size

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's physical block ids, in logical order (a new list)."""
        return list(self.placement(seq_id).block_ids)

    def free_block_ids(self) -> list[int]:
        """Free blocks in the order allocate() will take them (a new list)."""
        return self._queue[self._head :]

    def placement(self, seq_id: int) -> BlockTable:
        return self._entry(seq_id)[1]

    def _entry(self, seq_id: int) -> list:
        entry = self._seqs.get(seq_id)
        if entry is None:
            raise ValueError(f"unknown sequence {seq_id}")
        return entry

    def num_owned(self, seq_id: int) -> int:
        return len(self._entry(seq_id)[1].block_ids) * self.block_size

    def num_requested(self, seq_id: int) -> int:
        return self._entry(seq_id)[0]

    def seq_ids(self) -> list[int]:
        """Live sequences in the order they were allocated."""
        return list(self._seqs)

    def check(self) -> None:
        free = self.free_block_ids()
        assert 0 <= self._head <= len(self._queue), f"free-list head {self._head} out of range"
        assert len(set(free)) == len(free), f"free list has duplicates: {sorted(free)}"
        seen = set(free)
        owned = 0
        for seq_id, (requested, table) in self._seqs.items():
            ids = table.block_ids
            assert isinstance(table, BlockTable) and table.block_size == self.block_size, (
                f"seq {seq_id}: table {table!r} is not a BlockTable of block size {self.block_size}"
            )
            shared = seen.intersection(ids)
            assert not shared and len(set(ids)) == len(ids), (
                f"seq {seq_id}: blocks {sorted(shared) or ids} are also free or held twice"
            )
            seen.update(ids)
            want = -(-requested // self.block_size)
            assert len(ids) == want, (
                f"seq {seq_id}: {len(ids)} blocks for {requested} slots, want {want}"
            )
            owned += len(ids) * self.block_size
        assert seen == set(range(self.num_blocks)), (
            f"blocks neither free nor held: {sorted(set(range(self.num_blocks)) - seen)}; "
            f"unknown blocks: {sorted(seen - set(range(self.num_blocks)))}"
        )
        assert self.num_free() + owned == self.capacity, "free + owned != capacity"
