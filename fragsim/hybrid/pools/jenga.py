"""Jenga's pool (SOSP 2025): large pages carved into small pages of each layer kind.

A large page is the least common multiple of the groups' small pages
(:func:`fragsim.hybrid.jenga.large_page`), so any large page can be cut into whole
small pages of any kind; the pool is a list of large pages, each free or carved for
one group. Allocation is request-aware (the paper's §4): a request's small pages go
first into large pages that already hold its pages of that kind, then into a fresh
large page, and only when none is left into other requests' partly used pages, so
that a request's small pages share large pages and a finished request frees whole
large pages. Free small pages in a carved large page are that group's free memory.
"""

from __future__ import annotations

import numpy as np

from fragsim.hybrid.groups import Group
from fragsim.hybrid.pools.base import IdPool, tables_of


class JengaPool(IdPool):
    """Two-level allocation: large pages for kinds, small pages for requests."""

    needs_per_seq = True
    largest_is_free = False
    unit_name = "large page"

    def __init__(self, groups: tuple[Group, ...], capacity: int, *, large_page_bytes: int) -> None:
        super().__init__(groups, capacity)
        self.large_page_bytes = large_page_bytes
        self.num_large = capacity // large_page_bytes
        self.per_large = [large_page_bytes // g.block_bytes for g in groups]
        self._free_large = list(range(self.num_large))   # LIFO: a freed large page is reused first
        self._kind_of = [-1] * self.num_large            # group a large page is carved for
        self._slots: dict[int, list[int]] = {}           # large page -> its free small slots
        self._partial: list[dict[int, None]] = [{} for _ in groups]  # per group: pages with free slots
        self._owners: dict[int, dict[int, int]] = {}     # large page -> {seq: small pages it holds}
        self._tables: dict[int, list[list[int]]] = {}    # small page id = large * per_large + slot
        self._free_slots = [0] * len(groups)             # per group: free small pages in its large pages
        # per group: seq -> its large pages of that group with a free small page
        self._open_of: list[dict[int, dict[int, None]]] = [{} for _ in groups]
        self._num_used = 0                               # small pages held, kept as they move

    def _available(self, group: int) -> int:
        return self._free_slots[group]

    def _can_take_with(self, takes: list[int], own_frees: list[int]) -> bool:
        """Whether the small pages fit, counting the sequence's own frees as free slots of
        their kind only (a free that empties a whole large page is not counted: safe)."""
        opens = 0
        for t, f, avail, per in zip(takes, own_frees, self._free_slots, self.per_large, strict=True):
            short = t - f - avail
            if short > 0:
                opens += -(-short // per)
        return opens <= len(self._free_large)

    def _take_small(self, seq: int, group: int, reserved: int, count: int = 1) -> list[int]:
        """``count`` small pages for ``seq``: in its own large pages of this kind, else
        fresh large pages while more than ``reserved`` (what later groups must open)
        remain, else in other requests' partly used pages."""
        self._num_used += count
        per = self.per_large[group]
        if per == 1:  # a small page is a whole large page: no partly used pages ever
            pages = [self._free_large.pop() for _ in range(count)]
            for whole in pages:
                self._kind_of[whole] = group
                self._slots[whole] = []
                self._owners[whole] = {seq: 1}
            return pages
        out: list[int] = []
        open_of, partial, all_slots, all_owners = self._open_of[group], self._partial[group], self._slots, self._owners
        while count:
            mine = open_of.get(seq)
            if mine:
                page = next(iter(mine))
            elif len(self._free_large) > reserved:
                page = self._free_large.pop()
                self._kind_of[page] = group
                all_slots[page] = list(range(per))
                partial[page] = None
                all_owners[page] = {}
                self._free_slots[group] += per
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
            self._free_slots[group] -= n
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
        """``page`` is no longer open to ``seq`` (``open_of``: its group's open pages)."""
        mine = open_of.get(seq)
        if mine is not None and page in mine:
            del mine[page]
            if not mine:
                del open_of[seq]

    def _opens(self, group: int, takes: int) -> int:
        """Large pages ``takes`` small pages of ``group`` must open beyond its free slots."""
        short = takes - self._available(group)
        return -(-short // self.per_large[group]) if short > 0 else 0

    def _give_back_many(self, seq: int, group: int, smalls: list[int]) -> None:
        """``seq``'s small pages ``smalls`` of ``group`` back, in turn, a run of pages in one
        large page at a time (the same lists and orders as page by page: only the first
        give of a run can find the page full, only its last can empty it). A page with
        room again is open to every request still in it; an empty one is a free large page."""
        self._num_used -= len(smalls)
        if self.per_large[group] == 1:   # each small page is a whole large page
            for small in smalls:
                del self._slots[small], self._owners[small]
                self._kind_of[small] = -1
                self._free_large.append(small)
            return
        per = self.per_large[group]
        open_of, partial, all_slots, all_owners = self._open_of[group], self._partial[group], self._slots, self._owners
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
                self._free_slots[group] += (j - i) - per
                self._free_large.append(page)
            else:
                self._free_slots[group] += j - i
            i = j

    def place(self, seq: int, frees: list[int], takes: list[int]) -> bool:
        if not self._can_take_with(takes, frees):
            return False
        tables = self._tables.get(seq)
        if tables is None:
            tables = self._tables[seq] = [[] for _ in self.groups]
        for i, f in enumerate(frees):
            if f:
                self._give_back_many(seq, i, tables[i][:f])
                del tables[i][:f]
        last = len(takes) - 1
        for i, t in enumerate(takes):
            if t:
                # the large pages later groups must open (their takes beyond their free slots)
                reserved = 0 if i == last else sum(self._opens(j, takes[j]) for j in range(i + 1, len(takes)))
                tables[i].extend(self._take_small(seq, i, reserved, t))
        return True

    def release(self, seq: int, held: list[int]) -> None:
        for i, table in enumerate(self._tables.pop(seq, [])):
            if table:
                self._give_back_many(seq, i, table)

    def fits(self, takes: list[int]) -> bool:
        return self._can_take_with(takes, [0] * len(takes))

    def fits_empty(self, takes: list[int]) -> bool:
        return sum(-(-t // p) for t, p in zip(takes, self.per_large, strict=True)) <= self.num_large

    def fits_batch(self, takes: list[list[int]], frees: list[list[int]]) -> bool:
        """:meth:`stretch_fits` of one step, in plain ints."""
        opens, in_slots = 0, True
        for t, f, per, avail in zip(takes, frees, self.per_large, self._free_slots, strict=True):
            total = sum(t)
            if total:
                opens += sum([-(-x // per) for x in t]) if per > 1 else total
                if in_slots and total > avail - (per - 1) * sum(f):
                    in_slots = False
        return in_slots or opens <= len(self._free_large)

    def stretch_fits(self, takes: np.ndarray, frees: np.ndarray, per_seq: np.ndarray) -> int:
        """The first step whose takes might fail. Request-aware placement opens a fresh
        large page whenever a request's own pages of a kind are full and one is free, so
        a step is safe while either

        * even that many openings (each request's takes, ``per_large`` a page) find
          free large pages (frees only add free pages), or
        * every group that takes in it still has a free small page for each take: its
          free slots less the takes so far, less ``per_large − 1`` for each free so far
          (a free that empties a large page turns its other free slots into a free
          large page, which another kind may take).

        (:meth:`stretch_admits` stays the safe default: a bound that lets a stretch run
        on through frees made longer stretches under pressure, but they stalled more
        often and were measured slower than stopping at the first free.)
        """
        cum = np.cumsum(per_seq, axis=1)                           # [groups, k, n]
        per = np.array(self.per_large)
        opens = (-(-cum // per[:, None, None])).sum(axis=(0, 2))   # [k]
        avail = np.array(self._free_slots)
        slots = avail - np.cumsum(takes, axis=0) - (per - 1) * np.cumsum(frees, axis=0)   # [k, groups]
        in_slots = ((slots >= 0) | (takes == 0)).all(axis=1)
        ok = (opens <= len(self._free_large)) | in_slots
        bad = np.flatnonzero(~ok)
        return int(bad[0]) if len(bad) else len(takes)

    # ---------------------------------------------------------------- sizes

    def used_blocks(self) -> int:
        """Small pages held."""
        return self._num_used

    def num_free_blocks(self) -> int:
        """Whole free large pages (the units any kind can be given)."""
        return len(self._free_large)

    def free_bytes(self) -> list[int]:
        out = [self._available(i) * g.block_bytes for i, g in enumerate(self.groups)]
        return out + [len(self._free_large) * self.large_page_bytes]

    def fixed_padding(self) -> int:
        return self.capacity - self.num_large * self.large_page_bytes

    def largest_allocatable(self) -> int:
        """Whole free large pages: what any kind can still be given."""
        return len(self._free_large) * self.large_page_bytes

    def block_ids(self, seq: int, group: int) -> list[int]:
        return tables_of(self._tables, seq, group)

    def unit_rows(self) -> np.ndarray:
        """Large pages: the group each is carved for, −1 where whole and free."""
        return np.array(self._kind_of, dtype=np.int64)

    def check(self, held: list[int]) -> None:
        assert self._num_used == sum(len(t) for tables in self._tables.values() for t in tables), "used pages"
        assert self._num_used == sum(held), "used pages against the sequences' blocks"
        carved = [p for p in range(self.num_large) if self._kind_of[p] >= 0]
        assert sorted(carved + self._free_large) == list(range(self.num_large)), "large pages lost"
        for p in carved:
            group = self._kind_of[p]
            per = self.per_large[group]
            mine = [s % per for tables in self._tables.values() for s in tables[group] if s // per == p]
            assert sorted(mine + self._slots[p]) == list(range(per)), f"large page {p}: slots"
            assert (p in self._partial[group]) == bool(self._slots[p]), f"large page {p}: partial list"
            assert sum(self._owners[p].values()) == len(mine), f"large page {p}: owners"
            assert mine, f"large page {p} is carved but empty"
        for group in range(len(self.groups)):
            assert self._free_slots[group] == sum(len(self._slots[p]) for p in self._partial[group])
        for group, open_of in enumerate(self._open_of):
            for seq, pages in open_of.items():
                assert pages and all(seq in self._owners[p] and self._kind_of[p] == group and self._slots[p]
                                     for p in pages), (seq, group)
        for p in carved:
            for seq in self._owners[p]:
                if self._slots[p]:
                    assert p in self._open_of[self._kind_of[p]].get(seq, {}), (p, seq)
