"""Counts only: a pool that knows how many units are free, not which.

Where nothing depends on which block a sequence holds (no address map is drawn and
no device is fed), every pool reduces to a few *bins* of interchangeable units: vLLM's
one queue of equal blocks, Jenga's large pages when every small page is a whole large
page, a static partition's pool per group, paged-uniform's uniform blocks and state
slots. The moves of a step then add up in any order, and a stretch's free units
after each step are a running sum: the same results as the pool with ids, faster.

A bin is drawn on by some groups. A sequence's take from it is the sum of its
groups' takes, or their largest where one unit serves every group of the sequence
(``once``: a uniform block holds every attention layer). Frees pay for takes
anywhere in the bin, or only in their own group (``own_credit``: Jenga frees a kind's
small pages into that kind's large pages). A bin's free bytes show in the pool's row
or in its groups' rows (memory only those groups can use).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fragsim.hybrid.groups import Group
from fragsim.hybrid.pools.base import Steps, first_room, first_short


@dataclass(frozen=True)
class Bin:
    """Interchangeable units some groups draw on."""

    units: int
    unit_bytes: int
    groups: tuple[int, ...]
    #: one unit serves all the bin's groups of a sequence (a take is the largest, not the sum)
    once: bool = False
    #: a group's frees pay only its own takes
    own_credit: bool = False
    #: free units show in the pool's row (False: in each group's row, at its block bytes)
    in_pool_row: bool = True
    #: counted in :meth:`Ledger.used_blocks`
    counted: bool = True


class Ledger:
    """Free units per bin."""

    needs_per_seq = False
    keeps_ids = False
    shares_blocks = False
    frees_on_failure = False
    unit_name = "block"

    def __init__(self, groups: tuple[Group, ...], capacity: int, bins: list[Bin],
                 largest: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None) -> None:
        """``largest(free_units [steps, bins], free_bytes [steps])``: the largest
        allocatable bytes (None: the free bytes of the pool's row)."""
        self.groups, self.capacity, self.bins = groups, int(capacity), bins
        self.free = [b.units for b in bins]
        self._fixed_padding = self.capacity - sum(b.units * b.unit_bytes for b in bins)
        self._checked: tuple[list[list[int]] | None, list[int]] = (None, [])
        # per bin, the rows its free units show in and the bytes a unit adds there
        pool_row = len(groups)
        self._row_bytes = [[(pool_row, b.unit_bytes)] if b.in_pool_row
                           else [(g, groups[g].block_bytes) for g in b.groups] for b in bins]
        self._largest = largest
        self.largest_is_free = largest is None and all(b.in_pool_row for b in bins)
        # [groups, bins]: 1 where the group draws on the bin (for summing bins)
        self._member = np.zeros((len(groups), len(bins)), dtype=np.int64)
        for j, b in enumerate(bins):
            self._member[list(b.groups), j] = 1
        self._summed = not any(b.once for b in bins)
        # per bin, its units of blocks per group (a bin of every group: their sum)
        every = tuple(range(len(groups)))
        self._aggs: list[Callable[[list[int]], int]] = [
            sum if b.groups == every and not b.once else
            (lambda p, ix=b.groups, agg=max if b.once else sum: agg([p[i] for i in ix]))  # type: ignore[misc]
            for b in bins]

    # -------------------------------------------------------------- one sequence

    def _need(self, per_group: list[int]) -> list[int]:
        """A sequence's units per bin for blocks per group."""
        return [agg(per_group) for agg in self._aggs]

    def place(self, seq: int, frees: list[int], takes: list[int]) -> bool:
        need, gain, free = self._need(takes), self._need(frees), self.free
        for j, b in enumerate(self.bins):
            if b.own_credit:
                short = sum([takes[g] - frees[g] for g in b.groups if takes[g] > frees[g]])
            else:
                short = need[j] - gain[j]
            if short > free[j]:
                return False
        for j in range(len(free)):
            free[j] += gain[j] - need[j]
        return True

    def release(self, seq: int, held: list[int]) -> None:
        for j, n in enumerate(self._need(held)):
            self.free[j] += n

    def fits(self, takes: list[int]) -> bool:
        return all(n <= f for n, f in zip(self._need(takes), self.free, strict=True))

    def fits_empty(self, takes: list[int]) -> bool:
        return all(n <= b.units for n, b in zip(self._need(takes), self.bins, strict=True))

    # ------------------------------------------------------------------ batches

    def _batch_need(self, per_group: list[list[int]]) -> list[int]:
        """Units per bin of a batch (``[group][seq]``)."""
        out = []
        for b in self.bins:
            if b.once:
                out.append(sum(map(max, zip(*(per_group[g] for g in b.groups), strict=True))))
            else:
                out.append(sum(sum(per_group[g]) for g in b.groups))
        return out

    def fits_batch(self, takes: list[list[int]], frees: list[list[int]]) -> bool:
        need = self._batch_need(takes)
        self._checked = (takes, need)   # the manager places the batch it just checked
        return all(n <= f for n, f in zip(need, self.free, strict=True))

    def place_batch(self, seqs: list[int], frees: list[list[int]], takes: list[list[int]]) -> None:
        checked, needs = self._checked
        if checked is not takes:
            needs = self._batch_need(takes)
        for j, (gain, need) in enumerate(zip(self._batch_need(frees), needs, strict=True)):
            self.free[j] += gain - need
            if self.free[j] < 0:
                raise AssertionError("a move ran out of blocks it was told were free")

    # ---------------------------------------------------------------- stretches

    def _per_bin(self, per_group: np.ndarray) -> np.ndarray:
        """``[steps, groups]`` to ``[steps, bins]``."""
        if self._summed:
            return per_group @ self._member
        return np.stack([per_group[:, list(b.groups)].max(axis=1) if b.once else per_group[:, list(b.groups)].sum(axis=1)
                         for b in self.bins], axis=1)

    def stretch_fits(self, takes: np.ndarray, frees: np.ndarray, per_seq: np.ndarray) -> int:
        return first_short(self._per_bin(takes), self._per_bin(frees), self.free)

    def stretch_admits(self, takes: np.ndarray, frees: np.ndarray, head: list[int]) -> int:
        return first_room(self._per_bin(takes), self._per_bin(frees), self.free, self._need(head))

    def place_steps(self, steps: Steps) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The steps' moves add up in any order: free units after each step are a
        running sum."""
        k = steps.k
        free = np.asarray(self.free, dtype=np.int64) + np.cumsum(self._per_bin(steps.frees) - self._per_bin(steps.takes),
                                                                 axis=0)
        if k:
            if int(free.min()) < 0:
                raise AssertionError("a block move failed inside a stretch that had room for it")
            self.free = free[-1].tolist()
        free_rows = self._rows_of(free)
        largest = free_rows[:, -1].copy() if self._largest is None else self._largest(free, free_rows.sum(axis=1))
        used = np.zeros(k, dtype=np.int64)
        for j, b in enumerate(self.bins):
            if b.counted:
                used += b.units - free[:, j]
        return free_rows, largest, used

    # -------------------------------------------------------------------- sizes

    def _rows_of(self, free: np.ndarray) -> np.ndarray:
        """Free bytes per group and the pool (``[..., groups + 1]``) of free units per bin."""
        out = np.zeros(free.shape[:-1] + (len(self.groups) + 1,), dtype=np.int64)
        for j, rows in enumerate(self._row_bytes):
            for row, unit_bytes in rows:
                out[..., row] += free[..., j] * unit_bytes
        return out

    def free_bytes(self) -> list[int]:
        """:meth:`_rows_of` of the free units now, in plain ints (asked every step)."""
        out = [0] * (len(self.groups) + 1)
        for units, rows in zip(self.free, self._row_bytes, strict=True):
            for row, unit_bytes in rows:
                out[row] += units * unit_bytes
        return out

    def fixed_padding(self) -> int:
        return self._fixed_padding

    def largest_allocatable(self) -> int:
        rows = self.free_bytes()
        if self._largest is None:
            return rows[-1]
        return int(self._largest(np.asarray([self.free], dtype=np.int64), np.asarray([sum(rows)]))[0])

    def used_blocks(self) -> int:
        return sum(b.units - f for b, f in zip(self.bins, self.free, strict=True) if b.counted)

    def num_free_blocks(self) -> int:
        """Free units of the counted bins."""
        return sum(f for b, f in zip(self.bins, self.free, strict=True) if b.counted)

    def block_ids(self, seq: int, group: int) -> list[int]:
        raise ValueError("this pool keeps block counts only (no address map was asked for)")

    @property
    def unit_kinds(self) -> list[str]:
        return [g.kind for g in self.groups]

    def unit_rows(self) -> np.ndarray:
        raise ValueError("this pool keeps block counts only (no address map was asked for)")

    def check(self, held: list[int]) -> None:
        for j, (b, n) in enumerate(zip(self.bins, self._need(held), strict=True)):
            assert self.free[j] + n == b.units, f"bin {j} ({b.units} units): {self.free[j]} free + {n} held"
