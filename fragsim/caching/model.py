"""A byte-exact model of PyTorch's CUDA caching allocator.

Follows ``c10/cuda/CUDACachingAllocator.cpp`` and ``c10/core/AllocatorConfig.h`` of
the PyTorch 2.x line as shipped in torch 2.13 (the rules below have been stable
since 2.1; ``max_non_split_rounding_mb`` arrived in 2.4). One device, one stream,
no CUDA graphs, no ``record_stream`` events, no garbage-collection threshold.

The rules, with PyTorch's names::

    round_size       every request rounded up to 512 B (kMinBlockSize), or to a
                     power-of-2 division with roundup_power2_divisions
    pool             rounded size <= 1 MiB (kSmallSize): small pool, else large
    segment size     small: 2 MiB (kSmallBuffer); (1 MiB, 10 MiB): 20 MiB
                     (kLargeBuffer); >= 10 MiB (kMinLargeAlloc): rounded up to
                     2 MiB (kRoundLarge)
    best fit         the free block of the request's pool that is smallest, ties
                     to the lowest address (the pool is a set ordered by
                     (stream, size, address))
    split            small pool: remainder >= 512 B; large pool: remainder > 1 MiB
                     and request < max_split_size
    merge on free    only with free neighbours of the same segment
    out of memory    no cached block fits -> cudaMalloc a segment if the device has
                     room -> else free oversize cached segments (max_split_size
                     only) and retry -> else free every whole-free cached segment
                     (what empty_cache() does) and retry -> else OOM

A worked example, 3 MiB then 1000 B then 25 MiB on an empty device::

    large segment A, 20 MiB          small segment B, 2 MiB   large segment C, 26 MiB
    +--------+-------------------+   +------+-------------+   +------------------------+
    | 3 MiB  | 17 MiB free       |   | 1 KiB| 2047 KiB    |   | 26 MiB (25 requested)  |
    | alloc  |                   |   | alloc| free        |   | alloc, 1 MiB unsplit   |
    +--------+-------------------+   +------+-------------+   +------------------------+

C is 25 MiB rounded to 2 MiB; its 1 MiB tail is not > kSmallSize, so it stays
inside the block (internal fragmentation, allocated − requested).

Addresses are model addresses: each cudaMalloc takes the next 2 MiB-aligned range
of a bump pointer and ranges are never reused. Real cudaMalloc addresses differ, so
best-fit ties between equal-sized blocks in different segments may resolve
differently on a device (see :mod:`gpu_backend.native_caching`).

``expandable_segments`` follows the real design rather than abstracting it: one
segment per pool reserving 9/8 of the device's bytes of address space, physical
memory mapped in pages (2 MiB small pool, 20 MiB large pool), unmapped again page
by page when an OOM retry or :meth:`empty_cache` releases cached memory. Free pages
are fungible across the whole device, so only the partly used pages of a free run
are lost to fragmentation. Simplifications: physical mapping is all-or-nothing per
call, and a mapping must fit in ``device_bytes`` (on a real device: the memory
actually free).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class BlockInfo:
    """One block of :meth:`CachingAllocatorModel.segments`; ``state`` is
    ``active_allocated``, ``inactive`` or ``unmapped`` (expandable segments)."""

    address: int
    size: int
    requested: int
    state: str
    tag: str | None = None


@dataclass(frozen=True)
class SegmentInfo:
    """A segment as the model holds it (for expandable segments: the whole
    reserved address range, mapped or not)."""

    address: int
    size: int
    pool: str
    expandable: bool
    blocks: tuple[BlockInfo, ...]


class CachingAllocatorModel:
    """PyTorch's caching allocator on a device of ``device_bytes``.

    ``device_bytes`` is what cudaMalloc may hand out in total, checked as PyTorch
    checks its per-process memory fraction: a new segment (expandable: a mapping)
    of ``allocation_size`` bytes is refused when reserved + that would exceed it.
    On a device it stands for the ``set_per_process_memory_fraction`` limit, or the
    memory left after the CUDA context and everything outside PyTorch. Options
    follow ``PYTORCH_CUDA_ALLOC_CONF``:

    - ``max_split_size_mb`` (>= 20, as PyTorch checks): blocks of that size or more
      are never split; a request below it never takes such a block, a request of
      it or above takes one only if the block is less than
      ``max_non_split_rounding_mb`` (default 20) larger; on OOM, oversize cached
      segments are freed first.
    - ``expandable_segments``: see the module docstring.
    - ``roundup_power2_divisions``: one int for every size, or 16 ints for the
      power-of-2 intervals 1 MiB, 2 MiB, ... 32 GiB and above (index 0 also
      covers sizes under 1 MiB); each a power of two, 0 or 1 meaning off.
    """

    def __init__(
        self,
        device_bytes: int,
        *,
        max_split_size_mb: int | None = None,
        expandable_segments: bool = False,
        roundup_power2_divisions: int | Sequence[int] | None = None,
        max_non_split_rounding_mb: int = 20,
    ) -> None:
        if not isinstance(device_bytes, int) or isinstance(device_bytes, bool) or device_bytes < SMALL_BUFFER:
            raise ValueError(f'"device_bytes" must be an integer >= {SMALL_BUFFER}, got {device_bytes!r}')
        if max_split_size_mb is not None and (not isinstance(max_split_size_mb, int) or max_split_size_mb < 20):
            raise ValueError(f'"max_split_size_mb" must be None or an integer >= 20, got {max_split_size_mb!r}')
        if not isinstance(max_non_split_rounding_mb, int) or max_non_split_rounding_mb < 20:
            raise ValueError(
                f'"max_non_split_rounding_mb" must be an integer >= 20, got {max_non_split_rounding_mb!r}'
            )
        self.device_bytes = device_bytes
        self.max_split_size_mb = max_split_size_mb
        self.max_split_size = max_split_size_mb * MiB if max_split_size_mb is not None else None
        self.max_non_split_rounding = max_non_split_rounding_mb * MiB
        self.expandable_segments = bool(expandable_segments)
        self._divisions = self._parse_divisions(roundup_power2_divisions)
        self._any_divisions = any(d > 1 for d in self._divisions)

        self._segments: dict[int, _Segment] = {}
        self._next_addr = _BASE_ADDRESS
        # free mapped blocks, per pool, as a sorted list of (size, addr): best fit
        # is one bisect.
        self._free: dict[str, list[tuple[int, int]]] = {SMALL: [], LARGE: []}
        self._free_blocks: dict[int, _Block] = {}
        self._active: dict[int, _Block] = {}
        self._unmapped: dict[str, dict[int, _Block]] = {SMALL: {}, LARGE: {}}
        self._whole_free: dict[int, _Block] = {}  # free blocks spanning a whole segment

        self.reserved_bytes = 0
        self.allocated_bytes = 0
        self.requested_bytes = 0
        self.releasable_bytes = 0
        self.num_allocs = 0
        self.num_alloc_retries = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self.oom_events: list[dict[str, Any]] = []
        self._ops = 0

    # ---- configuration ------------------------------------------------------

    @staticmethod
    def _parse_divisions(value: int | Sequence[int] | None) -> tuple[int, ...]:
        if value is None:
            return (0,) * ROUNDUP_INTERVALS
        values = [value] * ROUNDUP_INTERVALS if isinstance(value, int) else list(value)
        if len(values) != ROUNDUP_INTERVALS:
            raise ValueError(
                f'"roundup_power2_divisions" must be one int or {ROUNDUP_INTERVALS} ints, got {value!r}'
            )
        for v in values:
            if not isinstance(v, int) or v < 0 or (v > 1 and v & (v - 1)):
                raise ValueError(
                    f'"roundup_power2_divisions" entries must be 0 or powers of two, got {v!r}'
                )
        return tuple(values)

    def round_size(self, size: int) -> int:
        """The block size a request of ``size`` bytes needs (PyTorch ``round_size``)."""
        if size < MIN_BLOCK_SIZE:
            return MIN_BLOCK_SIZE
        if not self._any_divisions:
            return (size + MIN_BLOCK_SIZE - 1) & -MIN_BLOCK_SIZE
        index = min(max(size.bit_length() - 1 - 20, 0), ROUNDUP_INTERVALS - 1)
        divisions = self._divisions[index]
        if divisions > 1 and size > MIN_BLOCK_SIZE * divisions:
            return _roundup_power2_next_division(size, divisions)
        return _round_up(size, MIN_BLOCK_SIZE)

    def _page(self, pool: str) -> int:
        return SMALL_BUFFER if pool == SMALL else LARGE_BUFFER

    # ---- the public verbs ----------------------------------------------------

    def malloc(self, size: int, tag: str | None = None) -> int | None:
        """Allocate ``size`` bytes; the block's address, or ``None`` on OOM (recorded
        in :attr:`oom_events`)."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f'"size" must be an integer >= 1, got {size!r}')
        self._ops += 1
        rounded = self.round_size(size)
        pool = SMALL if rounded <= SMALL_SIZE else LARGE
        alloc_size = allocation_size(rounded)
        block = self._get_free_block(pool, rounded)
        if block is None:
            block = self._alloc_block(pool, rounded, alloc_size)
        if block is None and self._release_available_cached_blocks(pool, rounded):
            block = self._alloc_block(pool, rounded, alloc_size)
        if block is None:
            self._release_cached_blocks()
            self.num_alloc_retries += 1
            block = self._alloc_block(pool, rounded, alloc_size)
        if block is None:
            self._record_oom(size, rounded, alloc_size, pool, tag)
            return None
        self._alloc_found_block(block, rounded, size, tag)
        return block.addr

    def free(self, addr: int) -> None:
        """Return a block to the cache, merging it with free neighbours of its segment."""
        block = self._active.pop(addr, None)
        if block is None:
            raise ValueError(f"free of {addr:#x}: not an allocated address")
        self._ops += 1
        block.allocated = False
        self.allocated_bytes -= block.size
        self.requested_bytes -= block.requested
        block.requested = 0
        block.tag = None
        prev, nxt = block.prev, block.next
        if prev is not None and prev.mapped and not prev.allocated:
            self._remove_free(prev)
            self._merge(block, prev)
        if nxt is not None and nxt.mapped and not nxt.allocated:
            self._remove_free(nxt)
            self._merge(block, nxt)
        self._insert_free(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release every cached segment that holds no
        allocation (expandable: unmap every free page)."""
        self._release_cached_blocks()

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

    # ---- malloc steps, named as in CUDACachingAllocator.cpp -------------------

    def _expandable_size(self, size: int, addr: int) -> int:
        b = self._free_blocks[addr]
        nxt = b.next
        return size + (nxt.size if nxt is not None and not nxt.mapped else 0)

    def _get_free_block(self, pool: str, size: int) -> _Block | None:
        lst = self._free[pool]
        i = bisect.bisect_left(lst, (size, 0))
        if i == len(lst):
            return None
        if self.expandable_segments:
            # A block that borders unmapped space counts as the size it can grow
            # to, so a later block that borders nothing is preferred to it.
            while i + 1 < len(lst) and self._expandable_size(*lst[i + 1]) < self._expandable_size(*lst[i]):
                i += 1
        found = lst[i][0]
        mss = self.max_split_size
        if mss is not None:
            if size < mss <= found:
                return None  # never hand an oversize block to a smaller request
            if size >= mss and found >= size + self.max_non_split_rounding:
                return None
        block = self._free_blocks[lst[i][1]]
        self._remove_free(block)
        return block

    def _alloc_block(self, pool: str, size: int, alloc_size: int) -> _Block | None:
        """cudaMalloc a new segment (expandable: map more pages); None if no room."""
        if self.reserved_bytes + alloc_size > self.device_bytes:
            return None
        if self.expandable_segments:
            return self._try_allocate_expandable_block(pool, size)
        segment = self._new_segment(alloc_size, pool, expandable=False)
        self.reserved_bytes += alloc_size
        self.num_device_alloc += 1
        return segment.head

    def _new_segment(self, size: int, pool: str, expandable: bool) -> _Segment:
        segment = _Segment(self._next_addr, size, pool, expandable)
        self._next_addr += _round_up(size, ROUND_LARGE)
        self._segments[segment.addr] = segment
        return segment

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.segment.pool == SMALL or self.expandable_segments:
            return remaining >= MIN_BLOCK_SIZE
        under_limit = self.max_split_size is None or size < self.max_split_size
        return under_limit and remaining > SMALL_SIZE

    def _alloc_found_block(self, block: _Block, size: int, requested: int, tag: str | None) -> None:
        if self._should_split(block, size):
            rest = _Block(block.addr + size, block.size - size, block.segment)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._insert_free(rest)
        block.allocated = True
        block.requested = requested
        block.tag = tag
        self._active[block.addr] = block
        self.allocated_bytes += block.size
        self.requested_bytes += requested
        self.num_allocs += 1

    def _release_segment(self, block: _Block) -> None:
        """cudaFree a whole-free, non-expandable segment."""
        self._remove_free(block)
        del self._segments[block.segment.addr]
        self.reserved_bytes -= block.size
        self.num_device_free += 1

    def _release_available_cached_blocks(self, pool: str, size: int) -> bool:
        """With max_split_size: free one oversize cached segment big enough, or the
        largest ones until their sum covers the request."""
        mss = self.max_split_size
        if mss is None or self.expandable_segments:
            return False
        key = max(size, mss)
        lst = self._free[pool]
        i = bisect.bisect_left(lst, (key, 0))
        if i < len(lst):
            block = self._free_blocks[lst[i][1]]
            if not block.whole:
                return False
            self._release_segment(block)
            return True
        released = 0
        while released < key and lst and lst[-1][0] >= mss:
            block = self._free_blocks[lst[-1][1]]
            if not block.whole:  # cannot happen: oversize blocks are never split
                break
            released += block.size
            self._release_segment(block)
        return released >= key

    def _release_cached_blocks(self) -> None:
        if self.expandable_segments:
            for pool in (LARGE, SMALL):
                for _, addr in list(self._free[pool]):
                    self._unmap_block(self._free_blocks[addr])
            return
        for block in list(self._whole_free.values()):
            self._release_segment(block)

    # ---- expandable segments --------------------------------------------------

    def _find_expandable_block(self, pool: str, size: int) -> _Block:
        """Lowest-address run of free and unmapped blocks with ``size`` bytes of room."""

        def has_room(b: _Block | None) -> bool:
            room = 0
            while b is not None and not b.allocated and room < size:
                room += b.size
                b = b.next
            return room >= size

        for addr in sorted(self._unmapped[pool]):
            c = self._unmapped[pool][addr]
            if c.prev is not None and c.prev.free:
                c = c.prev
            if has_room(c):
                return c
        page = self._page(pool)
        segment = self._new_segment(_round_up(self.device_bytes + self.device_bytes // 8, page), pool, True)
        self._unmapped[pool][segment.addr] = segment.head
        return segment.head

    def _map_block(self, block: _Block, size: int) -> _Block | None:
        """Back the first ``size`` bytes (whole pages) of unmapped ``block`` with memory."""
        mapped = min(_round_up(size, self._page(block.segment.pool)), block.size)
        if self.reserved_bytes + mapped > self.device_bytes:
            return None
        del self._unmapped[block.segment.pool][block.addr]
        if mapped < block.size:
            rest = _Block(block.addr + mapped, block.size - mapped, block.segment, mapped=False)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = mapped
            self._unmapped[block.segment.pool][rest.addr] = rest
        block.mapped = True
        for other in (block.prev, block.next):
            if other is not None and other.free:
                self._remove_free(other)
                self._merge(block, other)
        self._insert_free(block)
        self.reserved_bytes += mapped
        self.num_device_alloc += 1
        return block

    def _try_allocate_expandable_block(self, pool: str, size: int) -> _Block | None:
        candidate: _Block | None = self._find_expandable_block(pool, size)
        assert candidate is not None
        if not candidate.mapped:
            candidate = self._map_block(candidate, min(candidate.size, size))
        while candidate is not None and candidate.size < size:
            nxt = candidate.next
            assert nxt is not None and not nxt.mapped
            candidate = self._map_block(nxt, min(size - candidate.size, nxt.size))
        if candidate is None:
            return None
        self._remove_free(candidate)
        return candidate

    def _unmap_block(self, block: _Block) -> None:
        """Unmap the whole pages inside free ``block``; release an all-unmapped segment."""
        segment = block.segment
        page = self._page(segment.pool)
        start = segment.addr + _round_up(block.addr - segment.addr, page)
        end = segment.addr + (block.addr + block.size - segment.addr) // page * page
        if end <= start:
            return
        self._remove_free(block)
        if start > block.addr:
            before = _Block(block.addr, start - block.addr, segment)
            before.prev, before.next = block.prev, block
            if block.prev is not None:
                block.prev.next = before
            else:
                segment.head = before
            block.prev = before
            self._insert_free(before)
        if end < block.addr + block.size:
            after = _Block(end, block.addr + block.size - end, segment)
            after.prev, after.next = block, block.next
            if block.next is not None:
                block.next.prev = after
            block.next = after
            self._insert_free(after)
        block.addr, block.size, block.mapped = start, end - start, False
        for other in (block.prev, block.next):
            if other is not None and not other.mapped:
                del self._unmapped[segment.pool][other.addr]
                self._merge(block, other)
        self._unmapped[segment.pool][block.addr] = block
        self.reserved_bytes -= end - start
        self.num_device_free += 1
        if block.whole:
            del self._unmapped[segment.pool][block.addr]
            del self._segments[segment.addr]

    # ---- observation ------------------------------------------------------------

    def _record_oom(self, size: int, rounded: int, alloc_size: int, pool: str, tag: str | None) -> None:
        s = self.stats()
        self.oom_events.append({
            "op_index": self._ops - 1,
            "size": size,
            "rounded_size": rounded,
            "alloc_size": alloc_size,
            "pool": pool,
            "tag": tag,
            "reserved_bytes": s["reserved_bytes"],
            "allocated_bytes": s["allocated_bytes"],
            "inactive_bytes": s["inactive_bytes"],
            "device_free_bytes": s["device_free_bytes"],
            "total_free_bytes": s["total_free_bytes"],
            "largest_free_block": s["largest_free_block"],
            "largest_allocatable": s["largest_allocatable"],
            "enough_total_free": s["total_free_bytes"] >= size,
            "fragmentation_ratio": s["fragmentation_ratio"],
        })

    def largest_free_block(self) -> int:
        """Largest cached free block, either pool."""
        return max((lst[-1][0] for lst in self._free.values() if lst), default=0)

    def _reclaimable_pages(self) -> int:
        total = 0
        for block in self._free_blocks.values():
            seg, page = block.segment, self._page(block.segment.pool)
            start = _round_up(block.addr - seg.addr, page)
            end = (block.addr + block.size - seg.addr) // page * page
            total += max(0, end - start)
        return total

    def stats(self) -> dict[str, Any]:
        """Byte counters and both fragmentation ratios.

        ``inactive_bytes`` (= ``external_bytes``) is reserved but not allocated;
        ``inactive_split_bytes`` the part of it inside segments that also hold
        allocations (PyTorch's "non-releasable memory"; 0 with expandable segments,
        as PyTorch counts it). ``internal_bytes`` = allocated − requested: 512 B
        rounding plus remainders too small to split.

        Free memory is ``total_free_bytes`` = inactive + device memory not
        reserved. The largest request that could succeed now is
        ``largest_allocatable`` = max(largest cached free block, what cudaMalloc
        could get after releasing every whole-free segment, in 2 MiB units).
        Hence, with the seed's formula "1 − largest allocatable / total free":

        - ``fragmentation_ratio``: over the device, what a process can use;
        - ``reserved_fragmentation_ratio``: 1 − largest free block / inactive,
          inside the reserved memory only (memory_summary's view, and the only
          one a snapshot file allows).

        The largest allocatable ignores the pool split, the segment size a request
        needs (a 2 MiB request needs a 20 MiB segment) and max_split_size's oversize
        rules. With expandable segments, ``releasable_bytes`` counts the whole free
        pages that an OOM retry would unmap and map again where needed.
        """
        inactive = self.reserved_bytes - self.allocated_bytes
        device_free = self.device_bytes - self.reserved_bytes
        largest = self.largest_free_block()
        if self.expandable_segments:
            reclaimable = self._reclaimable_pages()
            grow = (device_free + reclaimable) // LARGE_BUFFER * LARGE_BUFFER
            inactive_split = 0
        else:
            reclaimable = self.releasable_bytes
            grow = (device_free + reclaimable) // ROUND_LARGE * ROUND_LARGE
            inactive_split = inactive - self.releasable_bytes
        largest_allocatable = max(largest, grow)
        total_free = inactive + device_free
        return {
            "device_bytes": self.device_bytes,
            "reserved_bytes": self.reserved_bytes,
            "allocated_bytes": self.allocated_bytes,
            "active_bytes": self.allocated_bytes,
            "requested_bytes": self.requested_bytes,
            "internal_bytes": self.allocated_bytes - self.requested_bytes,
            "inactive_bytes": inactive,
            "external_bytes": inactive,
            "inactive_split_bytes": inactive_split,
            "releasable_bytes": reclaimable,
            "device_free_bytes": device_free,
            "total_free_bytes": total_free,
            "largest_free_block": largest,
            "largest_allocatable": largest_allocatable,
            "fragmentation_ratio": max(0.0, 1 - largest_allocatable / total_free) if total_free else 0.0,
            "reserved_fragmentation_ratio": 1 - largest / inactive if inactive else 0.0,
            "num_segments": len(self._segments),
            "num_free_blocks": len(self._free_blocks),
            "num_active_blocks": len(self._active),
            "num_allocs": self.num_allocs,
            "num_alloc_retries": self.num_alloc_retries,
            "num_device_alloc": self.num_device_alloc,
            "num_device_free": self.num_device_free,
            "num_ooms": len(self.oom_events),
        }

    def segments(self) -> list[SegmentInfo]:
        """Every segment with its blocks, by address."""
        out = []
        for addr in sorted(self._segments):
            seg = self._segments[addr]
            blocks = tuple(
                BlockInfo(b.addr, b.size, b.requested, _state(b), b.tag) for b in seg.blocks()
            )
            out.append(SegmentInfo(seg.addr, seg.size, seg.pool, seg.expandable, blocks))
        return out

    def snapshot(self) -> list[dict[str, Any]]:
        """The segments in ``torch.cuda.memory_snapshot()`` form.

        As PyTorch does, an expandable segment is reported as one segment per
        contiguous mapped range; unmapped address space does not appear.
        """
        out: list[dict[str, Any]] = []
        for addr in sorted(self._segments):
            seg = self._segments[addr]
            run: list[_Block] = []
            for b in [*seg.blocks(), None]:
                if b is not None and b.mapped:
                    run.append(b)
                    continue
                if run:
                    out.append(_segment_dict(seg, run))
                    run = []
        return out

    def check(self) -> None:
        """Assert every invariant; cheap enough to call after each operation in tests."""
        reserved = allocated = requested = releasable = 0
        free_seen: set[int] = set()
        unmapped_seen: dict[str, set[int]] = {SMALL: set(), LARGE: set()}
        for addr, seg in self._segments.items():
            assert addr == seg.addr and seg.head.prev is None, "segment head"
            assert seg.pool != SMALL or seg.expandable or seg.size == SMALL_BUFFER, "small segment size"
            page = self._page(seg.pool)
            pos, prev = seg.addr, None
            for b in seg.blocks():
                assert b.segment is seg and b.prev is prev, "block chain"
                assert b.addr == pos and b.size > 0, f"blocks must tile segment {seg.addr:#x}"
                if prev is not None:
                    assert not (prev.free and b.free), "adjacent free blocks were not merged"
                    assert prev.mapped or b.mapped, "adjacent unmapped blocks were not merged"
                if not b.mapped:
                    assert seg.expandable and not b.allocated, "unmapped block outside expandable segment"
                    assert (b.addr - seg.addr) % page == 0 and b.size % page == 0, "unmapped not page aligned"
                    unmapped_seen[seg.pool].add(b.addr)
                else:
                    reserved += b.size
                if b.allocated:
                    assert self._active.get(b.addr) is b, "allocated block not in the active map"
                    assert b.requested <= b.size, "requested above block size"
                    allocated += b.size
                    requested += b.requested
                elif b.mapped:
                    assert self._free_blocks.get(b.addr) is b, "free block not in the free list"
                    free_seen.add(b.addr)
                    if b.whole and not seg.expandable:
                        releasable += b.size
                pos, prev = pos + b.size, b
            assert pos == seg.addr + seg.size, f"blocks of segment {seg.addr:#x} do not sum to its size"
        assert free_seen == set(self._free_blocks), "stale free-list entries"
        assert len(self._active) == sum(1 for b in self._active.values() if b.allocated), "stale active"
        for pool in (SMALL, LARGE):
            lst = self._free[pool]
            assert lst == sorted(lst), "free list out of order"
            assert all(self._free_blocks[a].size == s and self._free_blocks[a].segment.pool == pool
                       for s, a in lst), "free list entry disagrees with its block"
            assert set(self._unmapped[pool]) == unmapped_seen[pool], "unmapped index"
        assert len(self._free[SMALL]) + len(self._free[LARGE]) == len(self._free_blocks)
        assert reserved == self.reserved_bytes, "reserved_bytes"
        assert allocated == self.allocated_bytes, "allocated_bytes"
        assert requested == self.requested_bytes, "requested_bytes"
        assert releasable == self.releasable_bytes, "releasable_bytes"
        assert self.reserved_bytes <= self.device_bytes, "reserved above device capacity"


def _state(b: _Block) -> str:
    if not b.mapped:
        return "unmapped"
    return "active_allocated" if b.allocated else "inactive"


def _segment_dict(seg: _Segment, run: list[_Block]) -> dict[str, Any]:
    blocks = [
        {"address": b.addr, "size": b.size, "requested_size": b.requested, "state": _state(b), "frames": []}
        for b in run
    ]
    allocated = sum(b.size for b in run if b.allocated)
    return {
        "device": 0,
        "address": run[0].addr,
        "total_size": sum(b.size for b in run),
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": sum(b.requested for b in run if b.allocated),
        "stream": 0,
        "segment_type": seg.pool,
        "segment_pool_id": (0, 0),
        "is_expandable": seg.expandable,
        "frames": [],
        "blocks": blocks,
    }
