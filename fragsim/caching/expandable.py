"""Expandable segments for the caching-allocator model.

:class:`ExpandableSegmentsMixin` finds room in a pool's expandable segment
(created on first need), maps pages into it as requests need them, and unmaps
free pages when an OOM retry or ``empty_cache`` releases cached memory; the
design and its simplifications are in :mod:`fragsim.caching.model`.
"""

from __future__ import annotations

from fragsim.caching.blocks import BlockStore, _Block, _round_up


class ExpandableSegmentsMixin(BlockStore):
    """Finding, mapping and unmapping room in expandable segments."""

    def _expandable_size(self, size: int, addr: int) -> int:
        b = self._free_blocks[addr]
        nxt = b.next
        return size + (nxt.size if nxt is not None and not nxt.mapped else 0)

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
