"""Workloads a study generates from a few numbers, for cases described only by statistics.

The seed cases give request lengths as summary statistics ("average 180 tokens,
P99 450"; "mostly 200-300 tokens, occasionally 1,500"), not as traces. A study's
``[workload]`` table names a *kind* and its parameters; :func:`build_trace` turns
it into a seeded trace. Three kinds:

``lognormal``: total length ``T = max(2, ceil(X))``, ``X ~ LogNormal(mu, sigma)``
fitted to a mean and a 99th percentile. With ``z = 2.3263`` (the standard normal
99th percentile)::

    mean = exp(mu + sigma^2 / 2)        p99 = exp(mu + z sigma)
    =>  ln(p99 / mean) = z sigma - sigma^2 / 2
    =>  sigma = z - sqrt(z^2 - 2 ln(p99 / mean)),   mu = ln(mean) - sigma^2 / 2

(the smaller root: the larger one puts the p99 below the median's tail). Mean
180, p99 450 gives sigma = 0.4344, mu = 5.0986. The ceiling adds about half a
token to the mean, which is not worth correcting.

``longtail``: a mixture; with probability ``long_frac`` a request is exactly
``long_tokens`` long, otherwise uniform on ``short_tokens = [lo, hi]``.

Either way a request's prompt is ``round(prompt_frac * T)`` (at least 1) and its
output the rest (at least 1). Arrivals come from the run's ``rate`` (Poisson or
Gamma, as for length-only traces); with no rate every request arrives at 0.0,
a burst, which is what "20 requests queued" means.

``sessions``: multi-turn chat sessions, as ``fragsim trace sessions`` writes them
(:func:`fragsim.traces.sessions.make_sessions`, seeded with the study's seed): each
turn's prompt is the whole conversation so far plus a new message, with content
hashes, so prefix caching and the offload tiers find the earlier turns. The
parameters are :class:`~fragsim.traces.sessions.SessionSpec`'s (``think_time`` in
seconds; ``lengths`` a synthetic workload such as ``sharegpt-paper`` or a bundled
trace). Sessions carry their own arrival times (session starts at
``session_rate``, turns ``think_time`` apart), so a run's ``rate`` is refused and
never re-times them. ``num_requests`` (1000 unless set, scaled by ``--scale``)
keeps the first that many requests in arrival order, at most all of them: the
late turns of sessions cut off there are not replayed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fragsim.errors import FragsimError
from fragsim.traces import Trace, assign_arrivals

Z99 = 2.3263478740408408  # standard normal 99th percentile
_REQUIRED = object()


@dataclass(frozen=True)
class WorkloadKind:
    description: str
    params: Mapping[str, tuple[str, Any]]   # name -> (type, default or _REQUIRED)
    lengths: Callable[[Mapping[str, Any], int, np.random.Generator], np.ndarray] | None
    check: Callable[[Mapping[str, Any]], None]
    #: a kind that makes a whole trace, arrival times included (sessions): its builder
    trace: Callable[[Mapping[str, Any], int, int], Trace] | None = None


def lognormal_params(mean_tokens: float, p99_tokens: float) -> tuple[float, float]:
    """``(mu, sigma)`` of the log-normal with this mean and 99th percentile."""
    ratio = math.log(p99_tokens / mean_tokens)
    disc = Z99**2 - 2 * ratio
    if ratio <= 0 or disc < 0:
        raise ValueError(f"p99_tokens / mean_tokens must be in (1, {math.exp(Z99**2 / 2):.1f}] "
                         f"for a log-normal, got {p99_tokens / mean_tokens:.3g}")
    sigma = Z99 - math.sqrt(disc)
    return math.log(mean_tokens) - sigma**2 / 2, sigma


def _lognormal_lengths(p: Mapping[str, Any], n: int, rng: np.random.Generator) -> np.ndarray:
    mu, sigma = lognormal_params(p["mean_tokens"], p["p99_tokens"])
    total = np.maximum(np.ceil(rng.lognormal(mu, sigma, size=n)), 2).astype(np.int64)
    if p["max_tokens"] is not None:
        total = np.minimum(total, p["max_tokens"])
    return total


def _check_lognormal(p: Mapping[str, Any]) -> None:
    if not p["mean_tokens"] >= 2:
        raise ValueError(f"mean_tokens: must be >= 2, got {p['mean_tokens']}")
    try:
        lognormal_params(p["mean_tokens"], p["p99_tokens"])
    except ValueError as exc:
        raise ValueError(f"p99_tokens: {exc}") from None
    if p["max_tokens"] is not None and p["max_tokens"] < 2:
        raise ValueError(f"max_tokens: must be >= 2, got {p['max_tokens']}")


def _longtail_lengths(p: Mapping[str, Any], n: int, rng: np.random.Generator) -> np.ndarray:
    lo, hi = p["short_tokens"]
    short = rng.integers(lo, hi + 1, size=n)
    is_long = rng.random(n) < p["long_frac"]
    return np.where(is_long, p["long_tokens"], short).astype(np.int64)


def _check_longtail(p: Mapping[str, Any]) -> None:
    lo, hi = p["short_tokens"]
    if not 2 <= lo <= hi:
        raise ValueError(f"short_tokens: need 2 <= lo <= hi, got {list(p['short_tokens'])}")
    if p["long_tokens"] < 2:
        raise ValueError(f"long_tokens: must be >= 2, got {p['long_tokens']}")
    if not 0.0 <= p["long_frac"] <= 1.0:
        raise ValueError(f"long_frac: must be in [0, 1], got {p['long_frac']}")


def _session_spec(p: Mapping[str, Any], seed: int) -> Any:
    from fragsim.traces.sessions import SessionSpec

    return SessionSpec(num_sessions=p["num_sessions"], session_rate=p["session_rate"],
                       turns_mean=p["turns_mean"], max_turns=p["max_turns"],
                       think_time_s=p["think_time"], lengths=p["lengths"],
                       system_prompt_len=p["system_prompt_len"], max_len=p["max_len"], seed=seed)


def _check_sessions(p: Mapping[str, Any]) -> None:
    from fragsim.traces import BUNDLED_TRACES, WORKLOADS

    # SessionSpec's own checks, worded by the table's names
    for name, ok, what in (
            ("num_sessions", p["num_sessions"] >= 1, ">= 1"),
            ("session_rate", p["session_rate"] > 0, "> 0 (sessions per second)"),
            ("turns_mean", p["turns_mean"] >= 1, ">= 1"),
            ("max_turns", p["max_turns"] >= 1, ">= 1"),
            ("think_time", p["think_time"] >= 0, ">= 0 (seconds)"),
            ("system_prompt_len", p["system_prompt_len"] >= 0, ">= 0 (tokens)"),
            ("max_len", p["max_len"] is None or p["max_len"] >= 2, ">= 2 (tokens)")):
        if not ok:
            raise ValueError(f"{name}: must be {what}, got {p[name]}")
    lengths = p["lengths"]
    if lengths not in WORKLOADS and lengths not in BUNDLED_TRACES:
        raise ValueError(f"lengths: expected a synthetic workload ({', '.join(WORKLOADS)}) "
                         f"or a bundled trace ({', '.join(BUNDLED_TRACES)}), got {lengths!r}")


def _sessions_trace(p: Mapping[str, Any], num_requests: int, seed: int) -> Trace:
    from fragsim.traces import slice_trace
    from fragsim.traces.sessions import make_sessions

    try:
        trace = make_sessions(_session_spec(p, seed)).trace
    except FragsimError as exc:  # e.g. no turn fits in max_len
        raise FragsimError(f"workload sessions: {exc}") from None
    if num_requests < len(trace):
        trace = slice_trace(trace, num_requests=num_requests)
    return trace


WORKLOAD_KINDS: dict[str, WorkloadKind] = {
    "lognormal": WorkloadKind(
        "total length log-normal with a given mean and p99 (tokens)",
        {"mean_tokens": ("float", _REQUIRED), "p99_tokens": ("float", _REQUIRED),
         "prompt_frac": ("float", 0.5), "max_tokens": ("int?", None)},
        _lognormal_lengths, _check_lognormal),
    "longtail": WorkloadKind(
        "mostly short requests, uniform on short_tokens, and a fraction long_frac of long_tokens",
        {"short_tokens": ("pair", _REQUIRED), "long_tokens": ("int", _REQUIRED),
         "long_frac": ("float", _REQUIRED), "prompt_frac": ("float", 0.5)},
        _longtail_lengths, _check_longtail),
    "sessions": WorkloadKind(
        "multi-turn chat sessions with content hashes (fragsim trace sessions); "
        "their own arrival times",
        {"num_sessions": ("int", _REQUIRED), "session_rate": ("float", _REQUIRED),
         "turns_mean": ("float", 4.0), "max_turns": ("int", 50), "think_time": ("float", 30.0),
         "lengths": ("str", "sharegpt-paper"), "system_prompt_len": ("int", 0),
         "max_len": ("int?", None)},
        None, _check_sessions, trace=_sessions_trace),
}

#: kinds whose requests carry their own arrival times: a run's ``rate`` may not re-time them
TIMED_KINDS = tuple(name for name, kind in WORKLOAD_KINDS.items() if kind.trace is not None)


def _value_ok(kind: str, value: Any) -> bool:
    if kind == "int?" and value is None:
        return True
    if kind in ("int", "int?"):
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "pair":
        return (isinstance(value, list | tuple) and len(value) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in value))
    if kind == "str":
        return isinstance(value, str)
    raise AssertionError(kind)


def check_workload(values: Mapping[str, Any], partial: bool) -> dict[str, Any]:
    """Check a [workload] table; ``partial`` (a case's override) may omit keys and ``kind``.

    Returns the table normalised (floats as floats, pairs as tuples, defaults
    filled in unless partial); raises ValueError("key: what is wrong").
    """
    values = dict(values)
    if partial and "kind" not in values:
        params = {name: spec for kind in WORKLOAD_KINDS.values() for name, spec in kind.params.items()}
    else:
        kind_name = values.get("kind")
        if kind_name not in WORKLOAD_KINDS:
            raise ValueError(f"kind: expected one of {', '.join(WORKLOAD_KINDS)}, got {kind_name!r}")
        params = dict(WORKLOAD_KINDS[kind_name].params)
    out: dict[str, Any] = {"kind": values.pop("kind")} if "kind" in values else {}
    for name, value in values.items():
        if name not in params:
            raise ValueError(f"{name}: unknown parameter; allowed: kind, {', '.join(params)}")
        type_name = params[name][0]
        if not _value_ok(type_name, value):
            raise ValueError(f"{name}: expected {type_name.rstrip('?')}, got {value!r}")
        out[name] = (float(value) if type_name == "float"
                     else tuple(value) if type_name == "pair" else value)
    if not partial:
        for name, (_, default) in params.items():
            if name not in out:
                if default is _REQUIRED:
                    raise ValueError(f"{name}: required by workload kind {out['kind']!r}")
                out[name] = default
        if "prompt_frac" in out and not 0.0 < out["prompt_frac"] < 1.0:
            raise ValueError(f"prompt_frac: must be in (0, 1), got {out['prompt_frac']}")
        WORKLOAD_KINDS[out["kind"]].check(out)
    return out


def build_trace(workload: Mapping[str, Any], num_requests: int, seed: int, rate: float | None,
                arrival: str = "poisson", cv: float = 1.0) -> Trace:
    """A seeded trace from a checked workload table; arrivals at ``rate`` or all at 0.0
    (a kind with its own arrival times, sessions, takes no ``rate``)."""
    kind = WORKLOAD_KINDS[workload["kind"]]
    if kind.trace is not None:
        if rate is not None:
            raise FragsimError(f"workload {workload['kind']!r} carries its own arrival times; "
                               f"rate must not be set (got {rate:g})")
        return kind.trace(workload, num_requests, seed)
    assert kind.lengths is not None
    length_seed, arrival_seed = np.random.SeedSequence(seed).spawn(2)
    total = kind.lengths(workload, num_requests, np.random.default_rng(length_seed))
    prompt = np.clip(np.rint(total * workload["prompt_frac"]).astype(np.int64), 1, total - 1)
    name = f"{workload['kind']}-workload"
    params = ",".join(f"{k}={v}" for k, v in sorted(workload.items()) if k != "kind")
    trace = Trace(name, f"generated:{workload['kind']}?{params}&seed={seed}",
                  np.zeros(num_requests), prompt, total - prompt, has_timestamps=rate is None)
    if rate is None:
        return trace
    return assign_arrivals(trace, rate, arrival=arrival, cv=cv,
                           seed=int(arrival_seed.generate_state(1)[0]))
