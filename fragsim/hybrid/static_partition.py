"""A paged pool per layer kind, sized up front: the baseline of Jenga's paper.

Each row (layer kind) gets its own pool of its own blocks, ``block_size`` tokens
of its layers' KV (a state row: one state), and frees its window as vLLM's
hybrid manager does; only the split of the memory is fixed. The memory is cut in
proportion to what one ``max_seq_len`` request needs in each row at its peak, as
vLLM sizes a request's worst case, with ``T`` tokens computed in one step::

    share(row) ∝ blocks × block bytes, blocks = full: ceil(L / B)
                                                sliding: ceil(min(W − 1 + T, L) / B) + 1
                                                chunked: ceil(min(C + T, L) / B)
                                                state: 1

so a workload of long requests fills every pool together, and any other mix
leaves one pool short while another has room. A pool's free blocks count as that
row's free memory; no other row can use them. Without an address map
(``track_ids=False``) each pool keeps its free block count only: the same
results, faster.
"""

from __future__ import annotations

import numpy as np

from fragsim.hybrid.groups import Group
from fragsim.hybrid.manager import HybridManager
from fragsim.kinds import cdiv


def max_blocks(row: Group, max_seq_len: int, step_tokens: int) -> int:
    """Blocks of ``row`` one request of ``max_seq_len`` tokens holds at most, computing
    up to ``step_tokens`` tokens a step (its rule's :meth:`~fragsim.kinds.Kind.max_blocks`)."""
    if row.is_state:
        return 1
    return min(cdiv(max_seq_len, row.block_tokens), row.holds.max_blocks(max_seq_len, row.block_tokens, step_tokens))


class StaticPartitionManager(HybridManager):
    """One FIFO paged pool per row, in a fixed share of the memory."""

    def __init__(self, rows: tuple[Group, ...], capacity: int, *, max_seq_len: int,
                 step_tokens: int, name: str = "static-partition", track_ids: bool = True) -> None:
        super().__init__(name=name, placement="static-partition", rows=rows, capacity=capacity,
                         max_seq_len=max_seq_len)
        weights = [max_blocks(r, max_seq_len, step_tokens) * r.block_bytes for r in rows]
        total = sum(weights)
        self.share_bytes = [capacity * w // total for w in weights]
        self.num_blocks = [s // r.block_bytes for s, r in zip(self.share_bytes, rows, strict=True)]
        if min(self.num_blocks) < 1:
            short = rows[self.num_blocks.index(min(self.num_blocks))]
            raise ValueError(f"the {short.label} pool's share of {capacity:,} bytes holds no "
                             f"{short.block_bytes:,}-byte block")
        self._free = [list(range(n)) for n in self.num_blocks]
        self._head = [0] * len(rows)
        self._tables: dict[int, list[list[int]]] = {}
        #: False: each pool counts its free blocks only
        self.tracks_ids = track_ids
        self._free_per_row = list(self.num_blocks)

    def free_blocks(self, row: int) -> int:
        return len(self._free[row]) - self._head[row] if self.tracks_ids else self._free_per_row[row]

    def _count_steps(self, frees: np.ndarray, takes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        k, R = len(takes), len(self.rows)
        free = np.zeros((k, R), dtype=np.int64)
        for i in range(R):
            si = self.state.shape_of[i]
            free[:, i] = self._free_per_row[i] if si < 0 else \
                self._free_per_row[i] + np.cumsum(frees[:, si] - takes[:, si])
        if k:
            if int(free.min()) < 0:
                raise AssertionError("a block move failed inside a stretch that had room for it")
            self._free_per_row = free[-1].tolist()
        free_rows = np.zeros((k, R + 1), dtype=np.int64)
        free_rows[:, :R] = free * np.array([r.block_bytes for r in self.rows], dtype=np.int64)
        frac = (free / np.array(self.num_blocks, dtype=np.float64)).min(axis=1)
        # largest_allocatable's int(frac · capacity), step by step
        largest = np.minimum(free_rows.sum(axis=1), np.array([int(f * self.capacity) for f in frac.tolist()],
                                                             dtype=np.int64))
        return free_rows, largest, sum(self.num_blocks) - free.sum(axis=1)

    def num_used_blocks(self) -> int:
        return sum(n - self.free_blocks(i) for i, n in enumerate(self.num_blocks))

    def _place(self, seq: int, frees: list[int], takes: list[int]) -> bool:
        if not self.tracks_ids:
            count = self._free_per_row
            if any(t and t > count[i] + frees[i] for i, t in enumerate(takes)):
                return False
            for i, (f, t) in enumerate(zip(frees, takes, strict=True)):
                count[i] += f - t
            return True
        pools, heads = self._free, self._head
        for i, t in enumerate(takes):
            if t and t > len(pools[i]) - heads[i] + frees[i]:
                return False
        tables = self._tables.get(seq)
        if tables is None:
            tables = self._tables[seq] = [[] for _ in self.rows]
        for i, (f, t) in enumerate(zip(frees, takes, strict=True)):
            if f or t:
                self._move(i, tables[i], f, t)
        return True

    def _move(self, row: int, table: list[int], frees: int, takes: int) -> None:
        """A sequence's ``table`` of ``row``: its first ``frees`` blocks back to the row's
        pool (last first), then ``takes`` more from it (known to be there)."""
        queue = self._free[row]
        if frees:
            queue.extend(reversed(table[:frees]))
            del table[:frees]
        if takes:
            head = self._head[row]
            if head + takes > len(queue):
                raise AssertionError(f"row {self.rows[row].label}: blocks taken that were not free")
            table.extend(queue[head:head + takes])
            head += takes
            if head > 1024 and head > len(queue) >> 1:
                del queue[:head]
                head = 0
            self._head[row] = head

    def _fits_moves(self, takes: list[list[int]], frees: list[list[int]]) -> bool:
        """:meth:`_stretch_fits` of one step, in plain ints: each pool holds its row's takes."""
        return all(sum(t) <= self.free_blocks(i) for i, t in enumerate(takes))

    def _place_moves(self, seqs: list[int], frees: list[list[int]], takes: list[list[int]]) -> None:
        """The moves row by row: a row's pool sees the same frees and takes in the same
        order as sequence by sequence (pools are per row), known to fit."""
        if not self.tracks_ids:
            count = self._free_per_row
            for i, (row_frees, row_takes) in enumerate(zip(frees, takes, strict=True)):
                count[i] += sum(row_frees) - sum(row_takes)
                if count[i] < 0:
                    raise AssertionError("a move ran out of blocks it was told were free")
            return
        tables = self._tables
        for i, (row_frees, row_takes) in enumerate(zip(frees, takes, strict=True)):
            if not any(row_frees) and not any(row_takes):
                continue
            for seq, f, t in zip(seqs, row_frees, row_takes, strict=True):
                if f or t:
                    mine = tables.get(seq)
                    if mine is None:
                        mine = tables[seq] = [[] for _ in self.rows]
                    self._move(i, mine[i], f, t)

    def _release(self, seq: int, held: list[int]) -> None:
        if not self.tracks_ids:
            self._free_per_row = [c + h for c, h in zip(self._free_per_row, held, strict=True)]
            return
        for queue, table in zip(self._free, self._tables.pop(seq, []), strict=False):
            queue.extend(reversed(table))

    def _free_bytes(self) -> list[int]:
        return [self.free_blocks(i) * r.block_bytes for i, r in enumerate(self.rows)] + [0]

    def _fixed_padding(self) -> int:
        used = sum(n * r.block_bytes for n, r in zip(self.num_blocks, self.rows, strict=True))
        return self.capacity - used

    def _can_take(self, takes: list[int]) -> bool:
        return all(t <= self.free_blocks(i) for i, t in enumerate(takes))

    _needs_per_seq = False

    def _stretch_fits(self, takes: np.ndarray, frees: np.ndarray, per_seq: np.ndarray) -> int:
        if len(takes) <= 64:  # a short stretch: the running sums in plain ints
            room = [self.free_blocks(i) for i in range(len(self.rows))]   # free, and freed before
            for j, (t_row, f_row) in enumerate(zip(takes.tolist(), frees.tolist(), strict=True)):
                for i, t in enumerate(t_row):
                    room[i] -= t
                    if room[i] < 0:
                        return j
                for i, f in enumerate(f_row):
                    room[i] += f
            return len(takes)
        free = np.array([self.free_blocks(i) for i in range(len(self.rows))])
        freed_before = np.vstack((np.zeros((1, len(self.rows)), dtype=np.int64), np.cumsum(frees, axis=0)[:-1]))
        short = np.flatnonzero((np.cumsum(takes, axis=0) > free + freed_before).any(axis=1))
        return int(short[0]) if len(short) else len(takes)

    def _stretch_admits(self, takes: np.ndarray, frees: np.ndarray, head: list[int]) -> int:
        if len(takes) <= 64:
            now = [self.free_blocks(i) for i in range(len(self.rows))]
            for j, d_row in enumerate((frees - takes).tolist()):
                now = [x + d for x, d in zip(now, d_row, strict=True)]
                if all(x >= h for x, h in zip(now, head, strict=True)):
                    return j
            return len(takes)
        free = np.array([self.free_blocks(i) for i in range(len(self.rows))])
        free_after = free + np.cumsum(frees - takes, axis=0)
        fits = np.flatnonzero((free_after >= np.array(head)).all(axis=1))
        return int(fits[0]) if len(fits) else len(takes)

    def _fits_empty(self, takes: list[int]) -> bool:
        return all(t <= n for t, n in zip(takes, self.num_blocks, strict=True))

    largest_is_free = False

    def largest_allocatable(self) -> int:
        """Free bytes a fresh request could use in proportion to the shares: the
        tightest pool's free share, scaled to the whole memory."""
        frac = min(self.free_blocks(i) / n for i, n in enumerate(self.num_blocks))
        return min(self.num_free(), int(frac * self.capacity))

    def _block_ids(self, seq: int, row: int) -> list[int]:
        if not self.tracks_ids:
            raise ValueError("this static-partition manager keeps block counts only (track_ids=False)")
        tables = self._tables.get(seq)
        return list(tables[row]) if tables else []

    def unit_rows(self) -> np.ndarray:
        """Each row's pool in turn, its blocks in id order."""
        if not self.tracks_ids:
            raise ValueError("this static-partition manager keeps block counts only (track_ids=False)")
        parts = []
        for i, n in enumerate(self.num_blocks):
            part = np.full(n, -1, dtype=np.int64)
            for tables in self._tables.values():
                part[tables[i]] = i
            parts.append(part)
        return np.concatenate(parts)

    def _check_pool(self) -> None:
        if not self.tracks_ids:
            for i, n in enumerate(self.num_blocks):
                assert self._free_per_row[i] + self.held_blocks[i] == n, f"row {self.rows[i].label}: blocks lost"
            return
        for i, n in enumerate(self.num_blocks):
            free = self._free[i][self._head[i]:]
            held = [b for t in self._tables.values() for b in t[i]]
            assert sorted(free + held) == list(range(n)), f"row {self.rows[i].label}: blocks lost"
