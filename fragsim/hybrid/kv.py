"""The engine's KV manager over a hybrid manager: :class:`fragsim.kv_manager.DenseKV`'s
interface, with the split in bytes per row and category from the manager itself.

A hybrid manager knows what every sequence holds from its length alone (blocks per
row, window frees, states), so there are no running totals to keep: ``take`` and
``moved`` do nothing, and every record asks the manager for the split of the
sequences live now (``live``: their ids and computed lengths). Each record goes to
the engine's :class:`~fragsim.metrics.Recorder` (pool-wide bytes: token states,
reservation, everything else held, free) and to the :class:`SplitRecorder` beside
it (every row and category).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from fragsim.hybrid.base import (
    CATEGORIES,
    FREE,
    INTERNAL,
    OUT_OF_WINDOW,
    PADDING,
    TOKEN,
    HybridManager,
    kind_of_rows,
)
from fragsim.hybrid.split import SplitRecorder
from fragsim.metrics import Recorder

HELD_ELSEWHERE = [INTERNAL, PADDING, OUT_OF_WINDOW]
RESERVATION = CATEGORIES.index("reservation")


class HybridKV:
    """A hybrid manager behind the engine's KV-manager interface (bytes, not slots)."""

    # No slot totals: the manager's split is in bytes, and a shared block counts once in it.
    owned_total = internal_total = shared_total = physical = 0

    def __init__(self, manager: HybridManager, resolution_s: float | None,
                 live: Callable[[], tuple[np.ndarray, np.ndarray]],
                 computed: Callable[[], np.ndarray] | None = None) -> None:
        self.alloc = manager
        self.manager = manager
        self.capacity = int(manager.capacity)
        self.live = live
        #: the computed lengths alone (``live``'s second half), read where the split needs them
        self.computed = computed or (lambda: live()[1])
        # A manager that keeps the base split records, each step, the few sums the split
        # is linear in (the totals are summed in plain ints); one that adjusts the split is
        # asked for its array.
        self._basis = manager._basis if type(manager).split is HybridManager.split else None
        self._allocate = manager._allocate if type(manager).allocate is HybridManager.allocate else None
        self._extend_owned = manager._extend_owned if type(manager).extend is HybridManager.extend else None
        # Every free byte allocatable (the largest allocatable is the free column): the
        # recorder's stretch path then knows the fragmentation ratio is 0 without dividing.
        self._largest_is_free = type(manager).largest_allocatable is HybridManager.largest_allocatable
        self.split_rec = SplitRecorder(manager.labels, kind_of_rows(manager.rows), manager.capacity,
                                       resolution_s, manager.split_basis() if self._basis is not None else None)

    # -------------------------------------------------------------- the totals

    def take(self, final: int, owned: int, delta: int = 1) -> None:
        """Nothing to keep: the manager's split comes from the sequences' lengths."""

    def moved(self, d_owned: int, d_internal: int) -> None:
        """Nothing to keep (see :meth:`take`)."""

    def refresh_shared(self) -> None:
        """Nothing to keep (see :meth:`take`)."""

    # ------------------------------------------------------- what sequences hold

    def admit(self, seq: int, need: int, final: int) -> int | None:
        if self._allocate is not None:
            if not self._allocate(seq, need):
                return None
        elif self.manager.allocate(seq, need) is None:
            return None
        return self.manager.num_owned(seq)

    def release(self, seq: int, owned: int, final: int) -> None:
        self.manager.free(seq)

    def grow(self, seq: int, delta: int, old: int, final: int) -> int | None:
        if self._extend_owned is not None:
            return self._extend_owned(seq, delta)
        if not self.manager.extend(seq, delta):
            return None
        return self.manager.num_owned(seq)

    def grow_many(self, seqs: list[int], deltas: list[int], old: Sequence[int],
                  finals: Sequence[int]) -> list[int] | None:
        """None: the hybrid engine grows its batch by target lengths itself."""
        return None

    def extend_all(self, seqs: list[int], deltas: list[int]) -> bool:
        extend = self.manager.extend
        return all(extend(seq, n) for seq, n in zip(seqs, deltas, strict=True))

    # ----------------------------------------------------------------- the split

    def current_split(self) -> np.ndarray:
        """``[rows + pool, categories]`` bytes of the sequences live now."""
        seqs, computed = self.live()
        return self.manager.split(seqs, computed)

    def record(self, rec: Recorder, now: float, dt: float, token_states: int, running: int,
               waiting: int) -> None:
        """The split held for ``dt`` from ``now``, from the manager (``token_states``: the
        engine's count of computed tokens, Σ of what ``live`` says; the manager counts bytes)."""
        m = self.manager
        if self._basis is None:
            split = self.current_split()
            free = int(split[:, FREE].sum())
            rec.record(now, dt, int(split[:, TOKEN].sum()), m.capacity - free,
                       int(split[:, HELD_ELSEWHERE].sum()), m.largest_allocatable(), running, waiting)
            self.split_rec.record(now, dt, split, m.num_used_blocks())
            return
        sums, token, free, elsewhere = self._basis(self.computed() if m.reads_windows else None, token_states)
        rec.record(now, dt, token, m.capacity - free, elsewhere,
                   free if self._largest_is_free else m.largest_allocatable(), running, waiting)
        self.split_rec.record_sums(now, dt, sums, m.num_used_blocks())

    def record_steps(self, rec: Recorder, now: float, dts: np.ndarray, splits: np.ndarray,
                     largest: np.ndarray, used: np.ndarray, running: int, waiting: np.ndarray) -> None:
        """A stretch's splits, ``[steps, rows + pool, categories]``, step by step."""
        per_category = splits.sum(axis=1)                    # [steps, categories], exact in ints
        free = per_category[:, FREE]
        # Every free byte allocatable at every step (None): the ratio is 0 without dividing.
        all_free = self._largest_is_free or bool((largest == free).all())
        rec.record_steps(now, dts, per_category[:, TOKEN], self.manager.capacity - free,
                         per_category[:, INTERNAL] + per_category[:, PADDING] + per_category[:, OUT_OF_WINDOW],
                         None if all_free else largest, running, waiting)
        self.split_rec.record_steps(now, dts, splits, used, per_category.sum(axis=1))

    def split(self, token_states: int) -> tuple[int, int, int, int]:
        """(token_states, reservation, everything else held, free) in bytes, now."""
        split = self.current_split()
        return (int(split[:, TOKEN].sum()), int(split[:, RESERVATION].sum()),
                int(split[:, HELD_ELSEWHERE].sum()), int(split[:, FREE].sum()))

    def check(self, owned: int, internal: int) -> None:
        """The fast split against one rebuilt from every sequence's blocks, and the
        manager's own invariants (``owned`` and ``internal``, slot totals, do not apply)."""
        m = self.manager
        seqs, computed = self.live()
        fast, slow = m.split(seqs, computed), m.split_slow(seqs, computed)
        assert (fast == slow).all(), f"split drifted:\n{fast}\n!=\n{slow}"
        assert int(fast.sum()) == m.capacity
        m.check()
