"""Uniform blocks for every attention layer, and a state slot per sequence.

One paged pool of blocks, each holding every attention group's K and V for its
tokens (so every attention group takes the same blocks of a sequence), and an
array of state slots carved out up front, each running sequence taking one; an
unused slot is free memory only a state can use.
"""

from __future__ import annotations

import numpy as np

from fragsim.hybrid.groups import Group
from fragsim.hybrid.pools.base import IdPool


class UniformPool(IdPool):
    """A FIFO queue of uniform blocks beside a list of state slots."""

    largest_is_free = False
    unit_name = "block, then state slot"

    def __init__(self, groups: tuple[Group, ...], capacity: int, *, num_blocks: int, block_bytes: int,
                 num_slots: int) -> None:
        super().__init__(groups, capacity)
        self.num_blocks, self.block_bytes, self.num_slots = num_blocks, block_bytes, num_slots
        self._attention = [i for i, g in enumerate(groups) if not g.is_state]
        self._states = [i for i, g in enumerate(groups) if g.is_state]
        self.slot_bytes = sum(groups[i].block_bytes for i in self._states)
        self._queue = list(range(num_blocks))
        self._head = 0
        self._state_free = list(range(num_slots))
        self._blocks: dict[int, list[int]] = {}
        self._slot: dict[int, int] = {}

    def num_free_blocks(self) -> int:
        return len(self._queue) - self._head

    def num_free_slots(self) -> int:
        return len(self._state_free)

    def used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks()

    def _takes(self, takes: list[int]) -> tuple[int, int]:
        """Uniform blocks and state slots of a sequence's takes per group."""
        blocks = max((takes[i] for i in self._attention), default=0)
        states = max((takes[i] for i in self._states), default=0)
        return blocks, states

    def place(self, seq: int, frees: list[int], takes: list[int]) -> bool:
        assert not any(frees), "paged-uniform frees no block before the sequence ends"
        blocks, states = self._takes(takes)
        if blocks > self.num_free_blocks() or states > len(self._state_free):
            return False
        if blocks:
            self._take_blocks(seq, blocks)
        if states:
            self._slot[seq] = self._state_free.pop(0)
        return True

    def _take_blocks(self, seq: int, n: int) -> None:
        """The next ``n`` free blocks of the queue for ``seq`` (known to be there)."""
        queue, head = self._queue, self._head
        mine = self._blocks.get(seq)
        if mine is None:
            mine = self._blocks[seq] = []
        if n == 1:
            mine.append(queue[head])
        else:
            mine += queue[head:head + n]
        head += n
        if head > 1024 and head > len(queue) >> 1:
            del queue[:head]
            head = 0
        self._head = head

    def fits_batch(self, takes: list[list[int]], frees: list[list[int]]) -> bool:
        """:meth:`stretch_fits` of one step, in plain ints (a decode step takes no state)."""
        return not self._attention or sum(takes[self._attention[0]]) <= self.num_free_blocks()

    def place_batch(self, seqs: list[int], frees: list[list[int]], takes: list[list[int]]) -> None:
        """Each moving sequence's blocks in turn, known to fit."""
        att = self._attention
        if not att:
            super().place_batch(seqs, frees, takes)
            return
        if self._states:
            states = [max(c) for c in zip(*(takes[i] for i in self._states), strict=True)]
            for seq, n in zip(seqs, states, strict=True):
                if n:
                    self._slot[seq] = self._state_free.pop(0)
        per_seq = takes[att[0]]   # one block size, nothing freed: every attention group takes alike
        if sum(per_seq) > self.num_free_blocks():
            raise AssertionError("a move ran out of blocks it was told were free")
        for seq, n in zip(seqs, per_seq, strict=True):
            if n:
                self._take_blocks(seq, n)

    def release(self, seq: int, held: list[int]) -> None:
        self._queue.extend(self._blocks.pop(seq, []))
        if seq in self._slot:
            self._state_free.append(self._slot.pop(seq))

    def fits(self, takes: list[int]) -> bool:
        blocks, states = self._takes(takes)
        return blocks <= self.num_free_blocks() and states <= len(self._state_free)

    def fits_empty(self, takes: list[int]) -> bool:
        blocks, states = self._takes(takes)
        return blocks <= self.num_blocks and states <= self.num_slots

    def stretch_fits(self, takes: np.ndarray, frees: np.ndarray, per_seq: np.ndarray) -> int:
        if not self._attention:
            return len(takes)
        short = np.flatnonzero(np.cumsum(takes[:, self._attention[0]]) > self.num_free_blocks())
        return int(short[0]) if len(short) else len(takes)

    def free_bytes(self) -> list[int]:
        out = [0] * (len(self.groups) + 1)
        for i in self._states:
            out[i] = len(self._state_free) * self.groups[i].block_bytes
        out[-1] = self.num_free_blocks() * self.block_bytes
        return out

    def fixed_padding(self) -> int:
        return self.capacity - self.num_slots * self.slot_bytes - self.num_blocks * self.block_bytes

    def largest_allocatable(self) -> int:
        """Free blocks: the free state slots hold nothing else."""
        return self.num_free_blocks() * self.block_bytes

    def block_ids(self, seq: int, group: int) -> list[int]:
        if self.groups[group].is_state:
            return [self._slot[seq]] if seq in self._slot else []
        return list(self._blocks.get(seq, []))

    @property
    def unit_kinds(self) -> list[str]:
        return [g.kind for g in self.groups] + ["every attention layer"]

    def unit_rows(self) -> np.ndarray:
        """The uniform blocks (every attention layer: the index after the groups), then
        the state slots."""
        blocks = np.full(self.num_blocks, -1, dtype=np.int64)
        for ids in self._blocks.values():
            blocks[ids] = len(self.groups)
        slots = np.full(self.num_slots, -1, dtype=np.int64)
        if self._states:
            slots[list(self._slot.values())] = self._states[0]
        return np.concatenate((blocks, slots))

    def check(self, held: list[int]) -> None:
        free = self._queue[self._head:]
        ids = [b for t in self._blocks.values() for b in t]
        assert sorted(free + ids) == list(range(self.num_blocks)), "uniform blocks lost or doubled"
        slots = list(self._slot.values())
        assert sorted(slots + self._state_free) == list(range(self.num_slots)), "state slots"
        assert not self._attention or len(ids) == held[self._attention[0]], "uniform blocks held"

