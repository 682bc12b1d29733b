"""Whether a run reached its operating point, or was still filling its queue.

A published operating point (a mean batch at a request rate) was measured on a long
trace: the vLLM paper replays one-hour traces. Replayed on a short one, a system past
its capacity is still in its transient at the end: its queue grows for as long as
requests arrive, and every mean taken over the run depends on the run's length. A fit
to such a point fits the trace's length, not the system.

:func:`queue_trend` reads the number of requests waiting over the second half of the
arrival window (the last arrival ends it: past it the queue only drains) and fits a
line to it. The queue is *growing* when that line adds more than
``max(MIN_GROWTH, GROWTH_SHARE × mean waiting)`` requests over the half: a queue at
its steady state wanders around its mean; one past capacity climbs by about its mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

#: requests a queue may add over the second half and still count as steady
MIN_GROWTH = 5.0
#: ... or this share of its mean over that half, whichever is more
GROWTH_SHARE = 0.25


@dataclass(frozen=True)
class QueueTrend:
    growth: float          # requests the fitted line adds over the second half of the arrivals
    mean_waiting: float    # mean waiting over that half
    window_s: float        # the half's length

    @property
    def growing(self) -> bool:
        return self.growth > max(MIN_GROWTH, GROWTH_SHARE * self.mean_waiting)

    def describe(self) -> str:
        """``growing: +93 waiting in 248 s`` or ``steady``: the queue over the last half of
        the arrivals."""
        if self.growing:
            return f"growing: {self.growth:+,.0f} waiting in {self.window_s:,.0f} s"
        return "steady"


def requests_over(rate: float, duration_s: float) -> int:
    """Requests that ``duration_s`` seconds of arrivals at ``rate`` requests/s make: how
    studies and calibration files replay a trace of a given length (the paper's one-hour
    traces are ``duration_s = 3600``)."""
    return max(1, round(rate * duration_s))


def queue_trend(timeseries: pd.DataFrame, last_arrival_s: float) -> QueueTrend:
    """The waiting queue's trend over the second half of ``[start, last_arrival_s]``
    (``timeseries``: a run's buckets, with ``time_s``, ``covered_s`` and ``waiting``)."""
    t = timeseries["time_s"].to_numpy(dtype=np.float64)
    covered = timeseries["covered_s"].to_numpy(dtype=np.float64)
    waiting = timeseries["waiting"].to_numpy(dtype=np.float64)
    start = float(t[0]) if len(t) else 0.0
    half = (last_arrival_s - start) / 2
    keep = (t >= start + half) & (t < last_arrival_s) & (covered > 0)
    if keep.sum() < 2 or half <= 0:
        return QueueTrend(0.0, float(np.mean(waiting)) if len(waiting) else 0.0, max(half, 0.0))
    x, y, w = t[keep], waiting[keep], covered[keep]
    slope = float(np.polyfit(x, y, 1, w=np.sqrt(w))[0])
    return QueueTrend(slope * half, float(np.average(y, weights=w)), half)
