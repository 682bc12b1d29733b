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
from collections.abc import Iterable, Sequence

from fragsim.caching.blocks import (
    _BASE_ADDRESS,
    LARGE,
    LARGE_BUFFER,
    MIN_BLOCK_SIZE,
    ROUNDUP_INTERVALS,
    SMALL,
    SMALL_BUFFER,
    SMALL_SIZE,
    GiB,
    KiB,
    MiB,
    _Block,
    _round_up,
    _roundup_power2_next_division,
    allocation_size,
)
from fragsim.caching.expandable import ExpandableSegmentsMixin
from fragsim.caching.report import BlockInfo, ReportMixin, SegmentInfo

__all__ = [
    "LARGE_BUFFER",
    "BlockInfo",
    "CachingAllocatorModel",
    "GiB",
    "KiB",
    "MiB",
    "SegmentInfo",
    "_roundup_power2_next_division",
    "allocation_size",
]


class CachingAllocatorModel(ExpandableSegmentsMixin, ReportMixin):
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
    - ``segment_addresses``: the addresses a real device gave its segments, in the
      order they were allocated; each new segment takes the next one (then the bump
      pointer, past every address given). Best-fit ties between equal-sized free
      blocks go to the lowest address, so a replay that mirrors a device's addresses
      breaks ties as that device did (:func:`gpu_backend.native_caching.replay_native`).
    """

    def __init__(
        self,
        device_bytes: int,
        *,
        max_split_size_mb: int | None = None,
        expandable_segments: bool = False,
        roundup_power2_divisions: int | Sequence[int] | None = None,
        max_non_split_rounding_mb: int = 20,
        segment_addresses: Iterable[int] | None = None,
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

        self._segments = {}
        self._next_addr = _BASE_ADDRESS
        self._given_addresses = iter(segment_addresses or ())
        self._free = {SMALL: [], LARGE: []}
        self._free_blocks = {}
        self._active = {}
        self._unmapped = {SMALL: {}, LARGE: {}}
        self._whole_free = {}

        self.reserved_bytes = 0
        self.allocated_bytes = 0
        self.requested_bytes = 0
        self.releasable_bytes = 0
        self.num_allocs = 0
        self.num_alloc_retries = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self.oom_events = []
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

    # ---- malloc steps, named as in CUDACachingAllocator.cpp -------------------

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
