"""Synthetic arrival times: Poisson, or Gamma with a chosen burstiness.

The vLLM paper replays ShareGPT and Alpaca with Poisson arrivals at a chosen
rate; real traces are often burstier (Azure's code trace has an inter-arrival
coefficient of variation of 13). A Gamma renewal process covers both with one
knob: inter-arrival gaps ~ Gamma(shape k, scale theta) with::

    k = 1 / cv**2          theta = 1 / (rate * k)
    mean gap = k * theta = 1 / rate      CV of the gaps = 1 / sqrt(k) = cv

so ``cv = 1`` is the exponential distribution (Poisson arrivals), ``cv > 1`` is
burstier and ``cv < 1`` more regular. The first request arrives at 0.0 and the
``n - 1`` gaps follow, so ``(n - 1) / duration_s`` estimates the rate.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from fragsim.errors import FragsimError
from fragsim.traces.request import Trace

ARRIVAL_PROCESSES = ("poisson", "gamma")


def check_arrival_options(rate: float, arrival: str, cv: float) -> None:
    """Reject options that name no arrival process, with the allowed values."""
    if not _is_positive(rate):
        raise FragsimError(f"rate must be a positive number of requests per second, got {rate!r}")
    if arrival not in ARRIVAL_PROCESSES:
        allowed = ", ".join(ARRIVAL_PROCESSES)
        raise FragsimError(f"arrival must be one of {allowed}, got {arrival!r}")
    if not _is_positive(cv):
        raise FragsimError(f"cv must be a positive number, got {cv!r}")
    if arrival == "poisson" and cv != 1.0:
        raise FragsimError(f"cv={cv} applies to gamma arrivals only (poisson has cv 1)")


def _is_positive(value: float) -> bool:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return False
    return math.isfinite(number) and number > 0


def arrival_times(
    num_requests: int, rate: float, arrival: str, cv: float, rng: np.random.Generator
) -> np.ndarray:
    """``num_requests`` sorted arrival times in seconds, the first at 0.0."""
    check_arrival_options(rate, arrival, cv)
    num_gaps = max(num_requests - 1, 0)
    if arrival == "poisson":
        gaps = rng.exponential(1.0 / rate, size=num_gaps)
    else:
        shape = 1.0 / cv**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=num_gaps)
    times = np.zeros(num_requests, dtype=np.float64)
    np.cumsum(gaps, out=times[1:])
    return times


def assign_arrivals(
    trace: Trace, rate: float, arrival: str = "poisson", cv: float = 1.0, seed: int = 0
) -> Trace:
    """A copy of ``trace`` whose rows arrive by a seeded Poisson or Gamma process.

    Rows keep their order; only the arrival times change (any the trace had are
    replaced). The same seed gives the same times, bit for bit.
    """
    rng = np.random.default_rng(seed)
    times = arrival_times(len(trace), rate, arrival, cv, rng)
    return dataclasses.replace(trace, arrival_s=times, has_timestamps=True)
