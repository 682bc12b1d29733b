"""Bookkeeping shared by the placements that give each sequence one extent.

``buddy`` and ``contiguous`` differ only in how they find and return space; what
they remember per sequence is the same: its extent (what it owns) and how many of
those slots it asked for. Growth never takes new memory: ``extend`` succeeds while
the total still fits the extent reserved at admission.
"""

from __future__ import annotations

from fragsim.allocators.base import AllocatorCore, Extent


class ExtentBook(AllocatorCore):
    """Mixin over ``self._extents: dict[seq, Extent]`` and ``self._requested: dict[seq, int]``."""

    __slots__ = ()
    _extents: dict[int, Extent]
    _requested: dict[int, int]

    def _record(self, seq_id: int, extent: Extent, num_slots: int) -> Extent:
        """Remember a new sequence's extent and request (after placement found it)."""
        self._extents[seq_id] = extent
        self._requested[seq_id] = num_slots
        return extent

    def _forget(self, seq_id: int) -> Extent:
        """Drop a sequence; its extent is the caller's to give back to the free space."""
        extent = self._extents.pop(seq_id, None)
        if extent is None:
            raise ValueError(f"free of unknown sequence {seq_id}")
        del self._requested[seq_id]
        return extent

    def extend(self, seq_id: int, num_slots: int) -> bool:
        requested = self._requested.get(seq_id)
        if requested is None:
            raise ValueError(f"extend of unknown sequence {seq_id}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        total = requested + num_slots
        if total > self._extents[seq_id].length:
            return False
        self._requested[seq_id] = total
        return True

    def placement(self, seq_id: int) -> Extent:
        extent = self._extents.get(seq_id)
        if extent is None:
            raise ValueError(f"unknown sequence {seq_id}")
        return extent

    def num_owned(self, seq_id: int) -> int:
        return self.placement(seq_id).length

    def num_requested(self, seq_id: int) -> int:
        self.placement(seq_id)
        return self._requested[seq_id]

    def seq_ids(self) -> list[int]:
        """Live sequences in the order they were allocated."""
        return list(self._requested)
