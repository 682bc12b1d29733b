"""Jenga (SOSP 2025): large pages carved into small pages of each layer kind.

Every row (layer kind) has its own small page: ``block_size`` tokens of its
layers' KV, or one state. A large page is the least common multiple of the small
pages, so any large page can be cut into whole small pages of any kind; the pool
is a list of large pages, each free or carved for one kind. Allocation is
request-aware (the paper's §4): a request's small pages go first into large pages
that already hold its pages of that kind, then into a fresh large page, and only
when none is left into other requests' partly used pages, so that a request's
small pages share large pages and a finished request frees whole large pages.

What remains is large-page fragmentation: free small pages stranded in large
pages carved for one kind, which another kind cannot use. They count as that
row's ``free`` memory, and the external-fragmentation ratio is the share of free
memory outside whole free large pages.

When the least common multiple is far larger than the pages (a Mamba state and
a 16-token attention page rarely share many factors), small pages are padded up
to multiples of a power of two until it is at most ``max_large_ratio`` times the
largest page; the padding shows as ``padding``.

When every small page is a whole large page (the kinds' pages are equal, as in
gpt-oss or Mistral) and no address map is drawn, nothing depends on which large
page a sequence holds, and the manager keeps the count of free large pages only
(``track_ids=False``: the same results, faster).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from fragsim.hybrid.groups import Group
from fragsim.hybrid.manager import HybridManager, one_pool_admits, one_pool_fits


def large_page(rows: tuple[Group, ...], max_large_ratio: int = 16) -> tuple[int, tuple[Group, ...]]:
    """The large page's bytes and the rows with their (maybe padded) small pages."""
    pages = [r.block_bytes for r in rows]
    largest = max(pages)
    unit = 1
    while True:
        padded = [-(-p // unit) * unit for p in pages]
        lcm = math.lcm(*padded)
        if lcm <= max_large_ratio * max(padded) or unit >= largest:
            break
        unit *= 2
    return lcm, tuple(replace(r, block_bytes=p) for r, p in zip(rows, padded, strict=True))


class JengaManager(HybridManager):
    """Two-level allocation: large pages for kinds, small pages for requests."""

    def __init__(self, rows: tuple[Group, ...], capacity: int, *, max_seq_len: int,
                 max_large_ratio: int = 16, name: str = "jenga", track_ids: bool = True) -> None:
        self.large_page_bytes, padded = large_page(rows, max_large_ratio)
        super().__init__(name=name, placement="jenga", rows=padded, capacity=capacity,
                         max_seq_len=max_seq_len)
        self.num_large = capacity // self.large_page_bytes
        if self.num_large < 1:
            raise ValueError(f"{capacity:,} bytes hold no {self.large_page_bytes:,}-byte large page")
        self.per_large = [self.large_page_bytes // r.block_bytes for r in padded]
        self._free_large = list(range(self.num_large))   # LIFO: a freed large page is reused first
        self._kind_of = [-1] * self.num_large            # row a large page is carved for
        self._slots: dict[int, list[int]] = {}           # large page -> its free small slots
        self._partial: list[dict[int, None]] = [{} for _ in padded]  # per row: pages with free slots
        self._owners: dict[int, dict[int, int]] = {}     # large page -> {seq: small pages it holds}
        self._tables: dict[int, list[list[int]]] = {}    # small page id = large * per_large + slot
        self._free_slots = [0] * len(padded)             # per row: free small pages in its large pages
        # per row: seq -> its large pages of that row with a free small page
        self._open_of: list[dict[int, dict[int, None]]] = [{} for _ in padded]
        self._num_used = 0                               # small pages held, kept as they move
        #: False: small pages are whole large pages and only the free ones are counted
        self.tracks_ids = track_ids or any(p > 1 for p in self.per_large)
        self._free_count = self.num_large

    # ------------------------------------------------ counts (whole large pages)

    def _count_steps(self, frees: np.ndarray, takes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._count_one_pool(frees, takes, self.large_page_bytes, self.num_large)

    def _fits_moves(self, takes: list[list[int]], frees: list[list[int]]) -> bool:
        if not self.tracks_ids:
            return sum(map(sum, takes)) <= self._free_count
        # :meth:`_stretch_fits` of one step, in plain ints
        opens, in_slots = 0, True
        for t, f, per, avail in zip(takes, frees, self.per_large, self._free_slots, strict=True):
            total = sum(t)
            if total:
                opens += sum([-(-x // per) for x in t]) if per > 1 else total
                if in_slots and total > avail - (per - 1) * sum(f):
                    in_slots = False
        return in_slots or opens <= len(self._free_large)

    def _place_moves(self, seqs: list[int], frees: list[list[int]], takes: list[list[int]]) -> None:
        if self.tracks_ids:
            super()._place_moves(seqs, frees, takes)
            return
        self._free_count += sum(map(sum, frees)) - sum(map(sum, takes))
        if self._free_count < 0:
            raise AssertionError("a page move failed inside a stretch that had room for it")

    # ------------------------------------------------------------- placement

    def _available(self, row: int) -> int:
        return self._free_slots[row]

    def _can_take_with(self, takes: list[int], own_frees: list[int]) -> bool:
        """Whether the small pages fit, counting the sequence's own frees as free slots of
        their kind only (a free that empties a whole large page is not counted: safe)."""
        opens = 0
        for t, f, avail, per in zip(takes, own_frees, self._free_slots, self.per_large, strict=True):
            short = t - f - avail
            if short > 0:
                opens += -(-short // per)
        return opens <= len(self._free_large)

    def _take_small(self, seq: int, row: int, reserved: int, count: int = 1) -> list[int]:
        """``count`` small pages for ``seq``: in its own large pages of this kind, else
        fresh large pages while more than ``reserved`` (what later rows must open)
        remain, else in other requests' partly used pages."""
        self._num_used += count
        per = self.per_large[row]
        if per == 1:  # a small page is a whole large page: no partly used pages ever
            pages = [self._free_large.pop() for _ in range(count)]
            for whole in pages:
                self._kind_of[whole] = row
                self._slots[whole] = []
                self._owners[whole] = {seq: 1}
            return pages
        out: list[int] = []
        open_of, partial, all_slots, all_owners = self._open_of[row], self._partial[row], self._slots, self._owners
        while count:
            mine = open_of.get(seq)
            if mine:
                page = next(iter(mine))
            elif len(self._free_large) > reserved:
                page = self._free_large.pop()
                self._kind_of[page] = row
                all_slots[page] = list(range(per))
                partial[page] = None
                all_owners[page] = {}
                self._free_slots[row] += per
            else:
                page = next(iter(partial))
            slots = all_slots[page]
            n = count if count < len(slots) else len(slots)
            base = page * per
            if n == 1:
                out.append(base + slots.pop(0))
            else:
                out.extend([base + slot for slot in slots[:n]])
                del slots[:n]
            count -= n
            self._free_slots[row] -= n
            owners = all_owners[page]
            owners[seq] = owners.get(seq, 0) + n
            if slots:
                if mine is None:
                    open_of[seq] = {page: None}
                else:
                    mine[page] = None
            else:  # full: no owner finds room in it any more
                del partial[page]
                for owner in owners:
                    self._close(open_of, owner, page)
        return out

    @staticmethod
    def _close(open_of: dict[int, dict[int, None]], seq: int, page: int) -> None:
        """``page`` is no longer open to ``seq`` (``open_of``: its row's open pages)."""
        mine = open_of.get(seq)
        if mine is not None and page in mine:
            del mine[page]
            if not mine:
                del open_of[seq]

    def _opens(self, row: int, takes: int) -> int:
        """Large pages ``takes`` small pages of ``row`` must open beyond its free slots."""
        short = takes - self._available(row)
        return -(-short // self.per_large[row]) if short > 0 else 0

    def _give_back_many(self, seq: int, row: int, smalls: list[int]) -> None:
        """``seq``'s small pages ``smalls`` of ``row`` back, in turn, a run of pages in one
        large page at a time (the same lists and orders as page by page: only the first
        give of a run can find the page full, only its last can empty it). A page with
        room again is open to every request still in it; an empty one is a free large page."""
        self._num_used -= len(smalls)
        if self.per_large[row] == 1:   # each small page is a whole large page
            for small in smalls:
                del self._slots[small], self._owners[small]
                self._kind_of[small] = -1
                self._free_large.append(small)
            return
        per = self.per_large[row]
        open_of, partial, all_slots, all_owners = self._open_of[row], self._partial[row], self._slots, self._owners
        i, n = 0, len(smalls)
        while i < n:
            page = smalls[i] // per
            j = i + 1
            while j < n and smalls[j] // per == page:
                j += 1
            base = page * per
            slots = all_slots[page]
            was_full = not slots
            if j == i + 1:
                slots.append(smalls[i] - base)
            else:
                slots.extend([small - base for small in smalls[i:j]])
            partial[page] = None
            owners = all_owners[page]
            left = owners[seq] - (j - i)
            if left:
                owners[seq] = left
            else:
                del owners[seq]
                self._close(open_of, seq, page)
            if was_full:  # room again for those still in it
                for owner in owners:
                    mine = open_of.get(owner)
                    if mine is None:
                        open_of[owner] = {page: None}
                    else:
                        mine[page] = None
            if len(slots) == per:  # the whole large page is free again
                del partial[page], all_slots[page], all_owners[page]
                self._kind_of[page] = -1
                self._free_slots[row] += (j - i) - per
                self._free_large.append(page)
            else:
                self._free_slots[row] += j - i
            i = j

    def _place(self, seq: int, frees: list[int], takes: list[int]) -> bool:
        if not self.tracks_ids:
            # whole pages: a row's own frees cover its takes, the rest opens free pages
            if sum(t - f for t, f in zip(takes, frees, strict=True) if t > f) > self._free_count:
                return False
            self._free_count += sum(frees) - sum(takes)
            return True
        if not self._can_take_with(takes, frees):
            return False
        tables = self._tables.get(seq)
        if tables is None:
            tables = self._tables[seq] = [[] for _ in self.rows]
        for i, f in enumerate(frees):
            if f:
                self._give_back_many(seq, i, tables[i][:f])
                del tables[i][:f]
        last = len(takes) - 1
        for i, t in enumerate(takes):
            if t:
                # the large pages later rows must open (their takes beyond their free slots)
                reserved = 0 if i == last else sum(self._opens(j, takes[j]) for j in range(i + 1, len(takes)))
                tables[i].extend(self._take_small(seq, i, reserved, t))
        return True

    def _release(self, seq: int, held: list[int]) -> None:
        if not self.tracks_ids:
            self._free_count += sum(held)
            return
        for i, table in enumerate(self._tables.pop(seq, [])):
            if table:
                self._give_back_many(seq, i, table)

    # ---------------------------------------------------------------- sizes

    def num_used_blocks(self) -> int:
        """Small pages held."""
        return self._num_used if self.tracks_ids else self.num_large - self._free_count

    def num_free_large(self) -> int:
        return len(self._free_large) if self.tracks_ids else self._free_count

    def _free_bytes(self) -> list[int]:
        if not self.tracks_ids:
            return [0] * len(self.rows) + [self._free_count * self.large_page_bytes]
        out = [self._available(i) * r.block_bytes for i, r in enumerate(self.rows)]
        return out + [len(self._free_large) * self.large_page_bytes]

    def _fixed_padding(self) -> int:
        return self.capacity - self.num_large * self.large_page_bytes

    def _can_take(self, takes: list[int]) -> bool:
        if not self.tracks_ids:
            return sum(takes) <= self._free_count
        return self._can_take_with(takes, [0] * len(takes))

    def _stretch_fits(self, takes: np.ndarray, frees: np.ndarray, per_seq: np.ndarray) -> int:
        """The first step whose takes might fail. Request-aware placement opens a fresh
        large page whenever a request's own pages of a kind are full and one is free, so
        a step is safe while either

        * even that many openings (each request's takes, ``per_large`` a page) find
          free large pages (frees only add free pages), or
        * every row that takes in it still has a free small page for each take: its
          free slots less the takes so far, less ``per_large − 1`` for each free so far
          (a free that empties a large page turns its other free slots into a free
          large page, which another kind may take).
        """
        if not self.tracks_ids:   # whole pages: one pool of them
            return one_pool_fits(takes, frees, self._free_count)
        cum = np.cumsum(per_seq, axis=1)                           # [R, k, n]
        per = np.array(self.per_large)
        opens = (-(-cum // per[:, None, None])).sum(axis=(0, 2))   # [k]
        avail = np.array(self._free_slots)
        slots = avail - np.cumsum(takes, axis=0) - (per - 1) * np.cumsum(frees, axis=0)   # [k, R]
        in_slots = ((slots >= 0) | (takes == 0)).all(axis=1)
        ok = (opens <= len(self._free_large)) | in_slots
        bad = np.flatnonzero(~ok)
        return int(bad[0]) if len(bad) else len(takes)

    def _stretch_admits(self, takes: np.ndarray, frees: np.ndarray, head: list[int]) -> int:
        if self.tracks_ids:
            # A bound that lets a stretch run on through frees (each small page freed lowers
            # the large pages a head must open by at most one) makes longer stretches under
            # pressure, but they stall more often and were measured slower than stopping at
            # the first free: the default stands.
            return super()._stretch_admits(takes, frees, head)
        return one_pool_admits(takes, frees, self._free_count, sum(head))

    def _fits_empty(self, takes: list[int]) -> bool:
        return sum(-(-t // p) for t, p in zip(takes, self.per_large, strict=True)) <= self.num_large

    largest_is_free = False

    def largest_allocatable(self) -> int:
        """Whole free large pages: what any kind can still be given."""
        return self.num_free_large() * self.large_page_bytes

    def _block_ids(self, seq: int, row: int) -> list[int]:
        if not self.tracks_ids:
            raise ValueError("this jenga manager keeps page counts only (track_ids=False)")
        tables = self._tables.get(seq)
        return list(tables[row]) if tables else []

    def unit_rows(self) -> np.ndarray:
        """Large pages: the row each is carved for, −1 where whole and free."""
        if not self.tracks_ids:
            raise ValueError("this jenga manager keeps page counts only (track_ids=False)")
        return np.array(self._kind_of, dtype=np.int64)

    def _check_pool(self) -> None:
        if not self.tracks_ids:
            assert self._free_count + sum(self.held_blocks) == self.num_large, "large pages lost"
            return
        assert self._num_used == sum(len(t) for tables in self._tables.values() for t in tables), "used pages"
        carved = [p for p in range(self.num_large) if self._kind_of[p] >= 0]
        assert sorted(carved + self._free_large) == list(range(self.num_large)), "large pages lost"
        for p in carved:
            row = self._kind_of[p]
            per = self.per_large[row]
            held = [s % per for tables in self._tables.values() for s in tables[row] if s // per == p]
            assert sorted(held + self._slots[p]) == list(range(per)), f"large page {p}: slots"
            assert (p in self._partial[row]) == bool(self._slots[p]), f"large page {p}: partial list"
            assert sum(self._owners[p].values()) == len(held), f"large page {p}: owners"
            assert held, f"large page {p} is carved but empty"
        for row in range(len(self.rows)):
            assert self._free_slots[row] == sum(len(self._slots[p]) for p in self._partial[row])
        for row, open_of in enumerate(self._open_of):
            for seq, pages in open_of.items():
                assert pages and all(seq in self._owners[p] and self._kind_of[p] == row and self._slots[p]
                                     for p in pages), (seq, row)
        for p in carved:
            for seq in self._owners[p]:
                if self._slots[p]:
                    assert p in self._open_of[self._kind_of[p]].get(seq, {}), (p, seq)
