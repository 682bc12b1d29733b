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

The pages live in a :class:`~fragsim.hybrid.pools.jenga.JengaPool`. When every
small page is a whole large page (the kinds' pages are equal, as in gpt-oss or
Mistral) and no address map is drawn, nothing depends on which large page a
sequence holds, and the pool is a :class:`~fragsim.hybrid.pools.ledger.Ledger` of
free large pages (``track_ids=False``: the same results, faster).
"""

from __future__ import annotations

import math
from dataclasses import replace

from fragsim.hybrid.groups import Group
from fragsim.hybrid.manager import HybridManager
from fragsim.hybrid.pools import Bin, JengaPool, Ledger, Pool


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
        self.num_large = capacity // self.large_page_bytes
        if self.num_large < 1:
            raise ValueError(f"{capacity:,} bytes hold no {self.large_page_bytes:,}-byte large page")
        self.per_large = [self.large_page_bytes // r.block_bytes for r in padded]
        pool: Pool
        if track_ids or any(p > 1 for p in self.per_large):
            pool = JengaPool(padded, capacity, large_page_bytes=self.large_page_bytes)
        else:   # whole pages, and a kind's frees pay only its own takes, as in the pool with ids
            pool = Ledger(padded, capacity, [Bin(self.num_large, self.large_page_bytes, tuple(range(len(padded))),
                                                 own_credit=True)])
        super().__init__(name=name, placement="jenga", pool=pool, max_seq_len=max_seq_len)

    def num_free_large(self) -> int:
        """Whole free large pages."""
        return self.pool.num_free_blocks()  # type: ignore[attr-defined,no-any-return]
