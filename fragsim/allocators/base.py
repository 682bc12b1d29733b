"""The allocator contract and the two kinds of placement.

An allocator hands out *slots* (one slot holds the K and V of one token across
all layers) from a pool of ``capacity`` slots. It decides *where* a sequence's
slots go; *how many* a sequence asks for is the reservation policy's business
(:mod:`fragsim.allocators.reservation`), kept apart so that every placement can be
paired with every policy.

Each sequence has two numbers the allocator tracks::

    requested(seq)  slots asked for so far by allocate() and extend()
    owned(seq)      slots it holds, after the placement's own rounding
                    (static: max_seq_len; buddy: a power of two; paged: whole blocks)

and ``requested <= owned`` always holds. ``extend`` raises ``requested``; a
contiguous placement succeeds only while the new total still fits in what it
owns, a paged one takes more blocks.

Allocators know nothing of time, SimPy or torch: the engine asks, the GPU backend
executes the placements they return.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple, Protocol, runtime_checkable

from fragsim.allocators.reservation import check_choice, check_int


class Extent(NamedTuple):
    """A contiguous run of slots ``[offset, offset + length)``.

    Used by ``static``, ``contiguous`` and ``buddy``: the attention kernel reads a
    sequence at ``base = offset`` with ``length`` valid positions at most.
    """

    offset: int
    length: int

    def slot(self, position: int) -> int:
        if not 0 <= position < self.length:
            raise IndexError(f"position {position} outside extent of {self.length} slots")
        return self.offset + position


class BlockTable(NamedTuple):
    """Physical block ids in logical order; block ``b`` holds slots ``[b*B, (b+1)*B)``.

    Position ``p`` of the sequence lives in slot
    ``block_ids[p // block_size] * block_size + p % block_size``.
    """

    block_size: int
    block_ids: tuple[int, ...] = ()

    @property
    def length(self) -> int:
        """Slots the table covers: whole blocks."""
        return len(self.block_ids) * self.block_size

    def slot(self, position: int) -> int:
        block, within = divmod(position, self.block_size)
        if not 0 <= block < len(self.block_ids):
            raise IndexError(f"position {position} outside {len(self.block_ids)} blocks")
        return self.block_ids[block] * self.block_size + within


Placement = Extent | BlockTable

# Placements are immutable named tuples: one C-level allocation each, equal and
# hashable by value. (A frozen dataclass costs a Python __init__ that sets every
# field through object.__setattr__: more than the rest of paged allocate().)
# The allocators' hot paths build them with tuple.__new__ directly, skipping the
# generated __new__'s Python frame; these two name that.
_tuple_new = tuple.__new__


def new_extent(offset: int, length: int) -> Extent:
    """``Extent(offset, length)`` for the allocators' hot paths (no validation)."""
    return _tuple_new(Extent, (offset, length))


def new_block_table(block_size: int, block_ids: tuple[int, ...]) -> BlockTable:
    """``BlockTable(block_size, block_ids)`` for the allocators' hot paths (no validation)."""
    return _tuple_new(BlockTable, (block_size, block_ids))


class AllocatorCore:
    """The contract attributes every allocator sets (see :class:`Allocator`), declared
    and validated once; each placement adds its own state in its own slots."""

    __slots__ = ("name", "placement_name", "capacity", "reserve", "grows_on_demand", "max_seq_len")

    def _init_contract(self, *, name: str, placement: str, capacity: int, max_seq_len: int,
                       reserve: str, reserves: Iterable[str], grows_on_demand: bool) -> None:
        self.name = name
        self.placement_name = placement
        self.capacity = capacity
        self.max_seq_len = check_int("max_seq_len", max_seq_len, 1)
        self.reserve = check_choice("reserve", reserve, reserves)
        self.grows_on_demand = grows_on_demand


def whole_blocks(capacity: int, block_size: int) -> int:
    """Blocks of ``block_size`` slots a pool of ``capacity`` slots holds (at least one)."""
    check_int("capacity", capacity, 1)
    check_int("block_size", block_size, 1)
    if capacity < block_size:
        raise ValueError(f"capacity must be >= block_size={block_size}, got {capacity}")
    return capacity // block_size


@runtime_checkable
class Allocator(Protocol):
    """What every KV-cache allocator provides. All sizes are in slots."""

    #: the name it was created under: a placement or a preset ("vllm", "orca-pow2", ...)
    name: str
    #: placement name: "static", "contiguous", "buddy", "paged", ...
    placement_name: str
    #: slots in the pool
    capacity: int
    #: reservation policy the engine should apply: "max", "pow2", "oracle" or "demand"
    reserve: str
    #: longest sequence in slots; the reservation policies cap at it
    max_seq_len: int
    #: True when extend() takes new memory (paged); False when growth must fit in
    #: what allocate() reserved (static, contiguous, buddy)
    grows_on_demand: bool

    def can_allocate(self, num_slots: int) -> bool: ...

    def allocate(self, seq_id: int, num_slots: int) -> Placement | None:
        """Place ``num_slots`` slots for a new sequence, or return None (state unchanged)."""
        ...

    def extend(self, seq_id: int, num_slots: int) -> bool:
        """Raise requested(seq) by ``num_slots``; False (state unchanged) if it cannot."""
        ...

    def free(self, seq_id: int) -> None: ...

    def num_free(self) -> int: ...

    def largest_allocatable(self) -> int:
        """The largest ``num_slots`` that ``allocate`` would accept right now."""
        ...

    def rounded(self, num_slots: int) -> int:
        """Slots that ``allocate(_, num_slots)`` would own (the placement's rounding)."""
        ...

    def placement(self, seq_id: int) -> Placement: ...

    def num_owned(self, seq_id: int) -> int: ...

    def num_requested(self, seq_id: int) -> int: ...

    def seq_ids(self) -> list[int]: ...

    def check(self) -> None:
        """Assert every invariant; cheap enough to call after each operation in tests."""
        ...
