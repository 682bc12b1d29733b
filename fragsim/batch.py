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
searches a beam (:mod:`fragsim.beams`): then several rows share one ``req``.

A row's ``room`` is the longest length it can reach before it must ask the KV
manager again (:mod:`fragsim.kv.protocol`): the engine asks for growth only when
``filled + 1`` passes it.

The five columns are the rows of one ``[5, capacity]`` array (``req``, ``seq``, ...
are views of its rows), so that removing rows, or reading every column of a few
rows (:meth:`DecodeBatch.columns`), is one numpy call rather than five: a batch of
a few dozen rows is small enough that the per-call cost is most of the cost.

Two sums the engine needs every step are kept as rows come and go:
:meth:`~DecodeBatch.offset_sum` (so the tokens the batch holds are
``offset_sum() + n·g``) and :meth:`~DecodeBatch.end_min`, the ``g`` at which the
first row completes (``final − offset`` is fixed for a row's life). Rows change
only through ``add``, ``remove``, ``remove_rows`` and ``clear``: ``offset`` and
``final`` are never written in place (``room`` is, by growth),
and a batch whose ``n`` was set from outside recomputes both sums on first use.

A request joins the batch once its prompt is processed; until then (its prompt
chunks spread over steps) it is one :class:`Prefill`, whatever its sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: the columns, in the order of the rows of the backing array
COLUMNS = ("req", "seq", "offset", "room", "final")
_NO_END = 1 << 62  # end_min of an empty batch


class DecodeBatch:
    """Struct of arrays over the sequences in their decode phase."""

    __slots__ = ("n", "req", "seq", "offset", "room", "final", "_cap", "_data",
                 "_sums_n", "_offset_sum", "_end_min")

    def __init__(self, capacity: int = 64) -> None:
        self._cap = capacity
        self.n = 0
        self._set_data(np.zeros((len(COLUMNS), capacity), dtype=np.int64))
        self._sums_at(0, 0, _NO_END)

    def _set_data(self, data: np.ndarray) -> None:
        self._data = data
        self.req = data[0]        # request index == arrival rank
        self.seq = data[1]        # the allocator's sequence id
        self.offset = data[2]     # filled = offset + g
        self.room = data[3]       # the longest length it reaches without asking the KV manager
        self.final = data[4]      # prompt + output

    def _grow(self) -> None:
        self._cap *= 2
        data = np.zeros((len(COLUMNS), self._cap), dtype=np.int64)
        data[:, : self.n] = self._data[:, : self.n]
        self._set_data(data)

    def _sums_at(self, n: int, offset_sum: int, end_min: int | None) -> None:
        """The kept sums are those of the first ``n`` rows (``end_min`` None: to recompute)."""
        self._sums_n = n
        self._offset_sum = offset_sum
        self._end_min = end_min

    def add(self, req: int, filled: int, g: int, room: int, final: int,
            seq: int | None = None) -> None:
        if self.n == self._cap:
            self._grow()
        i = self.n
        offset = filled - g
        self.req[i] = req
        self.seq[i] = req if seq is None else seq
        self.offset[i] = offset
        self.room[i] = room
        self.final[i] = final
        self.n = i + 1
        if self._sums_n == i:
            self._sums_n = i + 1
            self._offset_sum += offset
            end_min = self._end_min
            if end_min is not None and final - offset < end_min:
                self._end_min = final - offset
        else:
            self._sums_n = -1

    def pause(self) -> None:
        """Every row skips the step now ending: its length stays while ``g`` advances
        (a prompt-only step of vLLM 0.1's scheduler)."""
        n = self.n
        if not n:
            return
        self.offset[:n] -= 1
        if self._sums_n == n:  # else they are worked out anew when asked
            end_min = self._end_min
            self._sums_at(n, self._offset_sum - n, None if end_min is None else end_min + 1)

    def remove(self, row: int) -> None:
        """Swap-remove ``row`` (the last row takes its place)."""
        last = self.n - 1
        valid = self._sums_n == self.n
        gone = int(self.offset[row])
        if row != last:
            data = self._data
            data[:, row] = data[:, last]
        self.n = last
        if valid:
            self._sums_at(last, self._offset_sum - gone, None)
        else:
            self._sums_at(-1, 0, None)

    def remove_rows(self, rows: np.ndarray) -> None:
        """Remove ``rows`` (indices or a mask); the others keep their order."""
        rows = np.asarray(rows)
        if rows.dtype == bool:
            rows = rows.nonzero()[0]
        n = self.n
        valid = self._sums_n == n
        if len(rows) <= 4:
            # A step completes a row or two: shifting the rows after each is cheaper
            # than a compaction through a mask.
            data, offset, gone = self._data, self.offset, 0
            for row in sorted(set(rows.tolist()), reverse=True):
                gone += int(offset[row])
                data[:, row : n - 1] = data[:, row + 1 : n]
                n -= 1
            self.n = n
            if valid:
                self._sums_at(n, self._offset_sum - gone, None)
            else:
                self._sums_at(-1, 0, None)
            return
        keep = np.ones(n, dtype=bool)
        keep[rows] = False
        kept = self._data[:, :n][:, keep]
        m = kept.shape[1]
        self._data[:, :m] = kept
        self.n = m
        self._sums_at(m, int(kept[2].sum()), None)

    def clear(self) -> None:
        """Remove every row."""
        self.n = 0
        self._sums_at(0, 0, _NO_END)

    def _recompute(self) -> None:
        n = self.n
        offset = self.offset[:n]
        self._sums_at(n, int(offset.sum()), int((self.final[:n] - offset).min()) if n else _NO_END)

    def offset_sum(self) -> int:
        """Σ offset over the rows: they hold ``offset_sum() + n·g`` tokens."""
        if self._sums_n != self.n:
            self._recompute()
        return self._offset_sum

    def end_min(self) -> int:
        """The step count ``g`` at which the first row completes: min(final − offset)
        (a huge number when the batch is empty)."""
        if self._sums_n != self.n:
            self._recompute()
        end_min = self._end_min
        if end_min is None:
            n = self.n
            end_min = self._end_min = int((self.final[:n] - self.offset[:n]).min()) if n else _NO_END
        return end_min

    def columns(self, rows: np.ndarray | list[int]) -> list[list[int]]:
        """Every column at ``rows``, as lists in :data:`COLUMNS` order (one numpy call)."""
        result: list[list[int]] = self._data[:, rows].tolist()
        return result

    def row_of(self, req: int) -> int:
        rows = np.flatnonzero(self.req[: self.n] == req)
        if len(rows) != 1:
            raise KeyError(f"request {req} is not in the decode batch")
        return int(rows[0])

    # Views over the live rows.
    def view(self, name: str) -> np.ndarray:
        arr: np.ndarray = getattr(self, name)
        return arr[: self.n]


@dataclass(slots=True)
class Prefill:
    """A request whose prompt (or, after recompute, prompt + generated) is being processed."""

    req: int
    target: int                 # tokens to process
    done: int                   # processed so far; filled == done until the last chunk
    seqs: tuple[int, ...]       # its sequences, the request's own first
    rooms: tuple[int, ...]      # their rooms (KV manager)
    shared: int = 0             # slots its sequences share among themselves
    cached: int = 0             # leading tokens found in the prefix cache (done started there)
    loading: int = 0            # tokens being loaded from an offload tier (it waits for them)
    parked: bool = False        # loaded, waiting for a running slot (vLLM: kv_holding_waiting)

    @property
    def running(self) -> bool:
        """In the running set: not waiting for KV, nor for a slot once its KV landed."""
        return not self.loading and not self.parked
