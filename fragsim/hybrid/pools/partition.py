"""A FIFO paged pool per group, each in a fixed share of the memory.

Each group draws its own blocks from its own pool, sized up front
(:mod:`fragsim.hybrid.static_partition` says how); a pool's free blocks are that
group's free memory, which no other group can use. A fresh request could use the
free memory only in proportion to the shares, so the largest allocatable is the
tightest pool's free share of the whole memory (:func:`proportional_largest`).
"""

from __future__ import annotations

import numpy as np

from fragsim.hybrid.groups import Group
from fragsim.hybrid.pools.base import IdPool, first_room, first_short, tables_of


def proportional_largest(num_blocks: list[int], capacity: int):  # type: ignore[no-untyped-def]
    """``largest(free_blocks [..., groups], free_bytes [...])``: the tightest pool's
    free fraction of ``capacity``, at most the free bytes."""
    n = np.asarray(num_blocks, dtype=np.float64)

    def largest(free: np.ndarray, free_bytes: np.ndarray) -> np.ndarray:
        frac = (free / n).min(axis=-1)
        return np.minimum(free_bytes, (frac * capacity).astype(np.int64))

    return largest


class PartitionPool(IdPool):
    """One FIFO queue of blocks per group."""

    largest_is_free = False
    unit_name = "block (pool per kind)"

    def __init__(self, groups: tuple[Group, ...], capacity: int, *, num_blocks: list[int]) -> None:
        super().__init__(groups, capacity)
        self.num_blocks = list(num_blocks)
        self._free = [list(range(n)) for n in num_blocks]
        self._head = [0] * len(groups)
        self._tables: dict[int, list[list[int]]] = {}
        self._largest = proportional_largest(self.num_blocks, self.capacity)

    def free_blocks(self, group: int) -> int:
        return len(self._free[group]) - self._head[group]

    def _free_list(self) -> list[int]:
        return [len(q) - h for q, h in zip(self._free, self._head, strict=True)]

    def used_blocks(self) -> int:
        return sum(n - f for n, f in zip(self.num_blocks, self._free_list(), strict=True))

    def place(self, seq: int, frees: list[int], takes: list[int]) -> bool:
        pools, heads = self._free, self._head
        for i, t in enumerate(takes):
            if t and t > len(pools[i]) - heads[i] + frees[i]:
                return False
        tables = self._tables.get(seq)
        if tables is None:
            tables = self._tables[seq] = [[] for _ in self.groups]
        for i, (f, t) in enumerate(zip(frees, takes, strict=True)):
            if f or t:
                self._move(i, tables[i], f, t)
        return True

    def _move(self, group: int, table: list[int], frees: int, takes: int) -> None:
        """A sequence's ``table`` of ``group``: its first ``frees`` blocks back to the
        group's pool (last first), then ``takes`` more from it (known to be there)."""
        queue = self._free[group]
        if frees:
            queue.extend(reversed(table[:frees]))
            del table[:frees]
        if takes:
            head = self._head[group]
            if head + takes > len(queue):
                raise AssertionError(f"group {self.groups[group].label}: blocks taken that were not free")
            table.extend(queue[head:head + takes])
            head += takes
            if head > 1024 and head > len(queue) >> 1:
                del queue[:head]
                head = 0
            self._head[group] = head

    def fits_batch(self, takes: list[list[int]], frees: list[list[int]]) -> bool:
        """:meth:`stretch_fits` of one step, in plain ints: each pool holds its group's takes."""
        return all(sum(t) <= self.free_blocks(i) for i, t in enumerate(takes))

    def place_batch(self, seqs: list[int], frees: list[list[int]], takes: list[list[int]]) -> None:
        """The moves group by group: a group's pool sees the same frees and takes in the
        same order as sequence by sequence (pools are per group), known to fit."""
        tables = self._tables
        for i, (group_frees, group_takes) in enumerate(zip(frees, takes, strict=True)):
            if not any(group_frees) and not any(group_takes):
                continue
            for seq, f, t in zip(seqs, group_frees, group_takes, strict=True):
                if f or t:
                    mine = tables.get(seq)
                    if mine is None:
                        mine = tables[seq] = [[] for _ in self.groups]
                    self._move(i, mine[i], f, t)

    def release(self, seq: int, held: list[int]) -> None:
        for queue, table in zip(self._free, self._tables.pop(seq, []), strict=False):
            queue.extend(reversed(table))

    def fits(self, takes: list[int]) -> bool:
        return all(t <= self.free_blocks(i) for i, t in enumerate(takes))

    def fits_empty(self, takes: list[int]) -> bool:
        return all(t <= n for t, n in zip(takes, self.num_blocks, strict=True))

    def stretch_fits(self, takes: np.ndarray, frees: np.ndarray, per_seq: np.ndarray) -> int:
        return first_short(takes, frees, self._free_list())

    def stretch_admits(self, takes: np.ndarray, frees: np.ndarray, head: list[int]) -> int:
        return first_room(takes, frees, self._free_list(), head)

    def free_bytes(self) -> list[int]:
        return [self.free_blocks(i) * g.block_bytes for i, g in enumerate(self.groups)] + [0]

    def fixed_padding(self) -> int:
        return self.capacity - sum(n * g.block_bytes for n, g in zip(self.num_blocks, self.groups, strict=True))

    def largest_allocatable(self) -> int:
        return int(self._largest(np.asarray([self._free_list()], dtype=np.int64),
                                 np.asarray([sum(self.free_bytes())]))[0])

    def block_ids(self, seq: int, group: int) -> list[int]:
        return tables_of(self._tables, seq, group)

    def unit_rows(self) -> np.ndarray:
        """Each group's pool in turn, its blocks in id order."""
        parts = []
        for i, n in enumerate(self.num_blocks):
            part = np.full(n, -1, dtype=np.int64)
            for tables in self._tables.values():
                part[tables[i]] = i
            parts.append(part)
        return np.concatenate(parts)

    def check(self, held: list[int]) -> None:
        for i, n in enumerate(self.num_blocks):
            free = self._free[i][self._head[i]:]
            ids = [b for t in self._tables.values() for b in t[i]]
            assert sorted(free + ids) == list(range(n)), f"group {self.groups[i].label}: blocks lost"
            assert len(ids) == held[i], f"group {self.groups[i].label}: blocks held"
