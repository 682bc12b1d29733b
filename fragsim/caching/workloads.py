"""Serving workloads that drive the caching-allocator model, HF-style.

:func:`run_workload` runs a preset (:data:`WORKLOADS`) with its fields overridden
and hands back a :class:`WorkloadResult`: one row per event, the OOM events, and
the summary made here (time-weighted fragmentation, the time spent above
:data:`DANGER_RATIO`, the OOMs that had more free memory than they asked for).
What a workload is, and the presets, live in :mod:`fragsim.caching.scenarios`;
the server that runs one (its allocations, its simulated time) in
:mod:`fragsim.caching.server`. Their names stay importable from here.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fragsim.caching.model import CachingAllocatorModel
from fragsim.caching.scenarios import WORKLOADS, ModelDims, ServingWorkload
from fragsim.caching.server import (  # noqa: F401  (_forward_temporaries: re-exported for the tests)
    _SERIES,
    _forward_temporaries,
    _Server,
)

DANGER_RATIO = 0.2  # seed 004: above 20% fragmentation, OOM risk is significant


@dataclass
class WorkloadResult:
    """Time series (one row per event, the state until the next row), OOM events,
    a summary, and the model at the end of the run."""

    workload: ServingWorkload
    timeseries: Any  # pandas.DataFrame
    ooms: Any  # pandas.DataFrame
    summary: dict[str, Any]
    model: CachingAllocatorModel
    #: with record_ops: ("malloc", tensor id, bytes) / ("free", tensor id) in order;
    #: a failed malloc has id None (the format gpu_backend.native_caching replays)
    ops: list[tuple[Any, ...]] = field(default_factory=list)
    wall_s: float = 0.0  # not part of the summary, which is deterministic


def _summary(server: _Server, ts: Any, ooms: Any) -> dict[str, Any]:
    w, model = server.w, server.model
    t = ts["time_s"].to_numpy()
    dt = np.diff(t, append=max(server.now, t[-1]))
    span = float(dt.sum()) or 1.0

    def weighted(col: str) -> float:
        return float((ts[col].to_numpy() * dt).sum() / span)

    def above(col: str) -> float:
        return float(dt[ts[col].to_numpy() > DANGER_RATIO].sum())

    paradox = ooms[ooms["enough_total_free"]] if len(ooms) else ooms

    def event(i: int) -> dict[str, Any]:
        row = paradox.iloc[i]
        return {k: (row[k].item() if hasattr(row[k], "item") else row[k]) for k in
                ("time_s", "tag", "size", "total_free_bytes", "largest_free_block",
                 "largest_allocatable", "reserved_bytes", "allocated_bytes", "device_free_bytes",
                 "fragmentation_ratio")}

    first = most = None
    if len(paradox):
        first = {**event(0), **(server.first_paradox_holes or {})}
        most = event(int(np.argmax((paradox["total_free_bytes"] / paradox["size"]).to_numpy())))
    final = model.stats()
    return {
        "workload": w.name,
        "model": server.dims.name,
        "device_bytes": w.device_bytes,
        "hours": w.hours,
        "seed": w.seed,
        "max_split_size_mb": w.max_split_size_mb,
        "expandable_segments": w.expandable_segments,
        "simulated_s": float(server.now),
        "num_arrived": server.counts["arrived"],
        "num_admitted": server.counts["admitted"],
        "num_completed": server.counts["completed"],
        "num_failed": server.counts["failed"],
        "num_ooms": len(ooms),
        "num_ooms_enough_total_free": len(paradox),
        "first_enough_free_oom": first,
        "most_free_oom": most,  # the one with the most free memory per requested byte
        "peak_fragmentation_ratio": float(ts["fragmentation_ratio"].max()),
        "mean_fragmentation_ratio": weighted("fragmentation_ratio"),
        "time_above_danger_s": above("fragmentation_ratio"),
        "fraction_time_above_danger": above("fragmentation_ratio") / span,
        "peak_reserved_fragmentation_ratio": float(ts["reserved_fragmentation_ratio"].max()),
        "mean_reserved_fragmentation_ratio": weighted("reserved_fragmentation_ratio"),
        "danger_ratio": DANGER_RATIO,
        "peak_reserved_bytes": int(ts["reserved_bytes"].max()),
        "peak_allocated_bytes": int(ts["allocated_bytes"].max()),
        "final_reserved_bytes": final["reserved_bytes"],
        "final_allocated_bytes": final["allocated_bytes"],
        "final_largest_free_block": final["largest_free_block"],
        "final_num_segments": final["num_segments"],
        "num_allocs": final["num_allocs"],
        "num_alloc_retries": final["num_alloc_retries"],
    }


def run_workload(
    name: str = "rag-longtail",
    *,
    progress: Callable[[float], None] | None = None,
    **params: Any,
) -> WorkloadResult:
    """Run preset ``name`` (:data:`WORKLOADS`) with ``params`` overriding its fields.

    ``progress``, if given, is called now and then with the simulated fraction done.
    Deterministic for a seed.
    """
    import pandas as pd

    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}")
    fields = {f.name for f in dataclasses.fields(ServingWorkload)}
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ValueError(f"unknown workload parameter(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    w = dataclasses.replace(WORKLOADS[name], **params)
    started = time.perf_counter()
    server = _Server(w, ModelDims.from_name(w.model))
    server.run(progress)
    ts = pd.DataFrame(server.rows, columns=["time_s", *_SERIES, "num_running", "num_waiting", "num_ooms"])
    oom_cols = ["time_s", "op_index", "size", "rounded_size", "alloc_size", "pool", "tag", "reserved_bytes",
                "allocated_bytes", "inactive_bytes", "device_free_bytes", "total_free_bytes",
                "largest_free_block", "largest_allocatable", "enough_total_free", "fragmentation_ratio"]
    ooms = pd.DataFrame(server.oom_rows, columns=oom_cols)
    return WorkloadResult(w, ts, ooms, _summary(server, ts, ooms), server.model, server.ops,
                          time.perf_counter() - started)
