"""How close a step-cost model comes to measurements.

:class:`FitReport` is what a fit (:mod:`fragsim.calibrate_fit`) hands back: the
fitted model, the terms it freed, its errors on the rows fitted and on those held
out, and the rows themselves. The error figures (mean, median and largest
absolute percentage error; for requests, of the times to first token and per
output token) are computed here, and :func:`evaluate` gives them for a model on
measurements it was not fitted to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fragsim.calibrate_measurements import Measurements, point_specs
from fragsim.costmodel import StepCostModel
from fragsim.errors import FragsimError


@dataclass
class FitReport:
    model: StepCostModel
    free: tuple[str, ...]
    train_error: dict[str, float]
    holdout_error: dict[str, float]
    rows: pd.DataFrame                      # per row (or point): measured, fitted, split
    num_evaluations: int = 0


def _errors(predicted: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    if not len(measured):
        return {"rows": 0, "mape": math.nan, "median_ape": math.nan, "max_ape": math.nan}
    ape = np.abs(predicted - measured) / measured
    return {"rows": int(len(measured)), "mape": float(np.mean(ape)),
            "median_ape": float(np.median(ape)), "max_ape": float(np.max(ape))}


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
