"""Fitting a step-cost model (:class:`~fragsim.costmodel.StepCostModel`) to measurements.

Three kinds of measurement, told apart by their columns or keys:

``steps``
    A table of measured engine steps (CSV, Parquet or JSON Lines), one row per
    step: ``num_prefill_tokens``, ``num_decode``, ``decode_context`` and the step
    time as ``step_time_s``, ``step_time_ms`` or ``step_time_us``; optionally
    ``prefill_attention_units`` (else each step's prompt tokens are taken as one
    fresh prompt, ``P (P - 1) / 2``). The fit is a bounded least-squares fit of the
    relative error of every step time (:func:`scipy.optimize.least_squares`).
``requests``
    Per-request latencies of a real run: a vLLM benchmark result saved with
    ``--save-result --save-detailed`` (JSON with ``start_times``, ``input_lens``,
    ``output_lens``, ``ttfts``, ``itls``), a BLIS trace v2 data file (CSV with
    ``send_time_us``, ``first_chunk_time_us``, ``last_chunk_time_us``,
    ``input_tokens``, ``output_tokens``, ``status``), or any table with
    ``arrival_s``, ``prompt_len``, ``output_len``, ``ttft_s`` and ``tpot_s``
    (fragsim's own ``requests.parquet``). Nobody measured the steps, so the fit
    replays the requests through the engine (``vllm``, the run's options) and
    moves the free coefficients until each request's simulated time per output
    token, and the deciles of the times to first token, match the measured ones
    (Nelder-Mead on the log-coefficients, :func:`scipy.optimize.minimize`). One
    request's wait for its first token hangs on which step it arrived in, which is
    chaotic in the coefficients; their distribution is not.
``points``
    Published operating points (TOML, ``[[points]]``): a workload, its rate, an
    allocator and the mean number of requests the measured system ran at once.
    The fit replays each point and matches the mean batch. Points marked
    ``held_out = true`` are not fitted and only reported. This is how the
    ``vllm-paper`` preset is made (``experiments/calibration/vllm_paper.toml``).

Measured attention: ``--attention-times kernels.json`` (the GPU backend's decode
kernel timings, :func:`attention_from_kernels`) sets the memory-bound context term
from the rate the real kernel reads KV at, and the fit then holds it.

Coefficients the fit does not free keep their prior: the roofline's (in this
shape) for the model and GPU named, so a fit from decode-only steps does not
invent a prefill cost. One row in five (``holdout``) is held back from the fit,
and the report gives the error on those rows.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fragsim.costmodel import TERMS, StepCostModel
from fragsim.errors import FragsimError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

KINDS = ("steps", "requests", "points")
STEP_COLUMNS = ("num_prefill_tokens", "num_decode", "decode_context")
REQUEST_TERMS = ("overhead_s", "per_seq_s", "prefill_token_s", "context_token_s")
POINT_TERMS = ("overhead_s", "per_seq_s")
MIN_ROWS_PER_TERM = 3
RIDGE = 1e-4  # weight of the pull toward the start, per squared log-ratio of a coefficient
# Where a free coefficient starts when its prior is 0 (the roofline has no per-sequence
# cost): a typical engine's order of magnitude, seconds.
TYPICAL = {"overhead_s": 5e-3, "per_seq_s": 5e-5, "prefill_token_s": 5e-5, "attention_unit_s": 1e-9,
           "decode_token_s": 5e-5, "weights_s": 1e-2, "context_token_s": 1e-7}


@dataclass
class Measurements:
    """What was measured, in one of the three kinds, as the fit reads it."""

    kind: str
    source: str
    table: pd.DataFrame                    # steps or requests; points: one row per point
    dropped: int = 0                        # rows left out (failed requests, ...)
    notes: list[str] = field(default_factory=list)


@dataclass
class FitReport:
    model: StepCostModel
    free: tuple[str, ...]
    train_error: dict[str, float]
    holdout_error: dict[str, float]
    rows: pd.DataFrame                      # per row (or point): measured, fitted, split
    num_evaluations: int = 0


# ------------------------------------------------------------------ reading


def _read_table(path: Path) -> pd.DataFrame:
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            return pd.read_parquet(path)
        if suffix in (".jsonl", ".ndjson"):
            return pd.read_json(path, lines=True)
        return pd.read_csv(path)
    except (ValueError, OSError, pd.errors.ParserError) as exc:
        raise FragsimError(f"{path}: cannot read a table: {exc}") from None


def _step_times(path: Path, df: pd.DataFrame) -> np.ndarray:
    for col, scale in (("step_time_s", 1.0), ("step_time_ms", 1e-3), ("step_time_us", 1e-6)):
        if col in df.columns:
            return df[col].to_numpy(dtype=np.float64) * scale
    raise FragsimError(f"{path}: a steps table needs step_time_s, step_time_ms or step_time_us")


def _check_rows(path: Path, df: pd.DataFrame, columns: Sequence[str], positive: Sequence[str]) -> None:
    for col in columns:
        values = pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(values) | (values < 0))
        if len(bad):
            raise FragsimError(f"{path}: row {int(bad[0]) + 1}: {col} = {df[col].iloc[bad[0]]}; "
                               "expected a number >= 0")
    for col in positive:
        values = df[col].to_numpy(dtype=np.float64)
        bad = np.flatnonzero(values <= 0)
        if len(bad):
            raise FragsimError(f"{path}: row {int(bad[0]) + 1}: {col} = {values[bad[0]]:g}; "
                               "expected a number > 0")


def _steps(path: Path, df: pd.DataFrame) -> Measurements:
    missing = [c for c in STEP_COLUMNS if c not in df.columns]
    if missing:
        raise FragsimError(f"{path}: a steps table needs {', '.join(STEP_COLUMNS)}; "
                           f"missing {', '.join(missing)}")
    out = pd.DataFrame({c: df[c] for c in STEP_COLUMNS})
    out["step_time_s"] = _step_times(path, df)
    prefill = out["num_prefill_tokens"].to_numpy(dtype=np.float64)
    out["prefill_attention_units"] = (df["prefill_attention_units"] if "prefill_attention_units" in df
                                      else prefill * (prefill - 1) / 2)
    _check_rows(path, out, [*STEP_COLUMNS, "prefill_attention_units", "step_time_s"], ["step_time_s"])
    return Measurements("steps", str(path), out.astype(np.float64).reset_index(drop=True))


def _requests(path: Path, arrival: Any, prompt: Any, output: Any, ttft: Any, tpot: Any,
              ok: np.ndarray | None = None) -> Measurements:
    df = pd.DataFrame({"arrival_s": arrival, "prompt_len": prompt, "output_len": output,
                       "ttft_s": ttft, "tpot_s": tpot})
    keep = np.ones(len(df), dtype=bool) if ok is None else np.array(ok, dtype=bool)
    for col in ("arrival_s", "prompt_len", "output_len", "ttft_s"):
        keep &= np.isfinite(pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=np.float64))
    dropped = int((~keep).sum())
    df = df[keep].astype({"prompt_len": np.int64, "output_len": np.int64}).reset_index(drop=True)
    _check_rows(path, df, ["arrival_s", "ttft_s"], ["prompt_len", "output_len", "ttft_s"])
    df = df.sort_values("arrival_s", kind="stable").reset_index(drop=True)
    df["arrival_s"] -= df["arrival_s"].iloc[0] if len(df) else 0.0
    notes = [f"{dropped:,} requests without a complete measurement left out"] if dropped else []
    return Measurements("requests", str(path), df, dropped, notes)


def _vllm_bench(path: Path, data: dict[str, Any]) -> Measurements:
    need = ("start_times", "input_lens", "output_lens", "ttfts", "itls")
    missing = [k for k in need if k not in data]
    if missing:
        raise FragsimError(f"{path}: a vLLM benchmark result needs {', '.join(need)} (run it with "
                           f"--save-result --save-detailed); missing {', '.join(missing)}")
    n = len(data["ttfts"])
    if any(len(data[k]) != n for k in need):
        raise FragsimError(f"{path}: {', '.join(need)} differ in length")
    errors = data.get("errors") or [""] * n
    # the gaps after the first token; streamed chunks may carry several tokens each
    tpot = [float(np.sum(gaps)) / (out - 1) if gaps and out > 1 else math.nan
            for gaps, out in zip(data["itls"], data["output_lens"], strict=True)]
    ok = np.array([not e for e in errors], dtype=bool)
    return _requests(path, data["start_times"], data["input_lens"], data["output_lens"],
                     data["ttfts"], tpot, ok)


def _blis_v2(path: Path, df: pd.DataFrame) -> Measurements:
    need = ("input_tokens", "output_tokens", "first_chunk_time_us", "last_chunk_time_us")
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise FragsimError(f"{path}: a BLIS trace v2 file needs {', '.join(need)}; "
                           f"missing {', '.join(missing)}")
    send = df["send_time_us"] if "send_time_us" in df else df["arrival_time_us"]
    send = send.where(send > 0, df.get("arrival_time_us", send)).to_numpy(dtype=np.float64)
    first = df["first_chunk_time_us"].to_numpy(dtype=np.float64)
    last = df["last_chunk_time_us"].to_numpy(dtype=np.float64)
    out = df["output_tokens"].to_numpy(dtype=np.float64)
    tpot = np.where(out > 1, (last - first) / np.maximum(out - 1, 1) / 1e6, np.nan)
    ok = (df["status"].astype(str) == "ok").to_numpy() if "status" in df else None
    return _requests(path, send / 1e6, df["input_tokens"], df["output_tokens"],
                     (first - send) / 1e6, tpot, ok)


def _points(path: Path, data: dict[str, Any]) -> Measurements:
    points = data.get("points")
    if not isinstance(points, list) or not points:
        raise FragsimError(f"{path}: an operating-points file needs [[points]] tables")
    rows = []
    for i, point in enumerate(points, 1):
        for key in ("trace", "allocator", "mean_running"):
            if key not in point:
                raise FragsimError(f"{path}: [[points]] #{i}: needs {key}")
        target = point["mean_running"]
        if not (isinstance(target, int | float) and target > 0):
            raise FragsimError(f"{path}: [[points]] #{i}: mean_running = {target!r}; expected > 0")
        rows.append({"label": point.get("label", f"point {i}"), "trace": point["trace"],
                     "rate": point.get("rate"), "allocator": point["allocator"],
                     "num_requests": int(point.get("num_requests", 1000)),
                     "mean_running": float(target), "held_out": bool(point.get("held_out", False))})
    m = Measurements("points", str(path), pd.DataFrame(rows))
    m.notes = [str(n) for n in data.get("notes", [])]
    return m


def load_measurements(path: str | Path) -> tuple[Measurements, dict[str, Any]]:
    """The measurements in ``path`` and, for an operating-points file, its ``[system]``
    table (the run options the points were measured with)."""
    path = Path(path)
    if not path.is_file():
        raise FragsimError(f"{path}: no such measurements file")
    suffix = path.suffix.lower()
    if suffix == ".toml":
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise FragsimError(f"{path}: not valid TOML: {exc}") from None
        return _points(path, data), dict(data.get("system", {}))
    if suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise FragsimError(f"{path}: not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise FragsimError(f"{path}: expected a JSON object (a vLLM benchmark result)")
        return _vllm_bench(path, data), {}
    df = _read_table(path)
    cols = set(df.columns)
    if cols & {"step_time_s", "step_time_ms", "step_time_us"}:
        return _steps(path, df), {}
    if "first_chunk_time_us" in cols:
        return _blis_v2(path, df), {}
    need = ("arrival_s", "prompt_len", "output_len", "ttft_s", "tpot_s")
    if set(need) <= cols:
        return _requests(path, df["arrival_s"], df["prompt_len"], df["output_len"], df["ttft_s"],
                         df["tpot_s"]), {}
    raise FragsimError(
        f"{path}: not a measurements file fragsim knows: expected a steps table "
        f"({', '.join(STEP_COLUMNS)}, step_time_s), per-request latencies ({', '.join(need)}; or a "
        "BLIS trace v2 CSV; or a vLLM benchmark JSON), or an operating-points TOML; its columns "
        f"are {', '.join(map(str, df.columns))}")


# ------------------------------------------------------------------ measured attention


def attention_from_kernels(path: str | Path, kv_bytes_per_token: int,
                           layout: str = "paged") -> tuple[float, dict[str, Any]]:
    """The memory-bound decode term, ``context_token_s``, from measured decode-attention
    kernel times (``kernels.json`` of ``benchmarks/gpu_check.py``, or the ``--json`` of
    ``python -m gpu_backend.kernel_bench``).

    Each row is one layer's decode attention over ``bytes`` of K/V (and q, out) in
    ``ms``; a least-squares line ``ms = launch + bytes / rate`` gives the seconds per
    byte the kernel really reads at, and a token of context costs that many seconds
    for each of the model's ``kv_bytes_per_token`` (every layer's K and V). The launch
    part is left to the per-step overhead.
    """
    path = Path(path)
    try:
        rows = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise FragsimError(f"{path}: cannot read kernel times: {exc}") from None
    if isinstance(rows, dict):  # gpu_check's report: {"kernels": {"rows": [...]}, ...}
        rows = rows.get("kernels", {}).get("rows", rows.get("rows"))
    if not isinstance(rows, list):
        raise FragsimError(f"{path}: expected a list of kernel rows (batch, context, layout, ms, bytes)")
    use = [r for r in rows if isinstance(r, dict) and r.get("layout") == layout
           and "ms" in r and "bytes" in r]
    if len(use) < 2 or len({r["bytes"] for r in use}) < 2:
        raise FragsimError(f"{path}: need at least two {layout} rows with different bytes to fit "
                           f"the kernel's read rate; found {len(use)}")
    nbytes = np.array([float(r["bytes"]) for r in use])
    seconds = np.array([float(r["ms"]) * 1e-3 for r in use])
    bad = np.flatnonzero(~(np.isfinite(seconds) & (seconds > 0)))
    if len(bad):
        raise FragsimError(f"{path}: {layout} row {int(bad[0]) + 1}: ms = {use[bad[0]]['ms']!r}; "
                           "expected a time > 0")
    design = np.column_stack([np.ones(len(nbytes)), nbytes])
    (launch, per_byte), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    if per_byte <= 0:
        raise FragsimError(f"{path}: the {layout} kernel's time does not grow with the bytes it "
                           "reads; these rows cannot give a read rate")
    pred = design @ np.array([launch, per_byte])
    info = {"rows": len(use), "layout": layout, "read_gbps": float(1e-9 / per_byte),
            "launch_s": float(launch), "mape": float(np.mean(np.abs(pred - seconds) / seconds))}
    return float(per_byte * kv_bytes_per_token), info


# ------------------------------------------------------------------ fitting


def holdout_mask(n: int, fraction: float, seed: int) -> np.ndarray:
    """True for the rows held back from the fit (at least one when ``fraction > 0``)."""
    held = np.zeros(n, dtype=bool)
    if fraction <= 0 or n < 2:
        return held
    k = min(n - 1, max(1, int(round(n * fraction))))
    held[np.random.default_rng(seed).choice(n, size=k, replace=False)] = True
    return held


def _errors(predicted: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    if not len(measured):
        return {"rows": 0, "mape": math.nan, "median_ape": math.nan, "max_ape": math.nan}
    ape = np.abs(predicted - measured) / measured
    return {"rows": int(len(measured)), "mape": float(np.mean(ape)),
            "median_ape": float(np.median(ape)), "max_ape": float(np.max(ape))}


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


def _request_errors(sim_ttft: np.ndarray, sim_tpot: np.ndarray, ttft: np.ndarray,
                    tpot: np.ndarray, rows: np.ndarray) -> dict[str, float]:
    both = rows & np.isfinite(tpot) & np.isfinite(sim_tpot) & (tpot > 0)
    e_ttft, e_tpot = _errors(sim_ttft[rows], ttft[rows]), _errors(sim_tpot[both], tpot[both])
    return {"rows": e_ttft["rows"], "ttft_mape": e_ttft["mape"], "ttft_median_ape": e_ttft["median_ape"],
            "tpot_mape": e_tpot["mape"], "tpot_median_ape": e_tpot["median_ape"],
            "mean_ttft_error": (float(np.mean(sim_ttft[rows]) / np.mean(ttft[rows]) - 1)
                                if rows.any() else math.nan),
            "mean_tpot_error": (float(np.mean(sim_tpot[both]) / np.mean(tpot[both]) - 1)
                                if both.any() else math.nan)}


def point_specs(m: Measurements, spec: Any) -> list[Any]:
    """The run spec of every operating point: the system's, with the point's workload."""
    from dataclasses import replace

    return [replace(spec, trace=row.trace, rate=(None if row.rate is None or
                                                 (isinstance(row.rate, float) and math.isnan(row.rate))
                                                 else float(row.rate)),
                    num_requests=int(row.num_requests)) for row in m.table.itertuples()]


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

    def replay(cost: StepCostModel, rows: np.ndarray) -> np.ndarray:
        out = np.full(len(t), math.nan)
        for i in np.flatnonzero(rows):
            out[i] = simulate(traces[i], t["allocator"].iloc[i], specs[i], cost=cost).summary["mean_running"]
        return out

    def loss(cost: StepCostModel) -> float:
        return float(np.mean(np.log(replay(cost, train)[train] / target[train]) ** 2))

    fitted, evaluations = _fit_by_replay(names, base, loss, max_evaluations, ridge, progress)
    sim = replay(fitted, np.ones(len(t), dtype=bool))
    rows = t.copy()
    rows["fitted"] = sim
    rows["error"] = sim / target - 1
    return FitReport(fitted, names, _errors(sim[train], target[train]),
                     _errors(sim[~train], target[~train]), rows, evaluations)


def evaluate(m: Measurements, model: StepCostModel, spec: Any = None) -> dict[str, float]:
    """A fitted model's error on measurements it was not fitted to (every row counts)."""
    from fragsim.simulate import simulate
    from fragsim.traces import Trace

    t = m.table
    if m.kind == "steps":
        pred = model.step_times(t["num_prefill_tokens"], t["prefill_attention_units"],
                                t["num_decode"], t["decode_context"])
        return _errors(np.asarray(pred), t["step_time_s"].to_numpy())
    if spec is None:
        raise FragsimError(f"{m.source}: checking against {m.kind} replays them: name the deployment "
                           "(--model, --gpu)")
    if m.kind == "requests":
        trace = Trace(Path(m.source).stem, m.source, t["arrival_s"].to_numpy(),
                      t["prompt_len"].to_numpy(), t["output_len"].to_numpy())
        r = simulate(trace, "vllm", spec, cost=model).requests
        every = np.ones(len(t), dtype=bool)
        return _request_errors(r["ttft_s"].to_numpy(), r["tpot_s"].to_numpy(),
                               t["ttft_s"].to_numpy(), t["tpot_s"].to_numpy(), every)
    from fragsim.simulate import load_workload

    specs = point_specs(m, spec)
    sim = np.array([simulate(load_workload(s), t["allocator"].iloc[i], s, cost=model).summary["mean_running"]
                    for i, s in enumerate(specs)])
    return _errors(sim, t["mean_running"].to_numpy())
