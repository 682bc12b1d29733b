"""The engine's KV manager: one object it asks for admission, growth, free and the split.

The engine schedules; what a sequence holds, and what the pool's split is, lives
here. :class:`DenseKV` manages a dense placement (every layer full attention, one
slot per token: the allocators of :mod:`fragsim.allocators`) and keeps the totals
the split is recorded from::

    owned_total     Σ slots owned over sequences (a shared slot once per holder)
    internal_total  Σ max(0, owned − final)            never to be filled
    shared_total    slots owned_total counts more than once (block sharing)

    token_states = Σ filled − duplicates               (the engine knows what is filled)
    owned        = owned_total − shared_total          (physical)
    reservation  = owned − token_states − internal_total
    free         = capacity − owned

Every change of what a sequence owns goes through :meth:`DenseKV.take` with the
sequence's final length, so the totals move by exactly what the per-sequence
formula says; ``check=True`` runs recompute them from every sequence.

The hybrid managers (:mod:`fragsim.hybrid`) keep their split in bytes per layer
kind and category themselves; their engine's KV manager is
:class:`fragsim.hybrid.engine.HybridKV`, which asks the manager instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from fragsim.allocators import Allocator
from fragsim.metrics import Recorder


class KVManager(Protocol):
    """What the engine asks of its KV manager (:class:`DenseKV`, or the hybrid one)."""

    alloc: Any
    capacity: int
    owned_total: int
    internal_total: int
    shared_total: int

    @property
    def physical(self) -> int: ...

    def take(self, final: int, owned: int, delta: int = 1) -> None: ...

    def moved(self, d_owned: int, d_internal: int) -> None: ...

    def admit(self, seq: int, need: int, final: int) -> int | None: ...

    def release(self, seq: int, owned: int, final: int) -> None: ...

    def grow(self, seq: int, delta: int, old: int, final: int) -> int | None: ...

    def grow_many(self, seqs: list[int], deltas: list[int], old: Sequence[int],
                  finals: Sequence[int]) -> list[int] | None: ...

    def extend_all(self, seqs: list[int], deltas: list[int]) -> bool: ...

    def refresh_shared(self) -> None: ...

    def record(self, rec: Recorder, now: float, dt: float, token_states: int, running: int,
               waiting: int) -> None: ...

    def split(self, token_states: int) -> tuple[int, int, int, int]: ...

    def check(self, owned: int, internal: int) -> None: ...


class DenseKV:
    """An allocator in slots and the totals of the split; see the module docstring."""

    def __init__(self, allocator: Allocator) -> None:
        self.alloc = allocator
        self.capacity = int(allocator.capacity)
        self.owned_total = 0
        self.internal_total = 0
        self.shared_total = 0
        # The paged allocator's batched growth (all or none); others grow one by one.
        self._extend_many: Callable[[list[int], list[int]], list[int] | None] | None = \
            getattr(allocator, "extend_many", None)

    # -------------------------------------------------------------- the totals

    def take(self, final: int, owned: int, delta: int = 1) -> None:
        """A sequence of final length ``final`` starts (``delta=1``) or stops (``-1``)
        owning ``owned`` slots."""
        self.owned_total += delta * owned
        self.internal_total += delta * max(0, owned - final)

    def moved(self, d_owned: int, d_internal: int) -> None:
        """Totals moved by a batch of changes worked out elsewhere (a stretch)."""
        self.owned_total += d_owned
        self.internal_total += d_internal

    def refresh_shared(self) -> None:
        """Shared slots anew from the allocator (sharing runs, after forks and frees)."""
        self.shared_total = self.alloc.num_shared_slots()  # type: ignore[attr-defined]

    @property
    def physical(self) -> int:
        """Slots held, each once however many sequences hold it."""
        return self.owned_total - self.shared_total

    # ------------------------------------------------------- what sequences hold

    def admit(self, seq: int, need: int, final: int) -> int | None:
        """Place ``need`` slots for a new sequence; what it owns, or None if nothing fits."""
        if self.alloc.allocate(seq, need) is None:
            return None
        owned = self.alloc.num_owned(seq)
        self.take(final, owned)
        return owned

    def release(self, seq: int, owned: int, final: int) -> None:
        """Free a sequence that owned ``owned`` slots."""
        self.alloc.free(seq)
        self.take(final, owned, -1)

    def grow(self, seq: int, delta: int, old: int, final: int) -> int | None:
        """``delta`` more requested slots for a sequence that owns ``old``; what it owns
        now, or None (unchanged) when the pool cannot give them."""
        if not self.alloc.extend(seq, delta):
            return None
        new = self.alloc.num_owned(seq)
        self.take(final, new)
        self.take(final, old, -1)
        return new

    def grow_many(self, seqs: list[int], deltas: list[int], old: Sequence[int],
                  finals: Sequence[int]) -> list[int] | None:
        """Grow every sequence at once, all or none (None also when the allocator has no
        batched growth): what each owns now."""
        if self._extend_many is None:
            return None
        new = self._extend_many(seqs, deltas)
        if new is None:
            return None
        d_owned = d_internal = 0
        for now_owned, before, final in zip(new, old, finals, strict=True):
            d_owned += now_owned - before
            if now_owned > final:  # max(0, new − final) − max(0, old − final)
                d_internal += now_owned - (before if before > final else final)
        self.moved(d_owned, d_internal)
        return new

    def extend_all(self, seqs: list[int], deltas: list[int]) -> bool:
        """Grow sequences by ``deltas`` with no change to the totals (a stretch, which
        knows its totals step by step, sets them with :meth:`moved`); False if any fails."""
        if self._extend_many is not None:
            return self._extend_many(seqs, deltas) is not None
        extend = self.alloc.extend
        return all(extend(seq, n) for seq, n in zip(seqs, deltas, strict=True))

    # ----------------------------------------------------------------- the split

    def record(self, rec: Recorder, now: float, dt: float, token_states: int, running: int,
               waiting: int) -> None:
        """The split held for ``dt`` from ``now`` (``token_states``: stored tokens, each once)."""
        rec.record(now, dt, token_states, self.physical, self.internal_total,
                   self.alloc.largest_allocatable(), running, waiting, self.shared_total)

    def split(self, token_states: int) -> tuple[int, int, int, int]:
        """(token_states, reservation, internal, free) with ``token_states`` stored tokens."""
        owned = self.physical
        return (token_states, owned - token_states - self.internal_total, self.internal_total,
                self.capacity - owned)

    def check(self, owned: int, internal: int) -> None:
        """The totals against ``owned`` and ``internal`` recomputed from every sequence."""
        assert owned == self.owned_total, (owned, self.owned_total)
        assert internal == self.internal_total, (internal, self.internal_total)
        assert self.capacity - (owned - self.shared_total) == self.alloc.num_free()
        self.alloc.check()

    def to_dict(self) -> dict[str, Any]:
        return {"owned_total": self.owned_total, "internal_total": self.internal_total,
                "shared_total": self.shared_total}
