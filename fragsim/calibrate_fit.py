"""Fitting a step-cost model's free coefficients to measurements, one way per kind.

:func:`fit_steps` is a bounded least-squares fit of the measured step times;
:func:`fit_requests` and :func:`fit_points` replay the requests or operating
points through the engine and move the free coefficients (Nelder-Mead on their
log-ratios to the start, with a weak ridge toward it) until the replay matches.
Which coefficients are free, where they start and the rows held back
(:func:`holdout_mask`) are decided here; the measurements come from
:mod:`fragsim.calibrate_measurements` and the errors reported from
:mod:`fragsim.calibrate_report`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fragsim.calibrate_measurements import Measurements, point_specs
from fragsim.calibrate_report import FitReport, _errors, _request_errors
from fragsim.costmodel import TERMS, StepCostModel
from fragsim.errors import FragsimError
from fragsim.steady import queue_trend

REQUEST_TERMS = ("overhead_s", "per_seq_s", "prefill_token_s", "context_token_s")
POINT_TERMS = ("overhead_s", "per_seq_s")
MIN_ROWS_PER_TERM = 3
RIDGE = 1e-4  # weight of the pull toward the start, per squared log-ratio of a coefficient
# Where a free coefficient starts when its prior is 0 (the roofline has no per-sequence
# cost): a typical engine's order of magnitude, seconds.
TYPICAL = {"overhead_s": 5e-3, "per_seq_s": 5e-5, "prefill_token_s": 5e-5, "attention_unit_s": 1e-9,
           "decode_token_s": 5e-5, "weights_s": 1e-2, "context_token_s": 1e-7}


def holdout_mask(n: int, fraction: float, seed: int) -> np.ndarray:
    """True for the rows held back from the fit (at least one when ``fraction > 0``)."""
    held = np.zeros(n, dtype=bool)
    if fraction <= 0 or n < 2:
        return held
    k = min(n - 1, max(1, int(round(n * fraction))))
    held[np.random.default_rng(seed).choice(n, size=k, replace=False)] = True
    return held


def _free_terms(requested: Sequence[str] | None, default: Sequence[str],
                fixed: dict[str, float]) -> tuple[str, ...]:
    free = tuple(requested) if requested else tuple(default)
    bad = [t for t in (*free, *fixed) if t not in TERMS]
    if bad:
        raise FragsimError(f"unknown coefficient {', '.join(bad)}; allowed: {', '.join(TERMS)}")
    return tuple(t for t in free if t not in fixed)


def fit_steps(m: Measurements, prior: StepCostModel, *, free: Sequence[str] | None = None,
              fixed: dict[str, float] | None = None, holdout: float = 0.2,
              seed: int = 0) -> FitReport:
    """Least squares on the relative error of every measured step time."""
    from scipy.optimize import least_squares

    fixed = dict(fixed or {})
    t = m.table
    x = {"overhead_s": np.ones(len(t)), "per_seq_s": t["num_decode"].to_numpy(),
         "prefill_token_s": t["num_prefill_tokens"].to_numpy(),
         "attention_unit_s": t["prefill_attention_units"].to_numpy() + t["decode_context"].to_numpy(),
         "decode_token_s": t["num_decode"].to_numpy(), "weights_s": np.ones(len(t)),
         "context_token_s": t["decode_context"].to_numpy()}
    if free is None:
        # what the measurements can tell: a term whose regressor never varies is left at its prior
        varies = [term for term in TERMS if term in ("overhead_s", "weights_s") or np.ptp(x[term]) > 0]
        free = [term for term in varies if term != "weights_s" or "context_token_s" in varies]
    names = _free_terms(free, TERMS, fixed)
    if not names:
        raise FragsimError("nothing to fit: every coefficient is fixed")
    held = holdout_mask(len(t), holdout, seed)
    train = ~held
    if train.sum() < MIN_ROWS_PER_TERM * len(names):
        raise FragsimError(f"{m.source}: {int(train.sum())} steps to fit {len(names)} coefficients "
                           f"({', '.join(names)}); need at least {MIN_ROWS_PER_TERM * len(names)} "
                           "(or fewer free terms: --free)")
    base = prior.with_coefficients(**fixed)
    measured = t["step_time_s"].to_numpy()
    cols = [t[c].to_numpy() for c in ("num_prefill_tokens", "prefill_attention_units",
                                      "num_decode", "decode_context")]

    def model_of(v: np.ndarray) -> StepCostModel:
        return base.with_coefficients(**dict(zip(names, (float(a) for a in v), strict=True)))

    def residuals(v: np.ndarray) -> np.ndarray:
        pred = model_of(v).step_times(*(c[train] for c in cols))
        return pred / measured[train] - 1.0

    # Start from the prior, or where it is zero, from a scale the data suggests.
    scale = np.array([max(getattr(base, n), float(np.median(measured)) / max(np.mean(x[n]), 1.0) * 0.1)
                      for n in names])
    x0 = np.array([getattr(base, n) for n in names])
    x0 = np.where(x0 > 0, x0, scale)
    sol = least_squares(lambda z: residuals(z * scale), x0 / scale, bounds=(0.0, np.inf),
                        x_scale="jac", method="trf")
    fitted = model_of(sol.x * scale)
    pred = fitted.step_times(*cols)
    rows = t.copy()
    rows["fitted_s"] = pred
    rows["held_out"] = held
    return FitReport(fitted, names, _errors(pred[train], measured[train]),
                     _errors(pred[held], measured[held]), rows, int(sol.nfev))


def _nelder_mead(objective: Callable[[np.ndarray], float], x0: np.ndarray,
                 max_evaluations: int) -> tuple[np.ndarray, int]:
    """Nelder-Mead on log-coefficients, restarted once from where it stopped with a fresh
    simplex (a replay's loss is piecewise constant at fine scales, which can stall a simplex)."""
    from scipy.optimize import minimize

    x, used = np.asarray(x0, dtype=np.float64), 0
    for step in (1.0, 0.25):
        budget = max_evaluations - used if step < 1 else max(max_evaluations * 2 // 3, 1)
        if budget <= len(x) + 1:
            break
        simplex = np.vstack([x] + [x + step * np.eye(len(x))[i] for i in range(len(x))])
        sol = minimize(objective, x, method="Nelder-Mead",
                       options={"maxfev": budget, "xatol": 1e-3, "fatol": 1e-6,
                                "initial_simplex": simplex})
        x, used = np.asarray(sol.x), used + int(sol.nfev)
    return x, used


def _fit_by_replay(names: tuple[str, ...], base: StepCostModel,
                   loss: Callable[[StepCostModel], float], max_evaluations: int, ridge: float,
                   progress: Callable[[int, float], None] | None) -> tuple[StepCostModel, int]:
    """Nelder-Mead over the free coefficients ``names`` as log-ratios to their start (the
    prior, or :data:`TYPICAL` where it is 0), minimising ``loss(model)`` plus ``ridge``
    times the squared log-ratios; the fitted model and the replays it took."""
    start = np.array([getattr(base, n) or TYPICAL[n] for n in names])
    evaluations = 0

    def model_of(z: np.ndarray) -> StepCostModel:
        return base.with_coefficients(**dict(zip(names, (float(a) for a in start * np.exp(z)),
                                                 strict=True)))

    def objective(z: np.ndarray) -> float:
        nonlocal evaluations
        evaluations += 1
        value = loss(model_of(z)) + ridge * float(np.sum(z**2))
        if progress is not None:
            progress(evaluations, value)
        return value

    z, _ = _nelder_mead(objective, np.zeros(len(names)), max_evaluations)
    return model_of(z), evaluations


def fit_requests(m: Measurements, prior: StepCostModel, spec: Any, *,
                 free: Sequence[str] | None = None, fixed: dict[str, float] | None = None,
                 holdout: float = 0.2, seed: int = 0, max_evaluations: int = 120,
                 ridge: float = RIDGE,
                 progress: Callable[[int, float], None] | None = None) -> FitReport:
    """Replay the measured requests and match each one's time per output token and the
    distribution of their times to first token (``ridge``: a weak pull of the
    log-coefficients toward the start, as in :func:`fit_points`)."""
    from fragsim.simulate import simulate
    from fragsim.traces import Trace

    fixed = dict(fixed or {})
    names = _free_terms(free, REQUEST_TERMS, fixed)
    t = m.table
    held = holdout_mask(len(t), holdout, seed)
    train = ~held
    if train.sum() < MIN_ROWS_PER_TERM * max(len(names), 1):
        raise FragsimError(f"{m.source}: {int(train.sum())} requests to fit {len(names)} coefficients; "
                           f"need at least {MIN_ROWS_PER_TERM * len(names)}")
    trace = Trace(Path(m.source).stem, m.source, t["arrival_s"].to_numpy(),
                  t["prompt_len"].to_numpy(), t["output_len"].to_numpy())
    base = prior.with_coefficients(**fixed)
    ttft, tpot = t["ttft_s"].to_numpy(), t["tpot_s"].to_numpy()
    has_tpot = np.isfinite(tpot) & (tpot > 0)

    def replay(cost: StepCostModel) -> tuple[np.ndarray, np.ndarray]:
        r = simulate(trace, "vllm", spec, cost=cost).requests
        return r["ttft_s"].to_numpy(), r["tpot_s"].to_numpy()

    quantiles = np.linspace(0.1, 0.9, 9)
    train_tpot = train & has_tpot

    def loss_of(sim_ttft: np.ndarray, sim_tpot: np.ndarray) -> float:
        # Time per output token request by request: smooth in the coefficients. Time to first
        # token as a distribution (its deciles): one request's wait hangs on which step it
        # arrived in, chaotic in the coefficients, while the distribution is not.
        ok = train_tpot & np.isfinite(sim_tpot)
        tpot_err = np.log(np.maximum(sim_tpot[ok], 1e-9) / tpot[ok])
        q_sim = np.quantile(np.maximum(sim_ttft[train], 1e-6), quantiles)
        q_meas = np.quantile(np.maximum(ttft[train], 1e-6), quantiles)
        unfinished = (train_tpot.sum() - ok.sum()) / max(train_tpot.sum(), 1)
        tpot_loss = float(np.mean(tpot_err**2)) if len(tpot_err) else 0.0
        return tpot_loss + float(np.mean(np.log(q_sim / q_meas) ** 2)) + 25.0 * unfinished

    fitted, evaluations = _fit_by_replay(names, base, lambda cost: loss_of(*replay(cost)),
                                         max_evaluations, ridge, progress)
    sim_ttft, sim_tpot = replay(fitted)
    rows = t.copy()
    rows["fitted_ttft_s"], rows["fitted_tpot_s"], rows["held_out"] = sim_ttft, sim_tpot, held
    return FitReport(fitted, names, _request_errors(sim_ttft, sim_tpot, ttft, tpot, train),
                     _request_errors(sim_ttft, sim_tpot, ttft, tpot, held), rows, evaluations)


def fit_points(m: Measurements, prior: StepCostModel, spec: Any, *,
               free: Sequence[str] | None = None, fixed: dict[str, float] | None = None,
               max_evaluations: int = 80, ridge: float = RIDGE,
               progress: Callable[[int, float], None] | None = None) -> FitReport:
    """Match the mean number of requests running at each operating point not held out.

    A loaded system's batch stops growing once its memory is full, so many step
    costs give the same batch; ``ridge`` (on the log-coefficients) picks, among
    them, the one nearest the prior.
    """
    from fragsim.simulate import load_workload, simulate

    fixed = dict(fixed or {})
    names = _free_terms(free, POINT_TERMS, fixed)
    t = m.table
    train = ~t["held_out"].to_numpy(dtype=bool)
    if train.sum() < len(names):
        raise FragsimError(f"{m.source}: {int(train.sum())} points to fit {len(names)} coefficients "
                           f"({', '.join(names)}); need at least as many points as free terms")
    specs = point_specs(m, spec)
    traces = [load_workload(s) for s in specs]
    target = t["mean_running"].to_numpy()
    base = prior.with_coefficients(**fixed)

    def replay(cost: StepCostModel, rows: np.ndarray) -> list[Any]:
        return [simulate(traces[i], t["allocator"].iloc[i], specs[i], cost=cost) if rows[i] else None
                for i in range(len(t))]

    def running(results: list[Any]) -> np.ndarray:
        return np.array([r.summary["mean_running"] if r is not None else math.nan for r in results])

    def loss(cost: StepCostModel) -> float:
        return float(np.mean(np.log(running(replay(cost, train))[train] / target[train]) ** 2))

    fitted, evaluations = _fit_by_replay(names, base, loss, max_evaluations, ridge, progress)
    results = replay(fitted, np.ones(len(t), dtype=bool))
    sim = running(results)
    trends = [queue_trend(r.timeseries, float(trace.arrival_s[-1])) for r, trace in zip(results, traces, strict=True)]
    rows = t.copy()
    rows["fitted"] = sim
    rows["error"] = sim / target - 1
    rows["queue_growth"] = [q.growth for q in trends]
    rows["steady"] = [not q.growing for q in trends]
    rows["queue"] = [q.describe() for q in trends]
    return FitReport(fitted, names, _errors(sim[train], target[train]),
                     _errors(sim[~train], target[~train]), rows, evaluations)
