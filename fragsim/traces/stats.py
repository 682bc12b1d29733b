"""The figures that describe a trace, as one flat dict (what ``fragsim trace stats`` prints).

Definitions, chosen to match how the public traces' README states them:

- ``duration_s``: last arrival minus first; ``rate_req_per_s`` is
  ``(num_requests - 1) / duration_s``, one over the mean inter-arrival gap, so
  a trace generated at rate r reports close to r.
- ``interarrival_cv``: standard deviation over mean of the gaps (population
  std, ``ddof=0``); 1 for Poisson arrivals, 13 for Azure's bursty code trace.
- percentiles: numpy's default linear interpolation between order statistics
  (why Azure code's output p99 is 251.46, not a whole number).

Timing figures are ``None`` for a trace without timestamps, and for one whose
arrivals all coincide; block figures are ``None`` without block hashes.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import numpy as np

from fragsim.traces.request import Trace

PERCENTILES = (50, 90, 99)

# Values are str, int, float, bool or None; Any spares callers a cast per figure.
Stats = dict[str, Any]


def trace_stats(trace: Trace) -> Stats:
    """Every figure of the module docstring, as plain Python values (JSON-ready)."""
    stats: Stats = {
        "name": trace.name,
        "source": trace.source,
        "num_requests": len(trace),
        "has_timestamps": trace.has_timestamps,
    }
    stats.update(_timing(trace))
    stats.update(_lengths("prompt_len", trace.prompt_len))
    stats.update(_lengths("output_len", trace.output_len))
    stats.update(_blocks(trace))
    return stats


def _timing(trace: Trace) -> Stats:
    empty: Stats = {"duration_s": None, "rate_req_per_s": None, "interarrival_cv": None}
    if not trace.has_timestamps or len(trace) < 2:
        return empty
    gaps = np.diff(trace.arrival_s)
    mean_gap = float(gaps.mean())
    if mean_gap <= 0:
        return {**empty, "duration_s": 0.0}
    return {
        "duration_s": trace.duration_s,
        "rate_req_per_s": 1.0 / mean_gap,
        "interarrival_cv": float(gaps.std()) / mean_gap,
    }


def _lengths(prefix: str, values: np.ndarray) -> Stats:
    if len(values) == 0:
        return {}
    p50, p90, p99 = np.percentile(values, PERCENTILES).tolist()
    return {
        f"{prefix}_mean": float(values.mean()),
        f"{prefix}_min": int(values.min()),
        f"{prefix}_p50": p50,
        f"{prefix}_p90": p90,
        f"{prefix}_p99": p99,
        f"{prefix}_max": int(values.max()),
        f"{prefix}_total": int(values.sum()),
    }


def _blocks(trace: Trace) -> Stats:
    if trace.block_hashes is None:
        return {"block_hash_size": None, "num_block_refs": None, "num_distinct_blocks": None}
    return {
        "block_hash_size": trace.block_hash_size,
        "num_block_refs": sum(map(len, trace.block_hashes)),
        "num_distinct_blocks": len(set(chain.from_iterable(trace.block_hashes))),
    }
