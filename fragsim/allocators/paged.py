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

Each sequence has one ``[requested, blocks]`` entry, so ``free()`` is one dict
pop. ``blocks`` is the sequence's BlockTable while nothing has changed since one
was built (``allocate`` returns one, ``placement`` builds one), and a plain list of
block ids once ``extend`` has appended to it: a decoding sequence takes a block
every ``block_size`` tokens, and rebuilding an immutable table of up to
``max_seq_len / block_size`` ids at every one of them made a long run's growth
quadratic. So ``extend`` appends in place, and ``placement()``, which the GPU side
calls every step, builds the table once per change and caches it in the entry.
What a sequence owns is ``ceil(requested / block_size)`` whole blocks, whichever
form its ids take.

:meth:`PagedAllocator.extend_many` grows many sequences to their new lengths in one
call, all or none: the engine grows every decoding sequence that needs a block each
step, and one call that checks the free count once costs a fraction of one
``extend`` each.
It hands out blocks in exactly the order the same ``extend`` calls one by one would.
"""

from __future__ import annotations

from collections.abc import Sequence

from fragsim.allocators.base import AllocatorCore, BlockTable, whole_blocks

_tuple_new = tuple.__new__


class PagedAllocator(AllocatorCore):
    """Fixed-size blocks from a FIFO free list; a block table per sequence."""

    __slots__ = (
        "block_size",
        "num_blocks",
        "_queue",
        "_head",
        "_seqs",
        "_own_extend",
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
        # seq_id -> [requested slots, BlockTable or list of block ids]: one dict, so
        # free() is one pop (see the module docstring for the two forms)
        self._seqs: dict[int, list] = {}
        # A subclass that checks its extends (vmm: the virtual range) keeps its checks
        # in extend_many, which then goes through its extend.
        self._own_extend = type(self).extend is PagedAllocator.extend

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
        requested = entry[0]
        total = requested + num_slots
        block_size = self.block_size
        missing = -(-total // block_size) + (-requested // block_size)
        if missing > 0:
            head = self._head
            end = head + missing
            queue = self._queue
            if end > len(queue):
                return False
            ids = entry[1]
            if type(ids) is not list:
                ids = entry[1] = list(ids[1])  # a table: its ids, to append to in place
            if missing == 1:
                ids.append(queue[head])
            else:
                ids += queue[head:end]
            self._head = end
        entry[0] = total
        return True

    def extend_many(self, seq_ids: Sequence[int], totals: Sequence[int]) -> list[int] | None:
        """Raise each ``seq_ids[i]``'s requested slots to ``totals[i]``, in order, all of
        them or none (``extend(seq, totals[i] − requested)`` one by one).

        Returns the slots each sequence owns right after its own growth, or None, with
        nothing changed, when the free blocks do not cover them all (the extends one by
        one would then fail at some point). A sequence may be named more than once.
        """
        if not self._own_extend:
            return self._extend_each(seq_ids, totals)
        seqs, block_size = self._seqs, self.block_size
        queue, head = self._queue, self._head
        free_end = len(queue)
        owned: list[int] = []
        before: list[int] = []  # what each growth that ran had requested (to undo it)
        for seq_id, total in zip(seq_ids, totals, strict=True):
            entry = seqs.get(seq_id)
            requested = entry[0] if entry is not None else 0
            if entry is None or total <= requested:
                self._head = head
                self._undo(seq_ids, totals, before)
                if entry is None:
                    raise ValueError(f"extend of unknown sequence {seq_id}")
                raise ValueError(f"num_slots must be >= 1, got {total - requested}")
            blocks = -(-total // block_size)
            missing = blocks + (-requested // block_size)
            if missing > 0:
                if head + missing > free_end:
                    self._head = head
                    self._undo(seq_ids, totals, before)
                    return None
                ids = entry[1]
                if type(ids) is not list:
                    ids = entry[1] = list(ids[1])  # a table: its ids, to append to in place
                if missing == 1:
                    ids.append(queue[head])
                else:
                    ids += queue[head : head + missing]
                head += missing
            before.append(requested)
            entry[0] = total
            owned.append(blocks * block_size)
        self._head = head
        return owned

    def _undo(self, seq_ids: Sequence[int], totals: Sequence[int], before: list[int]) -> None:
        """Take back the growth that ran (the first ``len(before)``), last first: the
        blocks each took return to the head."""
        b = self.block_size
        for i in reversed(range(len(before))):
            entry, requested = self._seqs[seq_ids[i]], before[i]
            taken = -(-totals[i] // b) + (-requested // b)
            if taken > 0:
                del entry[1][-taken:]  # a list: the growth that took them made it one
                self._head -= taken
            entry[0] = requested

    def _extend_each(self, seq_ids: Sequence[int], totals: Sequence[int]) -> list[int] | None:
        """extend_many through a subclass's own extend (its checks kept): the blocks are
        counted first, so that none of the extends can fail once they start."""
        block_size = self.block_size
        after: dict[int, int] = {}  # requested by each sequence once its growth so far ran
        need = 0
        for seq_id, total in zip(seq_ids, totals, strict=True):
            requested = after.get(seq_id, self.num_requested(seq_id))
            after[seq_id] = total
            need += -(-total // block_size) + (-requested // block_size)
        if need > len(self._queue) - self._head:
            return None
        owned = []
        for seq_id, total in zip(seq_ids, totals, strict=True):
            if not self.extend(seq_id, total - self.num_requested(seq_id)):
                raise AssertionError(f"extend of {seq_id} failed with its blocks free")
            owned.append(self.num_owned(seq_id))
        return owned

    def free(self, seq_id: int) -> None:
        try:
            entry = self._seqs.pop(seq_id)
        except KeyError:
            raise ValueError(f"free of unknown sequence {seq_id}") from None
        queue = self._queue
        ids = entry[1]
        queue += ids if type(ids) is list else ids[1]  # a table's block_ids
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
        entry = self._entry(seq_id)
        ids = entry[1]
        if type(ids) is list:  # extended since the last table: build it once, keep it
            ids = entry[1] = _tuple_new(BlockTable, (self.block_size, tuple(ids)))
        return ids

    def _entry(self, seq_id: int) -> list:
        entry = self._seqs.get(seq_id)
        if entry is None:
            raise ValueError(f"unknown sequence {seq_id}")
        return entry

    def num_owned(self, seq_id: int) -> int:
        entry = self._seqs.get(seq_id)
        if entry is None:
            raise ValueError(f"unknown sequence {seq_id}")
        return -(-entry[0] // self.block_size) * self.block_size

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
        for seq_id, (requested, held) in self._seqs.items():
            assert type(held) is list or (isinstance(held, BlockTable)
                                          and held.block_size == self.block_size), (
                f"seq {seq_id}: {held!r} is neither a list of block ids nor a BlockTable "
                f"of block size {self.block_size}"
            )
            ids = held if isinstance(held, list) else held.block_ids
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
