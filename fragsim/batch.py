"""The decoding batch as arrays, so that a stretch of steps is a few numpy calls.

A decoding sequence's stored length is not updated every step. The engine keeps
one global step counter ``g`` (steps completed so far) and each row an offset::

    filled(row) = offset[row] + g          (tokens whose KV is stored)

so ending a step is ``g += 1`` for the whole batch, whatever its size. Rows are
kept in no particular order; ``req`` (the request's arrival rank) gives the
order when one is needed (growth in arrival order, the latest arrival as the
preemption victim).

A row is one *sequence*: ``seq`` is its id with the allocator. A request decodes
one sequence, whose id is the request's own, unless it samples several or
searches a beam (:mod:`fragsim.sharing`): then several rows share one ``req``.
"""

from __future__ import annotations

import numpy as np


class DecodeBatch:
    """Struct of arrays over the sequences in their decode phase."""

    __slots__ = ("n", "req", "seq", "offset", "owned", "requested", "final", "_cap")

    def __init__(self, capacity: int = 64) -> None:
        self._cap = capacity
        self.n = 0
        self.req = np.zeros(capacity, dtype=np.int64)        # request index == arrival rank
        self.seq = np.zeros(capacity, dtype=np.int64)        # the allocator's sequence id
        self.offset = np.zeros(capacity, dtype=np.int64)     # filled = offset + g
        self.owned = np.zeros(capacity, dtype=np.int64)      # slots held (allocator's rounding)
        self.requested = np.zeros(capacity, dtype=np.int64)  # slots asked of the allocator
        self.final = np.zeros(capacity, dtype=np.int64)      # prompt + output

    def _grow(self) -> None:
        self._cap *= 2
        for name in ("req", "seq", "offset", "owned", "requested", "final"):
            old = getattr(self, name)
            new = np.zeros(self._cap, dtype=old.dtype)
            new[: self.n] = old[: self.n]
            setattr(self, name, new)

    def add(self, req: int, filled: int, g: int, owned: int, requested: int, final: int,
            seq: int | None = None) -> None:
        if self.n == self._cap:
            self._grow()
        i = self.n
        self.req[i] = req
        self.seq[i] = req if seq is None else seq
        self.offset[i] = filled - g
        self.owned[i] = owned
        self.requested[i] = requested
        self.final[i] = final
        self.n += 1

    def remove(self, row: int) -> None:
        """Swap-remove ``row`` (the last row takes its place)."""
        last = self.n - 1
        if row != last:
            for arr in (self.req, self.seq, self.offset, self.owned, self.requested, self.final):
                arr[row] = arr[last]
        self.n = last

    def remove_rows(self, rows: np.ndarray) -> None:
        keep = np.ones(self.n, dtype=bool)
        keep[rows] = False
        m = int(keep.sum())
        for arr in (self.req, self.seq, self.offset, self.owned, self.requested, self.final):
            arr[:m] = arr[: self.n][keep]
        self.n = m

    def row_of(self, req: int) -> int:
        rows = np.flatnonzero(self.req[: self.n] == req)
        if len(rows) != 1:
            raise KeyError(f"request {req} is not in the decode batch")
        return int(rows[0])

    # Views over the live rows.
    def view(self, name: str) -> np.ndarray:
        arr: np.ndarray = getattr(self, name)
        return arr[: self.n]
