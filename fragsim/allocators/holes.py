"""Hole indexes for the contiguous allocator: which free run a request goes to.

A *hole* is a maximal run of free slots, ``(offset, size)``. The allocator keeps
its holes in dicts for coalescing and asks one of these indexes to pick:

- ``FirstFitIndex``: the lowest-offset hole with ``size >= num_slots``;
- ``BestFitIndex``: the smallest such hole, lowest offset among equal sizes.

Both answer in a few C-level list operations rather than a Python scan, since
the engine asks on every admission and a pool under load has a thousand holes.
Each has ``add``/``remove`` (the allocator calls them as holes appear, shrink
and merge), ``find``, ``largest`` and a ``check`` against the true hole list.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort

_CHUNK = 32  # first-fit chunks hold 1 .. 2 * _CHUNK holes


class FirstFitIndex:
    """Holes in offset order, cut into chunks, each with its largest hole::

        maxima   [   9,           4,         12   ]
        starts   [[0, 40, 77], [90, 130], [200, 260, 300]]
        sizes    [[3,  9,  2], [ 4,   1], [  5,  12,   1]]

    The first fitting hole is the first fitting entry of the first chunk whose
    max fits: two short scans done in C (``filter`` to find the value, then
    ``index`` to find where it is; an equal value before it would have been found
    first). A chunk that passes ``2 * chunk`` holes splits in two; an emptied
    chunk is dropped, and when chunks get sparse (more than ``2 * holes / chunk
    + 2`` of them) all are laid out again. The lists stay short and in cache,
    which a max tree over slot positions does not: on the benchmark's pools
    (a million slots, a thousand holes) that tree made first fit half as fast.
    """

    __slots__ = ("chunk", "firsts", "starts", "sizes", "maxima", "num_holes")

    def __init__(self, chunk: int = _CHUNK) -> None:
        self.chunk = chunk  # chunks hold 1 .. 2 * chunk holes
        self.firsts: list[int] = []  # starts[c][0] for each chunk c, to bisect on
        self.starts: list[list[int]] = []
        self.sizes: list[list[int]] = []
        self.maxima: list[int] = []
        self.num_holes = 0

    def find(self, num_slots: int) -> int | None:
        fits = num_slots.__le__
        maxima = self.maxima
        best = next(filter(fits, maxima), None)
        if best is None:
            return None
        chunk = maxima.index(best)
        sizes = self.sizes[chunk]
        return self.starts[chunk][sizes.index(next(filter(fits, sizes)))]

    def largest(self) -> int:
        return max(self.maxima, default=0)

    def add(self, offset: int, size: int) -> None:
        self.num_holes += 1
        firsts = self.firsts
        if not firsts:
            firsts.append(offset)
            self.starts.append([offset])
            self.sizes.append([size])
            self.maxima.append(size)
            return
        chunk = bisect_right(firsts, offset) - 1
        if chunk < 0:
            chunk = 0
            firsts[0] = offset
        starts = self.starts[chunk]
        sizes = self.sizes[chunk]
        at = bisect_left(starts, offset)
        starts.insert(at, offset)
        sizes.insert(at, size)
        if size > self.maxima[chunk]:
            self.maxima[chunk] = size
        half = self.chunk
        if len(starts) > 2 * half:
            self.starts.insert(chunk + 1, starts[half:])
            self.sizes.insert(chunk + 1, sizes[half:])
            del starts[half:], sizes[half:]
            firsts.insert(chunk + 1, self.starts[chunk + 1][0])
            self.maxima[chunk] = max(sizes)
            self.maxima.insert(chunk + 1, max(self.sizes[chunk + 1]))

    def remove(self, offset: int, size: int) -> None:
        self.num_holes -= 1
        chunk = bisect_right(self.firsts, offset) - 1
        starts = self.starts[chunk]
        sizes = self.sizes[chunk]
        at = bisect_left(starts, offset)
        del starts[at], sizes[at]
        if not starts:
            del self.firsts[chunk], self.starts[chunk], self.sizes[chunk], self.maxima[chunk]
            if len(self.maxima) * self.chunk > 2 * self.num_holes + 2 * self.chunk:
                self._rechunk()  # many part-empty chunks: lay them out again
            return
        if at == 0:
            self.firsts[chunk] = starts[0]
        if size == self.maxima[chunk]:
            self.maxima[chunk] = max(sizes)

    def _rechunk(self) -> None:
        starts = [offset for chunk in self.starts for offset in chunk]
        sizes = [size for chunk in self.sizes for size in chunk]
        step = self.chunk
        self.starts = [starts[i : i + step] for i in range(0, len(starts), step)]
        self.sizes = [sizes[i : i + step] for i in range(0, len(sizes), step)]
        self.firsts = [chunk[0] for chunk in self.starts]
        self.maxima = [max(chunk) for chunk in self.sizes]

    def check(self, holes: list[tuple[int, int]]) -> None:
        flat = [
            (o, s)
            for os, ss in zip(self.starts, self.sizes, strict=True)
            for o, s in zip(os, ss, strict=True)
        ]
        assert flat == holes, "first-fit chunks disagree with the holes"
        assert self.num_holes == len(holes), (
            f"first-fit index counts {self.num_holes} holes, not {len(holes)}"
        )
        assert all(1 <= len(c) <= 2 * self.chunk for c in self.starts), (
            "first-fit chunk empty or overfull"
        )
        assert self.firsts == [chunk[0] for chunk in self.starts], "first-fit chunk starts stale"
        assert self.maxima == [max(chunk) for chunk in self.sizes], "first-fit chunk maxima stale"


class BestFitIndex:
    """Holes as sorted keys ``size << shift | offset``: ``bisect`` for
    ``num_slots << shift`` lands on the smallest fitting size, lowest offset first."""

    __slots__ = ("keys", "shift", "mask")

    def __init__(self, capacity: int) -> None:
        self.keys: list[int] = []
        self.shift = capacity.bit_length()
        self.mask = (1 << self.shift) - 1

    def find(self, num_slots: int) -> int | None:
        keys = self.keys
        i = bisect_left(keys, num_slots << self.shift)
        return keys[i] & self.mask if i < len(keys) else None

    def largest(self) -> int:
        return self.keys[-1] >> self.shift if self.keys else 0

    def add(self, offset: int, size: int) -> None:
        insort(self.keys, size << self.shift | offset)

    def remove(self, offset: int, size: int) -> None:
        keys = self.keys
        del keys[bisect_left(keys, size << self.shift | offset)]

    def check(self, holes: list[tuple[int, int]]) -> None:
        assert self.keys == sorted(s << self.shift | o for o, s in holes), (
            "best-fit keys disagree with the holes"
        )
