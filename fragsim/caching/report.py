"""Read-only views of the caching-allocator model: stats, segments, snapshot, check.

:class:`ReportMixin` reports byte counters and fragmentation ratios, lists the
segments as :class:`SegmentInfo`, writes them in ``torch.cuda.memory_snapshot()``
form, and asserts the model's invariants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fragsim.caching.blocks import (
    LARGE,
    LARGE_BUFFER,
    ROUND_LARGE,
    SMALL,
    SMALL_BUFFER,
    BlockStore,
    _Block,
    _round_up,
    _Segment,
)


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


class ReportMixin(BlockStore):
    """Statistics, segment listings, snapshots and the invariant check."""

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
