"""Cut a trace down and speed it up, keeping every other column aligned.

Both return new traces whose arrivals start again at 0.0, so a slice taken from
the middle of a day replays as if it were the whole trace.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from fragsim.errors import FragsimError
from fragsim.traces.request import Trace


def slice_trace(
    trace: Trace,
    *,
    start_s: float | None = None,
    end_s: float | None = None,
    num_requests: int | None = None,
    offset: int = 0,
) -> Trace:
    """Keep the rows arriving in ``[start_s, end_s)``, then skip ``offset`` rows, then keep
    at most ``num_requests``.

    Times are in the trace's own clock (seconds from its first arrival). The kept
    rows are re-zeroed to the first of them. A time window on a trace without
    timestamps, or a selection that keeps nothing, is an error rather than a
    silently empty simulation.
    """
    if (start_s is not None or end_s is not None) and not trace.has_timestamps:
        raise FragsimError(
            f"{trace.name}: has no timestamps, so start_s/end_s select nothing; "
            "use num_requests/offset, or assign_arrivals() first"
        )
    for label, value in (("start_s", start_s), ("end_s", end_s)):
        if value is not None and not math.isfinite(value):
            raise FragsimError(f"{label} must be a finite number of seconds, got {value!r}")
    if start_s is not None and end_s is not None and end_s <= start_s:
        raise FragsimError(f"end_s ({end_s}) must be greater than start_s ({start_s})")
    if num_requests is not None and num_requests < 1:
        raise FragsimError(f"num_requests must be >= 1, got {num_requests}")
    if offset < 0:
        raise FragsimError(f"offset must be >= 0, got {offset}")

    # arrival_s is sorted, so the window is one contiguous run of rows.
    lo = 0 if start_s is None else int(np.searchsorted(trace.arrival_s, start_s, side="left"))
    hi = len(trace) if end_s is None else int(np.searchsorted(trace.arrival_s, end_s, side="left"))
    lo = min(lo + offset, hi)
    if num_requests is not None:
        hi = min(hi, lo + num_requests)
    if hi <= lo:
        raise FragsimError(
            f"{trace.name}: the slice keeps no requests (start_s={start_s}, end_s={end_s}, "
            f"offset={offset}, num_requests={num_requests}; the trace has {len(trace)} rows "
            f"over {trace.duration_s:.1f} s)"
        )
    arrival = trace.arrival_s[lo:hi]
    return dataclasses.replace(
        trace,
        arrival_s=arrival - arrival[0],
        prompt_len=trace.prompt_len[lo:hi],
        output_len=trace.output_len[lo:hi],
        block_hashes=None if trace.block_hashes is None else trace.block_hashes[lo:hi],
        session=None if trace.session is None else trace.session[lo:hi],
        context_hashes=None if trace.context_hashes is None else trace.context_hashes[lo:hi],
    )


def scale_time(trace: Trace, factor: float) -> Trace:
    """Replay ``factor`` times as fast: every arrival time is divided by ``factor``.

    The request rate is multiplied by ``factor`` while the burstiness (the
    inter-arrival CV) stays the trace's own, which is how a real trace is pushed
    towards a server's saturation point.
    """
    if not trace.has_timestamps:
        raise FragsimError(
            f"{trace.name}: has no timestamps to scale; assign_arrivals() sets a rate directly"
        )
    if not (math.isfinite(factor) and factor > 0):
        raise FragsimError(f"factor must be a positive number, got {factor!r}")
    return dataclasses.replace(trace, arrival_s=trace.arrival_s / factor)


def scale_load(trace: Trace, copies: int, seed: int = 0) -> Trace:
    """``copies`` copies of the trace merged: ``copies`` times its rate, its burstiness kept.

    Copy 0 is the trace; copy ``j`` is shifted later by a seeded offset drawn
    uniformly from ``[0, mean inter-arrival gap)``, so the copies interleave rather
    than arrive in lockstep; the rate over any window of a few gaps or more is ``K``
    times the trace's, so its peaks stay peaks (at the scale of one gap the copies
    crowd together: the inter-arrival CV rises). Each copy's content hashes are its own (copy ``j`` adds
    ``j × (largest hash + 1)``): ``K`` copies of a conversation are ``K``
    conversations, not one asked ``K`` times. Session ids likewise (copy ``j`` adds
    ``j × (largest id + 1)``; ids too large for that in int64 are first renumbered
    0, 1, ... in order of value). Rows are sorted by arrival, ties kept in copy order.
    """
    if copies < 1:
        raise FragsimError(f"load scale must be a whole number >= 1, got {copies!r}")
    if copies == 1:
        return trace
    if not trace.has_timestamps:
        raise FragsimError(f"{trace.name}: has no timestamps to scale; give --rate first")
    n = len(trace)
    gap = float(trace.arrival_s[-1] - trace.arrival_s[0]) / max(n - 1, 1)
    offsets = np.concatenate(([0.0], np.random.default_rng(seed).uniform(0.0, gap, copies - 1)))
    arrival = np.concatenate([trace.arrival_s + off for off in offsets])
    order = np.argsort(arrival, kind="stable")
    hashes = context = None
    if trace.block_hashes is not None:
        rows = trace.block_hashes + (trace.context_hashes or [])
        stride = 1 + max((max(h) for h in rows if h), default=0)
        hashes = _copied_hashes(trace.block_hashes, copies, stride, order)
        if trace.context_hashes is not None:
            context = _copied_hashes(trace.context_hashes, copies, stride, order)
    session = None if trace.session is None else _copied_sessions(trace.session, copies)[order]
    return dataclasses.replace(
        trace,
        name=f"{trace.name}x{copies}",
        source=f"{trace.source}+load_scale={copies},seed={seed}",
        arrival_s=arrival[order],
        prompt_len=np.tile(trace.prompt_len, copies)[order],
        output_len=np.tile(trace.output_len, copies)[order],
        block_hashes=hashes,
        session=session,
        context_hashes=context,
    )


def _copied_hashes(hashes: list[tuple[int, ...]], copies: int, stride: int,
                   order: np.ndarray) -> list[tuple[int, ...]]:
    """``copies`` copies of each row's content ids, copy ``j``'s shifted by ``j × stride``,
    in ``order``."""
    merged = [tuple(x + j * stride for x in h) for j in range(copies) for h in hashes]
    return [merged[i] for i in order.tolist()]


def _copied_sessions(session: np.ndarray, copies: int) -> np.ndarray:
    """``copies`` copies of the session ids, copy ``j``'s shifted past copy ``j - 1``'s."""
    if int(session.max()) + 1 > np.iinfo(np.int64).max // copies:
        session = np.unique(session, return_inverse=True)[1].astype(np.int64)
    stride = int(session.max()) + 1
    return np.concatenate([session + j * stride for j in range(copies)])
