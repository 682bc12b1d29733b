"""What a hybrid KV manager asks of its pool, and what most pools share.

The manager (:mod:`fragsim.hybrid.manager`) knows which blocks each sequence holds
per group; the pool knows where they are. Every request the manager makes is in
blocks per group: ``frees[g]`` leading blocks a sequence gives back in group ``g``,
``takes[g]`` new ones it needs::

    manager asks                             pool answers
    ------------                             ------------
    one sequence's move, all or nothing      place(seq, frees, takes) -> bool
    a batch's moves, known to fit            fits_batch(takes, frees), place_batch(seqs, frees, takes)
    a sequence's end                         release(seq, held)
    would a fresh one fit now / when empty   fits(takes), fits_empty(takes)
    how far a stretch surely fits            stretch_fits(takes, frees, per_seq)
    when its frees might admit the head      stretch_admits(takes, frees, head)
    a stretch's moves, step by step          place_steps(steps) -> free bytes, largest, used per step
    where the memory is                      free_bytes(), fixed_padding(), largest_allocatable(),
                                             used_blocks(), block_ids(seq, g), unit_rows()
    its own invariants                       check(held)

``takes``/``frees`` are lists per group for one sequence, ``[group][seq]`` lists for a
batch, and ``[steps, groups]`` arrays (summed over sequences) for a stretch. A pool
declares what it can promise as attributes: ``needs_per_seq`` (its
``stretch_fits`` reads each sequence's takes), ``largest_is_free`` (every free byte
is allocatable), ``keeps_ids`` (block ids, placements and address maps exist),
``shares_blocks`` (a block may have several holders: prefix caching) and
``frees_on_failure`` (a move that cannot take its blocks has already given back its
frees, as vLLM does).

The pools: :class:`~fragsim.hybrid.pools.ledger.Ledger` (counts only, any layout),
:class:`~fragsim.hybrid.pools.queue.BlockQueue` (vLLM's one queue of equal blocks),
:class:`~fragsim.hybrid.pools.caching.CachingBlockPool` (the same under prefix
caching), :class:`~fragsim.hybrid.pools.jenga.JengaPool`,
:class:`~fragsim.hybrid.pools.partition.PartitionPool` and
:class:`~fragsim.hybrid.pools.uniform.UniformPool`. A new pool is one module here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from fragsim.hybrid.groups import Group

#: a stretch longer than this finds its limits in numpy (shorter: plain ints are faster)
SHORT_STRETCH = 64


def first_short(takes: np.ndarray, frees: np.ndarray, free: list[int]) -> int:
    """The first step whose takes exceed what is free before it, per bin (``takes``,
    ``frees``: ``[steps, bins]``; ``free``: free units per bin now). Frees of earlier
    steps count, a step's own do not: each move then needs no more than is free when
    it comes."""
    k = len(takes)
    if k <= SHORT_STRETCH:   # a short stretch: the running sums in plain ints
        room = list(free)
        for j, (t_row, f_row) in enumerate(zip(takes.tolist(), frees.tolist(), strict=True)):
            for i, t in enumerate(t_row):
                room[i] -= t
                if room[i] < 0:
                    return j
            for i, f in enumerate(f_row):
                room[i] += f
        return k
    freed_before = np.vstack((np.zeros((1, takes.shape[1]), dtype=np.int64), np.cumsum(frees, axis=0)[:-1]))
    short = np.flatnonzero((np.cumsum(takes, axis=0) > np.asarray(free) + freed_before).any(axis=1))
    return int(short[0]) if len(short) else k


def first_room(takes: np.ndarray, frees: np.ndarray, free: list[int], need: list[int]) -> int:
    """The first step after whose moves ``need`` units are free in every bin."""
    k = len(takes)
    if k <= SHORT_STRETCH:
        now = list(free)
        for j, d_row in enumerate((frees - takes).tolist()):
            now = [x + d for x, d in zip(now, d_row, strict=True)]
            if all(x >= n for x, n in zip(now, need, strict=True)):
                return j
        return k
    after = np.asarray(free) + np.cumsum(frees - takes, axis=0)
    fits = np.flatnonzero((after >= np.asarray(need)).all(axis=1))
    return int(fits[0]) if len(fits) else k


class Steps:
    """A stretch's ``k`` steps as its pool sees them: per step and group the blocks
    taken and freed (``takes``, ``frees``: ``[k, groups]``, summed over sequences), and,
    for pools that place ids, each step's moves in the order exact steps make them
    (:meth:`by_step`: step, then request)."""

    def __init__(self, k: int, takes: np.ndarray, frees: np.ndarray, moves: list, seqs: np.ndarray,
                 reqs: np.ndarray, shape_of: list[int]) -> None:
        self.k, self.takes, self.frees = k, takes, frees
        self._moves, self._seqs, self._reqs, self._shape_of = moves, seqs, reqs, shape_of

    def by_step(self) -> Iterator[tuple[int, list[int], list[list[int]], list[list[int]]]]:
        """Each step that moves: (step, its sequences, frees ``[group][seq]``, takes)."""
        moves = self._moves
        if not moves:
            return
        req_of = self._reqs.tolist()
        moves = sorted(moves, key=lambda mv: (mv[0], req_of[mv[1]], mv[1]))
        seq_list = self._seqs.tolist()
        i = 0
        while i < len(moves):
            j = moves[i][0]
            first = i
            while i < len(moves) and moves[i][0] == j:
                i += 1
            step = moves[first:i]
            zero = [0] * len(step)
            yield (j, [seq_list[mv[1]] for mv in step],
                   [[mv[5][s] for mv in step] if s >= 0 else zero for s in self._shape_of],
                   [[mv[6][s] for mv in step] if s >= 0 else zero for s in self._shape_of])


class Pool(Protocol):
    """A hybrid KV manager's pool (see the module docstring)."""

    groups: tuple[Group, ...]
    capacity: int
    needs_per_seq: bool
    largest_is_free: bool
    keeps_ids: bool
    shares_blocks: bool
    frees_on_failure: bool
    #: what one unit of :meth:`unit_rows` is ("block", "large page", ...)
    unit_name: str

    def place(self, seq: int, frees: list[int], takes: list[int]) -> bool: ...

    def fits_batch(self, takes: list[list[int]], frees: list[list[int]]) -> bool: ...

    def place_batch(self, seqs: list[int], frees: list[list[int]], takes: list[list[int]]) -> None: ...

    def release(self, seq: int, held: list[int]) -> None: ...

    def fits(self, takes: list[int]) -> bool: ...

    def fits_empty(self, takes: list[int]) -> bool: ...

    def stretch_fits(self, takes: np.ndarray, frees: np.ndarray, per_seq: np.ndarray) -> int: ...

    def stretch_admits(self, takes: np.ndarray, frees: np.ndarray, head: list[int]) -> int: ...

    def place_steps(self, steps: Steps) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...

    def free_bytes(self) -> list[int]: ...

    def fixed_padding(self) -> int: ...

    def largest_allocatable(self) -> int: ...

    def used_blocks(self) -> int: ...

    def block_ids(self, seq: int, group: int) -> list[int]: ...

    @property
    def unit_kinds(self) -> list[str]: ...

    def unit_rows(self) -> np.ndarray: ...

    def check(self, held: list[int]) -> None: ...


class IdPool(ABC):
    """What pools that place block ids share: a batch placed one sequence at a time,
    a stretch placed step by step, and the safe stretch limits (frees ignored; the
    first step that frees anything may admit the head)."""

    groups: tuple[Group, ...]
    capacity: int
    needs_per_seq = False
    largest_is_free = True
    keeps_ids = True
    shares_blocks = False
    frees_on_failure = False
    unit_name = "block"

    def __init__(self, groups: tuple[Group, ...], capacity: int) -> None:
        self.groups = groups
        self.capacity = int(capacity)

    @abstractmethod
    def place(self, seq: int, frees: list[int], takes: list[int]) -> bool: ...

    @abstractmethod
    def release(self, seq: int, held: list[int]) -> None: ...

    @abstractmethod
    def fits(self, takes: list[int]) -> bool: ...

    @abstractmethod
    def fits_empty(self, takes: list[int]) -> bool: ...

    @abstractmethod
    def free_bytes(self) -> list[int]: ...

    @abstractmethod
    def fixed_padding(self) -> int: ...

    @abstractmethod
    def used_blocks(self) -> int: ...

    @abstractmethod
    def block_ids(self, seq: int, group: int) -> list[int]: ...

    @abstractmethod
    def unit_rows(self) -> np.ndarray: ...

    @abstractmethod
    def check(self, held: list[int]) -> None: ...

    def place_batch(self, seqs: list[int], frees: list[list[int]], takes: list[list[int]]) -> None:
        """Each sequence's move in turn (``[group][seq]``), known to fit."""
        place = self.place
        for seq, f, t in zip(seqs, zip(*frees, strict=True), zip(*takes, strict=True), strict=True):
            if (any(f) or any(t)) and not place(seq, list(f), list(t)):
                raise AssertionError("a move ran out of blocks it was told were free")

    def fits_batch(self, takes: list[list[int]], frees: list[list[int]]) -> bool:
        """Whether one step's moves surely fit: :meth:`stretch_fits` of that step."""
        per_seq = np.array(takes, dtype=np.int64)
        return self.stretch_fits(per_seq.sum(axis=1)[None, :], np.array(frees, dtype=np.int64).sum(axis=1)[None, :],
                                 per_seq[:, None, :]) == 1

    def stretch_fits(self, takes: np.ndarray, frees: np.ndarray, per_seq: np.ndarray) -> int:
        """The first step whose takes might not fit, frees ignored (safe for any pool)."""
        cum = np.cumsum(takes, axis=0)
        for j in range(len(cum)):
            if not self.fits(cum[j].tolist()):
                return j
        return len(cum)

    def stretch_admits(self, takes: np.ndarray, frees: np.ndarray, head: list[int]) -> int:
        """The first step that frees anything (safe: no later step can admit sooner)."""
        freeing = np.flatnonzero(frees.any(axis=1))
        return int(freeing[0]) if len(freeing) else len(takes)

    def largest_allocatable(self) -> int:
        return sum(self.free_bytes())

    def place_steps(self, steps: Steps) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The stretch's moves step by step; per step, the free bytes per group (and the
        pool), the largest allocatable bytes and the used blocks after it."""
        k, R = steps.k, len(self.groups)
        snapshot = (self.free_bytes(), self.largest_allocatable(), self.used_blocks())
        snaps, at = [snapshot], [0]
        for j, seqs, frees, takes in steps.by_step():
            self.place_batch(seqs, frees, takes)
            snaps.append((self.free_bytes(), self.largest_allocatable(), self.used_blocks()))
            at.append(j)
        if len(snaps) == 1:
            return (np.broadcast_to(np.array(snapshot[0], dtype=np.int64), (k, R + 1)),
                    np.full(k, snapshot[1], dtype=np.int64), np.full(k, snapshot[2], dtype=np.int64))
        # Step j holds the state after the last step at or before it that moved.
        which = np.searchsorted(np.array(at[1:], dtype=np.int64), np.arange(k), side="right")
        return (np.array([sn[0] for sn in snaps], dtype=np.int64)[which],
                np.array([sn[1] for sn in snaps], dtype=np.int64)[which],
                np.array([sn[2] for sn in snaps], dtype=np.int64)[which])

    @property
    def unit_kinds(self) -> list[str]:
        """What each group index of :meth:`unit_rows` holds."""
        return [g.kind for g in self.groups]


def rows_of_tables(tables: dict[int, list[list[int]]], num_units: int) -> np.ndarray:
    """Each of ``num_units`` block ids marked with the group whose table holds it, −1
    where none does (a pool's address map from its block tables)."""
    out = np.full(num_units, -1, dtype=np.int64)
    for mine in tables.values():
        for i, table in enumerate(mine):
            out[table] = i
    return out


def tables_of(tables: dict[int, Any], seq: int, group: int) -> list[int]:
    """A sequence's block ids of a group in ``tables`` (none: empty)."""
    mine = tables.get(seq)
    return list(mine[group]) if mine else []
