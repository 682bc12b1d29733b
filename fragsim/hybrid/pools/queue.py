"""vLLM's one pool of equal blocks, drawn from a first-in, first-out free queue.

A block id is one page in each group's per-layer buffers, so every block costs
``block_bytes`` whichever group holds it; the pool has ``num_blocks`` of them, block 0
being vLLM's null block (never handed out). A sequence's freed blocks join the tail
of the queue, last block first, as vLLM's ``FreeKVCacheBlockQueue`` has them.
"""

from __future__ import annotations

import numpy as np

from fragsim.hybrid.groups import Group
from fragsim.hybrid.pools.base import IdPool, first_room, first_short, rows_of_tables, tables_of


class BlockQueue(IdPool):
    """Block tables per sequence and group over one FIFO queue (block 0 held back)."""

    def __init__(self, groups: tuple[Group, ...], capacity: int, *, num_blocks: int, block_bytes: int) -> None:
        super().__init__(groups, capacity)
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self._queue = list(range(1, num_blocks))
        self._head = 0
        self._tables: dict[int, list[list[int]]] = {}

    def num_free_blocks(self) -> int:
        return len(self._queue) - self._head

    def used_blocks(self) -> int:
        """Block ids held by requests (vLLM's ``num_blocks − 1 − free``)."""
        return self.num_blocks - 1 - self.num_free_blocks()

    def place(self, seq: int, frees: list[int], takes: list[int]) -> bool:
        need = sum(takes)
        if need > self.num_free_blocks() + sum(frees):
            return False
        tables = self._tables.setdefault(seq, [[] for _ in self.groups])
        queue = self._queue
        for table, n in zip(tables, frees, strict=True):
            if n:
                queue.extend(reversed(table[:n]))
                del table[:n]
        for table, n in zip(tables, takes, strict=True):
            if n:
                table.extend(queue[self._head:self._head + n])
                self._head += n
        if self._head > 1024 and self._head > len(queue) >> 1:
            del queue[: self._head]
            self._head = 0
        return True

    def release(self, seq: int, held: list[int]) -> None:
        for table in self._tables.pop(seq, []):
            self._queue.extend(reversed(table))

    def fits(self, takes: list[int]) -> bool:
        return sum(takes) <= self.num_free_blocks()

    def fits_batch(self, takes: list[list[int]], frees: list[list[int]]) -> bool:
        return sum(map(sum, takes)) <= self.num_free_blocks()

    def fits_empty(self, takes: list[int]) -> bool:
        return sum(takes) <= self.num_blocks - 1

    def stretch_fits(self, takes: np.ndarray, frees: np.ndarray, per_seq: np.ndarray) -> int:
        return first_short(takes.sum(axis=1, keepdims=True), frees.sum(axis=1, keepdims=True),
                           [self.num_free_blocks()])

    def stretch_admits(self, takes: np.ndarray, frees: np.ndarray, head: list[int]) -> int:
        return first_room(takes.sum(axis=1, keepdims=True), frees.sum(axis=1, keepdims=True),
                          [self.num_free_blocks()], [sum(head)])

    def free_bytes(self) -> list[int]:
        return [0] * len(self.groups) + [self.num_free_blocks() * self.block_bytes]

    def fixed_padding(self) -> int:
        # vLLM's null block, and the memory too small for one more block
        return self.capacity - (self.num_blocks - 1) * self.block_bytes

    def block_ids(self, seq: int, group: int) -> list[int]:
        return tables_of(self._tables, seq, group)

    def unit_rows(self) -> np.ndarray:
        return rows_of_tables(self._tables, self.num_blocks)

    def check(self, held: list[int]) -> None:
        free = self._queue[self._head:]
        ids = [b for tables in self._tables.values() for t in tables for b in t]
        assert len(set(free)) == len(free), "free queue holds a block twice"
        assert not set(free) & set(ids) and len(set(ids)) == len(ids), "a block is held twice"
        assert set(free) | set(ids) == set(range(1, self.num_blocks)), "blocks lost"
        assert sum(held) == len(ids)
