"""Static allocation: a fixed array of ``max_seq_len`` entries, one per sequence.

What FasterTransformer, HF ``generate`` and gpt-fast's ``KVCache`` do: the KV
cache is a ``[max_batch, max_seq_len]`` array, so a sequence owns a whole row
whatever its length. The pool of ``capacity`` slots is cut into
``num_entries = min(max_num_seqs, capacity // max_seq_len)`` rows::

    capacity 10, max_seq_len 3 -> 3 entries, 1 leftover slot

    slot   0 1 2 | 3 4 5 | 6 7 8 | 9
    entry  0     | 1     | 2     | leftover: free, never allocatable

A request that ends at 300 tokens in a 2048 row leaves 1748 slots that are
never filled: the seed's internal fragmentation. The leftover slots count as
free (they are not owned) but ``largest_allocatable`` ignores them, so they show
up as external fragmentation, which is what they are.

A new sequence takes the lowest free entry (a heap of free entry indices), so
placements are deterministic whatever the order of frees.
"""

from __future__ import annotations

from heapq import heappop as _heappop
from heapq import heappush as _heappush

from fragsim.allocators.base import AllocatorCore, Extent
from fragsim.allocators.reservation import UPFRONT_POLICIES, check_int


class StaticAllocator(AllocatorCore):
    """``num_entries`` rows of ``max_seq_len`` slots; entry ``i`` starts at ``i * max_seq_len``."""

    __slots__ = (
        "max_num_seqs",
        "num_entries",
        "_extents",
        "_free_entries",
        "_entry_of",
        "_requested_at",
    )

    def __init__(
        self,
        capacity: int,
        *,
        max_seq_len: int = 2048,
        max_num_seqs: int | None = None,
        reserve: str = "max",
        name: str = "static",
    ) -> None:
        self._init_contract(name=name, placement="static", capacity=check_int("capacity", capacity, 1),
                            max_seq_len=max_seq_len, reserve=reserve, reserves=UPFRONT_POLICIES,
                            grows_on_demand=False)
        rows = capacity // max_seq_len
        if max_num_seqs is not None:
            rows = min(rows, check_int("max_num_seqs", max_num_seqs, 1))
        self.max_num_seqs = max_num_seqs
        self.num_entries = rows
        # NOTE: one Extent per entry, built once: allocate() hands out the same
        # immutable object every time the entry is reused.
        self._extents = [Extent(i * max_seq_len, max_seq_len) for i in range(rows)]
        self._free_entries: list[int] = list(range(rows))  # a heap; sorted is a valid heap
        self._entry_of: dict[int, int] = {}  # seq_id -> entry, in allocation order
        self._requested_at: list[int] = [0] * rows  # requested slots, by entry

    def rounded(self, num_slots: int) -> int:
        """Whole rows: ``max_seq_len`` for any request that fits one. A longer one
        would need several rows, which no entry can give, so ``can_allocate`` and
        ``largest_allocatable`` turn it down."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        return -(-num_slots // self.max_seq_len) * self.max_seq_len

    def can_allocate(self, num_slots: int) -> bool:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        return num_slots <= self.max_seq_len and bool(self._free_entries)

    def allocate(self, seq_id: int, num_slots: int) -> Extent | None:
        entry_of = self._entry_of
        if seq_id in entry_of:
            raise ValueError(f"sequence {seq_id} is already allocated")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        free_entries = self._free_entries
        if num_slots > self.max_seq_len or not free_entries:
            return None
        entry = entry_of[seq_id] = _heappop(free_entries)
        self._requested_at[entry] = num_slots
        return self._extents[entry]

    def extend(self, seq_id: int, num_slots: int) -> bool:
        entry = self._entry_of.get(seq_id)
        if entry is None:
            raise ValueError(f"extend of unknown sequence {seq_id}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        total = self._requested_at[entry] + num_slots
        if total > self.max_seq_len:
            return False
        self._requested_at[entry] = total
        return True

    def free(self, seq_id: int) -> None:
        entry = self._entry_of.pop(seq_id, None)
        if entry is None:
            raise ValueError(f"free of unknown sequence {seq_id}")
        _heappush(self._free_entries, entry)

    def num_free(self) -> int:
        return self.capacity - len(self._entry_of) * self.max_seq_len

    def largest_allocatable(self) -> int:
        return self.max_seq_len if self._free_entries else 0

    def placement(self, seq_id: int) -> Extent:
        return self._extents[self._entry(seq_id)]

    def num_owned(self, seq_id: int) -> int:
        self._entry(seq_id)
        return self.max_seq_len

    def num_requested(self, seq_id: int) -> int:
        return self._requested_at[self._entry(seq_id)]

    def seq_ids(self) -> list[int]:
        """Live sequences in the order they were allocated."""
        return list(self._entry_of)

    def free_entries(self) -> list[int]:
        """Free entry indices, lowest first (the order allocate() takes them)."""
        return sorted(self._free_entries)

    def _entry(self, seq_id: int) -> int:
        entry = self._entry_of.get(seq_id)
        if entry is None:
            raise ValueError(f"unknown sequence {seq_id}")
        return entry

    def check(self) -> None:
        entries = list(self._entry_of.values())
        free = self._free_entries
        assert len(set(entries)) == len(entries), f"two sequences share an entry: {sorted(entries)}"
        assert len(set(free)) == len(free), f"free entry listed twice: {sorted(free)}"
        assert set(entries).isdisjoint(free), (
            f"entries both live and free: {set(entries) & set(free)}"
        )
        assert set(entries) | set(free) == set(range(self.num_entries)), (
            f"live {sorted(entries)} + free {sorted(free)} != all {self.num_entries} entries"
        )
        for i in range(1, len(free)):
            assert free[(i - 1) // 2] <= free[i], f"free entry heap broken at {i}: {free}"
        for seq_id, entry in self._entry_of.items():
            requested = self._requested_at[entry]
            assert 1 <= requested <= self.max_seq_len, (
                f"seq {seq_id}: requested {requested} outside 1..owned={self.max_seq_len}"
            )
        owned = len(entries) * self.max_seq_len
        leftover = self.capacity - self.num_entries * self.max_seq_len
        assert leftover >= 0, f"{self.num_entries} entries overflow capacity {self.capacity}"
        assert self.num_free() + owned == self.capacity, "free + owned != capacity"
