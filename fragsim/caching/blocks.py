"""Sizes, blocks and segments: the memory the caching-allocator model manages.

PyTorch's size constants and rounding rules, the blocks a segment is cut into
(chained by address), and :class:`BlockStore`, the segment map and the per-pool
free lists with the bookkeeping that keeps them consistent. The allocator
(:mod:`.model`) and its mixins (:mod:`.expandable`, :mod:`.report`) build on it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Any

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

MIN_BLOCK_SIZE = 512  # kMinBlockSize
SMALL_SIZE = 1 * MiB  # kSmallSize: largest request of the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: small-pool segment
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: segment for requests in (1 MiB, 10 MiB)
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB  # kRoundLarge
ROUNDUP_INTERVALS = 16  # power-of-2 intervals from 1 MiB to 64 GiB

SMALL, LARGE = "small", "large"
_BASE_ADDRESS = 0x7F00_0000_0000  # looks like a device pointer; any aligned value works


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def allocation_size(size: int) -> int:
    """Bytes cudaMalloc'ed for a new segment that must hold ``size`` rounded bytes."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return _round_up(size, ROUND_LARGE)


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """1200 with 4 divisions: between 1024 and 2048 the steps are 1024, 1280, 1536,
    1792, so 1280."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    return size if size % step == 0 else size - size % step + step


class _Block:
    """A piece of a segment: allocated, cached free, or (expandable) unmapped.

    ``prev``/``next`` chain a segment's blocks by address, as PyTorch's ``Block``
    does, so merging on free is O(1).
    """

    __slots__ = ("addr", "size", "segment", "requested", "allocated", "mapped", "prev", "next", "tag")

    def __init__(self, addr: int, size: int, segment: _Segment, mapped: bool = True) -> None:
        self.addr = addr
        self.size = size
        self.segment = segment
        self.requested = 0
        self.allocated = False
        self.mapped = mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.tag: str | None = None

    @property
    def free(self) -> bool:
        return self.mapped and not self.allocated

    @property
    def whole(self) -> bool:
        return self.prev is None and self.next is None


class _Segment:
    __slots__ = ("addr", "size", "pool", "expandable", "head")

    def __init__(self, addr: int, size: int, pool: str, expandable: bool) -> None:
        self.addr = addr
        self.size = size
        self.pool = pool
        self.expandable = expandable
        self.head = _Block(addr, size, self, mapped=not expandable)

    def blocks(self) -> list[_Block]:
        out: list[_Block] = []
        b: _Block | None = self.head
        while b is not None:
            out.append(b)
            b = b.next
        return out


class BlockStore:
    """Segments, their free blocks indexed per pool, and the counters both move.

    The attributes are set by :class:`fragsim.caching.model.CachingAllocatorModel`.
    """

    device_bytes: int
    expandable_segments: bool
    _segments: dict[int, _Segment]
    # free mapped blocks, per pool, as a sorted list of (size, addr): best fit
    # is one bisect.
    _free: dict[str, list[tuple[int, int]]]
    _free_blocks: dict[int, _Block]
    _active: dict[int, _Block]
    _unmapped: dict[str, dict[int, _Block]]
    _whole_free: dict[int, _Block]  # free blocks spanning a whole segment
    _next_addr: int
    _given_addresses: Iterator[int]

    reserved_bytes: int
    allocated_bytes: int
    requested_bytes: int
    releasable_bytes: int
    num_allocs: int
    num_alloc_retries: int
    num_device_alloc: int
    num_device_free: int
    oom_events: list[dict[str, Any]]

    # ---- segments ----------------------------------------------------------

    def _page(self, pool: str) -> int:
        return SMALL_BUFFER if pool == SMALL else LARGE_BUFFER

    def _new_segment(self, size: int, pool: str, expandable: bool) -> _Segment:
        addr = next(self._given_addresses, None)
        if addr is None:
            addr = self._next_addr
        self._next_addr = max(self._next_addr, addr + _round_up(size, ROUND_LARGE))
        segment = _Segment(addr, size, pool, expandable)
        self._segments[segment.addr] = segment
        return segment

    # ---- free-list bookkeeping ------------------------------------------------

    def _insert_free(self, block: _Block) -> None:
        pool = block.segment.pool
        bisect.insort(self._free[pool], (block.size, block.addr))
        self._free_blocks[block.addr] = block
        if block.prev is None and block.next is None and not block.segment.expandable:
            self._whole_free[block.addr] = block
            self.releasable_bytes += block.size

    def _remove_free(self, block: _Block) -> None:
        lst = self._free[block.segment.pool]
        i = bisect.bisect_left(lst, (block.size, block.addr))
        del lst[i]
        del self._free_blocks[block.addr]
        if block.prev is None and block.next is None and block.addr in self._whole_free:
            del self._whole_free[block.addr]
            self.releasable_bytes -= block.size

    @staticmethod
    def _merge(dst: _Block, src: _Block) -> None:
        """Fold neighbour ``src`` into ``dst``; neither may be in a free list."""
        if src is dst.prev:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
            elif dst.segment.head is src:
                dst.segment.head = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
