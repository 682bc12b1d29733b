"""Virtual-memory allocation: vAttention's virtually contiguous KV cache.

Every sequence gets a virtually contiguous buffer of ``max_seq_len`` tokens in
each of the ``2 × num_layers`` K and V buffers; physical pages are mapped under
it on demand, all buffers in lockstep (one more page in every buffer at once).
So the granularity is the page, counted in tokens of one buffer::

    token_bytes      = kv_heads_per_gpu × head_dim × dtype_bytes   (one token, one buffer)
    tokens_per_page  = page_bytes // token_bytes

and the internal fragmentation is the unfilled tail of the last page of every
buffer, as with a paged allocator whose ``block_size`` is ``tokens_per_page``.
Physically that is what this is: a FIFO free list of pages, a page table per
sequence (:class:`~fragsim.allocators.paged.PagedAllocator` underneath), and
``placement()`` returns the *physical* view ``BlockTable(tokens_per_page, page
ids)`` so the GPU side's block-table kernel reads it unchanged. The *virtual*
view is :meth:`VMMAllocator.virtual_extent`::

    page_bytes 64 KiB, token_bytes 4 KiB: 16 tokens a page; max_seq_len 40 -> 48-token ranges
    allocate(a, 20), allocate(b, 5)
    virtual   a: [0, 48)            b: [48, 96)      (reserved, never all mapped)
    mapped    a: pages 0, 1         b: page 2        (2 × 16 and 1 × 16 tokens)

Page tails. When ``token_bytes`` does not divide ``page_bytes`` a page holds
``tokens_per_page`` whole tokens and its last ``page_bytes mod token_bytes``
bytes hold nothing (NOTE: real vAttention lets a token straddle two pages of the
virtual buffer; keeping whole tokens per page is what makes the block-table view
exact, and the loss is reported rather than hidden). The pool is built from
bytes: the ``capacity`` slots the engine offers are ``capacity × token_bytes``
bytes per buffer, i.e. ``num_pages = capacity × token_bytes // page_bytes``
pages, and the allocator's own capacity is ``num_pages × tokens_per_page``
slots. ``page_tail_bytes`` (per buffer) and ``lost_slots`` (offered minus
usable) say what that costs.

Virtual ranges are handed out lowest index first (a heap), as vAttention reuses
the request slots of its preallocated virtual tensors. A sequence can never
outgrow its range: asking for more is a ``ValueError``, not a failed allocation,
because the engine refuses such requests on their length before they get here.
"""

from __future__ import annotations

import heapq

from fragsim.allocators.base import BlockTable, Extent
from fragsim.allocators.paged import PagedAllocator
from fragsim.allocators.reservation import check_choice, check_int

KiB = 1024
MiB = 1024 * KiB


class VMMAllocator(PagedAllocator):
    """Pages mapped on demand under per-sequence virtual ranges (vAttention)."""

    __slots__ = (
        "page_bytes",
        "token_bytes",
        "tokens_per_page",
        "num_pages",
        "page_tail_bytes",
        "lost_slots",
        "virtual_len",
        "_virtual",
        "_free_virtual",
        "_next_virtual",
    )

    def __init__(
        self,
        capacity: int,
        *,
        page_bytes: int = 64 * KiB,
        token_bytes: int = 4 * KiB,
        max_seq_len: int = 2048,
        reserve: str = "demand",
        name: str = "vmm",
    ) -> None:
        check_int("capacity", capacity, 1)
        self.token_bytes = check_int("token_bytes", token_bytes, 1)
        self.page_bytes = check_int("page_bytes", page_bytes, 1)
        if page_bytes < token_bytes:
            raise ValueError(
                f"page_bytes must be >= token_bytes={token_bytes} (a page holds whole tokens), "
                f"got {page_bytes}")
        tokens_per_page = page_bytes // token_bytes
        num_pages = capacity * token_bytes // page_bytes
        if num_pages < 1:
            raise ValueError(
                f"capacity must be >= one page ({page_bytes} bytes = "
                f"{-(-page_bytes // token_bytes)} slots of {token_bytes} bytes), got {capacity}")
        check_choice("reserve", reserve, ("demand",))
        super().__init__(num_pages * tokens_per_page, block_size=tokens_per_page,
                         max_seq_len=max_seq_len, reserve=reserve, name=name)
        self.placement_name = "vmm"
        self.tokens_per_page = tokens_per_page
        self.num_pages = num_pages
        self.page_tail_bytes = num_pages * (page_bytes - tokens_per_page * token_bytes)
        self.lost_slots = capacity - self.capacity
        self.virtual_len = -(-self.max_seq_len // tokens_per_page) * tokens_per_page
        self._virtual: dict[int, int] = {}
        self._free_virtual: list[int] = []
        self._next_virtual = 0

    def _check_range(self, seq_id: int, total: int) -> None:
        if total > self.virtual_len:
            raise ValueError(
                f"sequence {seq_id}: {total} slots exceed its virtual range of {self.virtual_len} "
                f"(max_seq_len {self.max_seq_len} in pages of {self.tokens_per_page} tokens)")

    def can_allocate(self, num_slots: int) -> bool:
        if num_slots > self.virtual_len:
            self._check_range(-1, num_slots)
        return super().can_allocate(num_slots)

    def allocate(self, seq_id: int, num_slots: int) -> BlockTable | None:
        if num_slots > self.virtual_len:
            self._check_range(seq_id, num_slots)
        table = super().allocate(seq_id, num_slots)
        if table is not None:
            if self._free_virtual:
                index = heapq.heappop(self._free_virtual)
            else:
                index = self._next_virtual
                self._next_virtual += 1
            self._virtual[seq_id] = index
        return table

    def extend(self, seq_id: int, num_slots: int) -> bool:
        entry = self._seqs.get(seq_id)
        if entry is not None and entry[0] + num_slots > self.virtual_len:
            self._check_range(seq_id, entry[0] + num_slots)
        return super().extend(seq_id, num_slots)

    def free(self, seq_id: int) -> None:
        super().free(seq_id)
        heapq.heappush(self._free_virtual, self._virtual.pop(seq_id))

    def virtual_extent(self, seq_id: int) -> Extent:
        """The sequence's virtual range, in slots of one buffer (``× token_bytes``: bytes)."""
        index = self._virtual.get(seq_id)
        if index is None:
            raise ValueError(f"unknown sequence {seq_id}")
        return Extent(index * self.virtual_len, self.virtual_len)

    def num_mapped_pages(self) -> int:
        """Physical pages mapped now, per buffer."""
        return self.num_pages - self.num_free_blocks()

    def check(self) -> None:
        super().check()
        assert self._virtual.keys() == self._seqs.keys(), "virtual ranges and sequences disagree"
        live = set(self._virtual.values())
        free = set(self._free_virtual)
        assert len(live) == len(self._virtual), "two sequences share a virtual range"
        assert not live & free and len(free) == len(self._free_virtual), "virtual range both free and live"
        assert live | free == set(range(self._next_virtual)), "virtual ranges lost"
        for seq_id, (requested, _) in self._seqs.items():
            assert requested <= self.virtual_len, f"seq {seq_id} outgrew its virtual range"
        assert self.capacity == self.num_pages * self.tokens_per_page
