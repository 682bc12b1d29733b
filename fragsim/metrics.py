"""Where the KV memory goes, integrated exactly over time.

For each sequence ``r`` holding KV memory::

    filled(r)  tokens whose KV is stored
    owned(r)   slots it holds (after the allocator's rounding)
    final(r)   prompt + output length: what it will have stored when it finishes

and over the pool of ``capacity`` slots::

    token_states   = Σ filled(r)
    internal       = Σ max(0, owned(r) − final(r))      owned slots it will never fill
    reservation    = Σ owned(r) − filled(r) − internal  owned slots it will fill later
    free           = capacity − Σ owned(r)

    token_states + reservation + internal + free == capacity      (exact, always)

The identity holds by construction; what can go wrong is the bookkeeping behind
it, so :meth:`Recorder.record` checks the parts against each other and against
the allocator (``free`` must equal the allocator's own count, every part >= 0).

With shared blocks (parallel sampling, beam search, prefix caching) a slot held
by several sequences is one slot: every part above counts physical slots, and
``shared`` (slots that Σ owned(r) counts more than once) is integrated beside
them, so that ``shared / (owned + shared)`` is the fraction of blocks sharing
saves (the vLLM paper's Figure 15). How a shared slot is attributed is
:mod:`fragsim.kv.sharing`'s business; the recorder sees the physical parts.

With an offload tier (:mod:`fragsim.offload.connector`) a finished request keeps
its blocks until its stores to the tier land. Slots only such requests hold are
``held`` (the engine sets :attr:`Recorder.held` before recording): a fifth part,
carved out of token states, so that
``token_states + held + reservation + internal + free == capacity``.

The engine reports piecewise-constant states: "from ``t`` for ``dt`` seconds the
pool looked like this". Averages are the exact time integrals divided by the
span, peaks the maxima over states held for a positive time. A stretch of many
steps arrives as arrays (:meth:`Recorder.record_steps`), a single state as
scalars; both feed the same accumulators.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: a stretch of at most this many steps takes its minima and maxima in plain Python
_FEW = 16

#: quantities integrated over time, in this order in every array and table
QUANTITIES = ("token_states", "reservation", "internal_fragmentation", "free",
              "external_fragmentation_ratio", "largest_allocatable", "running", "waiting")


@dataclass(frozen=True)
class Breakdown:
    token_states: int
    reservation: int
    internal_fragmentation: int
    free: int

    @property
    def capacity(self) -> int:
        return self.token_states + self.reservation + self.internal_fragmentation + self.free


def breakdown(capacity: int, seqs: Iterable[tuple[int, int, int]]) -> Breakdown:
    """The four-way split from per-sequence ``(filled, owned, final)``."""
    token = owned_total = internal = 0
    for filled, owned, final in seqs:
        if not 0 <= filled <= owned:
            raise AssertionError(f"need 0 <= filled <= owned, got filled={filled} owned={owned}")
        if filled > final:
            raise AssertionError(f"filled {filled} exceeds final length {final}")
        token += filled
        owned_total += owned
        internal += max(0, owned - final)
    return Breakdown(token, owned_total - token - internal, internal, capacity - owned_total)


def external_fragmentation_ratio(free: int | np.ndarray, largest: int | np.ndarray) -> Any:
    """``1 − largest_allocatable / free``; 0 when nothing is free (seed 004's formula)."""
    free_arr = np.asarray(free, dtype=np.float64)
    largest_arr = np.asarray(largest, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(free_arr > 0, 1.0 - largest_arr / np.where(free_arr > 0, free_arr, 1.0), 0.0)
    return ratio if ratio.ndim else float(ratio)


@dataclass
class Counters:
    """Events counted over a run. Blocked admissions count distinct requests."""

    num_refused_too_long: int = 0        # prompt + output > max_seq_len
    num_refused_too_large: int = 0       # could never fit the pool, even empty
    num_refused_timeout: int = 0         # waited past --queue-timeout (the seeds' 503)
    num_truncated: int = 0               # prompts cut to fit max_seq_len
    num_blocked_fragmentation: int = 0   # free >= need, but no placement fits
    num_blocked_capacity: int = 0        # free < need
    num_blocked_batch_limit: int = 0     # max_num_seqs / max_num_batched_tokens
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0

    def bump(self, name: str) -> None:
        setattr(self, name, getattr(self, name) + 1)

    @property
    def num_refused(self) -> int:
        return self.num_refused_too_long + self.num_refused_too_large + self.num_refused_timeout

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_recompute + self.num_preemptions_swap

    def to_dict(self) -> dict[str, int]:
        out = {k: int(v) for k, v in self.__dict__.items()}
        out["num_refused"] = self.num_refused
        out["num_preemptions"] = self.num_preemptions
        return out


@dataclass
class Recorder:
    """Accumulates time integrals, peaks and a time-bucketed series of the split.

    ``resolution_s`` is the width of a time-series bucket (``None``: no series).
    ``free_probe`` (usually ``allocator.num_free``) is compared with the recorded
    free count on every scalar record, so engine and allocator cannot drift apart.
    """

    capacity: int
    resolution_s: float | None = 1.0
    free_probe: Any = None
    counters: Counters = field(default_factory=Counters)

    def __post_init__(self) -> None:
        n = len(QUANTITIES)
        self._integral = [0.0] * n
        self._peak = [0.0] * n
        self._span = 0.0
        self._shared = 0.0        # ∫ shared slots dt
        #: slots held now only by finished requests whose stores to an offload tier are in
        #: flight (the engine sets it before recording); carved out of token states
        self.held = 0
        self._held = 0.0          # ∫ held dt
        self._peak_held = 0
        self._peak_shared = 0
        self._num_intervals = 0
        self._buckets: dict[int, list[float]] = {}

    # -- input -----------------------------------------------------------------

    def record(self, t: float, dt: float, token_states: int, owned: int, internal: int,
               largest: int, running: int, waiting: int, shared: int = 0) -> None:
        """One state held from ``t`` for ``dt`` seconds (``owned``: physical slots)."""
        free = self.capacity - owned
        reservation = owned - token_states - internal
        held = self.held
        if held:
            # Slots only finished requests hold, for their pending stores: out of token states.
            token_states -= held
            if dt > 0:
                self._held += held * dt
                self._peak_held = max(self._peak_held, held)
        if token_states < 0 or internal < 0 or reservation < 0 or free < 0:
            raise AssertionError(
                f"broken split at t={t}: token_states={token_states} reservation={reservation} "
                f"internal={internal} free={free} (capacity {self.capacity})")
        if self.free_probe is not None and self.free_probe() != free:
            raise AssertionError(f"at t={t}: recorder free={free} but allocator free={self.free_probe()}")
        if largest > free:
            raise AssertionError(f"at t={t}: largest allocatable {largest} exceeds free {free}")
        if dt <= 0:
            return
        if shared:
            self._shared += shared * dt
            self._peak_shared = max(self._peak_shared, shared)
        ratio = 1.0 - largest / free if free > 0 else 0.0
        values = (token_states, reservation, internal, free, ratio, largest, running, waiting)
        self._add(t, dt, [v * dt for v in values], values)

    def record_steps(self, t0: float, dts: np.ndarray, token_states: np.ndarray, owned: np.ndarray,
                     internal: np.ndarray, largest: np.ndarray | None, running: int,
                     waiting: np.ndarray, shared: int = 0) -> None:
        """Consecutive states: state ``j`` starts at ``t0 + Σ dts[:j]`` and lasts ``dts[j]``
        (``shared`` is constant over them: a stretch neither forks nor frees).

        ``largest`` None: every free slot is allocatable (a paged pool), so the largest
        allocatable is the free count and the external fragmentation ratio is 0."""
        if len(dts) == 0:
            return
        assert not self.held, "a stretch never runs while blocks are held for stores"
        if shared:
            self._shared += shared * float(dts.sum())
            self._peak_shared = max(self._peak_shared, shared)
        free = self.capacity - owned
        reservation = owned - token_states - internal
        span = float(dts.sum())
        if largest is None:
            # 1 − free / free is exactly 0.0 (and 0.0 by definition where nothing is free),
            # so its integral and peak are 0.0; the free column serves as largest.
            if len(dts) <= _FEW:  # minima and maxima of a few ints: cheaper in Python
                top_token, top_reservation, top_internal, top_free = (
                    max(c) for c in (token_states.tolist(), reservation.tolist(), internal.tolist(),
                                     free.tolist()))
                broken = min(reservation.tolist()) < 0 or min(free.tolist()) < 0
            else:
                top_token, top_reservation, top_internal, top_free = (
                    c.max() for c in (token_states, reservation, internal, free))
                broken = int(reservation.min()) < 0 or int(free.min()) < 0
            if broken:
                raise AssertionError(f"broken split in the stretch starting at t={t0}")
            free_integral = float(np.dot(free, dts))
            integrals = [float(np.dot(token_states, dts)), float(np.dot(reservation, dts)),
                         float(np.dot(internal, dts)), free_integral, 0.0, free_integral]
            peaks = [float(top_token), float(top_reservation), float(top_internal),
                     float(top_free), 0.0, float(top_free)]
        else:
            if int(reservation.min()) < 0 or int(free.min()) < 0 or int((free - largest).min()) < 0:
                raise AssertionError(f"broken split in the stretch starting at t={t0}")
            ratio = external_fragmentation_ratio(free, largest)
            columns = (token_states, reservation, internal, free, ratio, largest)
            integrals = [float(np.dot(c, dts)) for c in columns]
            peaks = [float(c.max()) for c in columns]
        integrals += [running * span, float(np.dot(waiting, dts))]
        peaks += [running, float(max(waiting.tolist()) if len(dts) <= _FEW else waiting.max())]
        if self.resolution_s is not None:
            first = int(t0 // self.resolution_s)
            if int((t0 + span) // self.resolution_s) != first:
                # Spans several buckets: attribute each step to the bucket it starts in.
                if largest is None:
                    columns = (token_states, reservation, internal, free, np.zeros(len(dts)), free)
                starts = t0 + np.concatenate(([0.0], np.cumsum(dts)[:-1]))
                index = (starts // self.resolution_s).astype(np.int64)
                full = np.vstack([np.asarray(c, dtype=np.float64) for c in columns]
                                 + [np.full(len(dts), float(running)), np.asarray(waiting, dtype=np.float64)])
                for b in np.unique(index).tolist():
                    sel = index == b
                    part = dts[sel]
                    self._bucket_add(b, float(part.sum()), (full[:, sel] @ part).tolist(),
                                     full[:, sel].max(axis=1).tolist())
                self._add(t0, span, integrals, peaks, bucket=False)
                return
        self._add(t0, span, integrals, peaks)

    def _add(self, t0: float, span: float, integrals: list[float], peaks: Any,
             bucket: bool = True) -> None:
        acc, top = self._integral, self._peak
        self._span += span
        self._num_intervals += 1
        row = None
        if bucket and self.resolution_s is not None:
            b = int(t0 // self.resolution_s)
            row = self._buckets.get(b)
            if row is None:
                self._buckets[b] = [span, *integrals, *peaks]
        if row is None:
            for i, v in enumerate(integrals):
                acc[i] += v
            for i, v in enumerate(peaks):
                if v > top[i]:
                    top[i] = v
            return
        # The run's accumulators and the bucket's in one pass (as _bucket_add would).
        n = len(QUANTITIES)
        row[0] += span
        for i in range(n):
            v = integrals[i]
            acc[i] += v
            row[1 + i] += v
            v = peaks[i]
            if v > top[i]:
                top[i] = v
            if v > row[1 + n + i]:
                row[1 + n + i] = v

    def _bucket_add(self, b: int, span: float, integrals: list[float], peaks: Any) -> None:
        n = len(QUANTITIES)
        row = self._buckets.get(b)
        if row is None:
            self._buckets[b] = [span, *integrals, *peaks]
            return
        row[0] += span
        for i in range(n):
            row[1 + i] += integrals[i]
            if peaks[i] > row[1 + n + i]:
                row[1 + n + i] = peaks[i]

    # -- output ----------------------------------------------------------------

    @property
    def span_s(self) -> float:
        return self._span

    def means(self) -> dict[str, float]:
        if self._span <= 0:
            return {q: 0.0 for q in QUANTITIES}
        return {q: v / self._span for q, v in zip(QUANTITIES, self._integral, strict=True)}

    def mean_shared(self) -> float:
        """Time-weighted mean of the slots sharing saves (0 without sharing)."""
        return self._shared / self._span if self._span > 0 else 0.0

    def mean_held(self) -> float:
        """Time-weighted mean of the slots held only for pending stores (0 without a tier)."""
        return self._held / self._span if self._span > 0 else 0.0

    def peak_held(self) -> int:
        return self._peak_held

    def peak_shared(self) -> int:
        return self._peak_shared

    def peaks(self) -> dict[str, float]:
        return {q: float(v) for q, v in zip(QUANTITIES, self._peak, strict=True)}

    def timeseries(self) -> dict[str, np.ndarray]:
        """Per bucket: start time, time covered, time-weighted mean and max of each quantity."""
        keys = sorted(self._buckets)
        n = len(QUANTITIES)
        rows = np.array([self._buckets[k] for k in keys]) if keys else np.zeros((0, 2 * n + 1))
        covered = rows[:, 0] if len(rows) else np.zeros(0)
        out: dict[str, np.ndarray] = {
            "time_s": np.array(keys, dtype=np.float64) * (self.resolution_s or 0.0),
            "covered_s": covered,
        }
        with np.errstate(divide="ignore", invalid="ignore"):
            for i, q in enumerate(QUANTITIES):
                out[f"{q}"] = np.where(covered > 0, rows[:, 1 + i] / np.where(covered > 0, covered, 1), 0.0)
                out[f"{q}_max"] = rows[:, 1 + n + i]
        return out
