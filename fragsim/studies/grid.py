"""A study's grid: the list of runs it makes, each with a stable id.

Expansion order (what ``expand`` returns, and the row order of every table)::

    for each case (or the study itself when it has no [[cases]]):
        for each combination of [sweep] axes, then the case's own axes
        (itertools.product: the last axis changes fastest):
            one point; for each allocator of the case: one run

A point's id is a hash of everything its runs depend on: the RunSpec fields
(after ``--scale``), the generated workload and the case label; a run's id adds
the allocator. Paths under ``${SHARED_TRACES}`` are hashed as written, not as
expanded, so ids (and the committed reference tables) do not depend on where a
machine keeps the traces. Bump ``GRID_VERSION`` when the meaning of a run
changes without its parameters changing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fragsim.errors import FragsimError
from fragsim.simulate import RunSpec
from fragsim.steady import requests_over
from fragsim.studies.schema import Case, Study, case_workload, column_name

GRID_VERSION = 1
SHARED_TRACES = "${SHARED_TRACES}"
SHARED_TRACES_ENV = "FRAGSIM_SHARED_TRACES"


@dataclass(frozen=True)
class Run:
    """One simulation of the grid: a point's parameters and one allocator."""

    run_id: str                       # "<point_id>-<allocator>", the cache file's name
    point_id: str
    case: str
    allocator: str
    spec: RunSpec                     # trace path expanded, ready to simulate
    workload: Mapping[str, Any] | None
    columns: Mapping[str, Any]        # the parameter columns of its table row
    keep_timeseries: bool = False


def scaled(num_requests: int, scale: float, floor: int) -> int:
    """``--scale``: a fraction of the requests, never below ``floor`` (or the original)."""
    if scale == 1.0:
        return num_requests
    return max(round(num_requests * scale), min(num_requests, floor))


def expand(study: Study, scale: float = 1.0, traces_dir: str | Path | None = None,
           min_requests: int | None = None) -> list[Run]:
    """Every run of ``study``, in table order (see the module docstring)."""
    if not scale > 0:
        raise FragsimError(f"--scale must be > 0, got {scale}")
    floor = study.min_requests if min_requests is None else min_requests
    runs: list[Run] = []
    for case in study.cases or (None,):
        for values in _combinations(study, case):
            runs += _point_runs(study, case, values, scale, floor, traces_dir)
    return runs


def _combinations(study: Study, case: Case | None) -> list[dict[str, Any]]:
    axes = {**study.sweep, **(case.sweep if case else {})}
    names = list(axes)
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*axes.values())]


def _point_runs(study: Study, case: Case | None, values: Mapping[str, Any], scale: float,
                floor: int, traces_dir: str | Path | None) -> list[Run]:
    params: dict[str, Any] = {"seed": study.seed, **study.fixed, **(case.params if case else {})}
    workload = case_workload(study, case)
    for key, value in values.items():
        if key.startswith("workload."):
            assert workload is not None  # schema checked it
            workload[key.split(".", 1)[1]] = value
        else:
            params[key] = value
    duration = params.pop("duration_s", None)
    if duration is not None:
        params["num_requests"] = requests_over(params["rate"], duration)
    if workload is not None:
        params["trace"] = f"generated:{workload['kind']}"
        params.setdefault("num_requests", 1000)
    if params.get("num_requests") is not None:
        params["num_requests"] = scaled(params["num_requests"], scale, floor)
    spec = _make_spec(study, params)
    label = case.label if case else ""
    identity = {"spec": spec.to_dict(), "workload": workload, "case": label, "v": GRID_VERSION}
    point_id = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    columns = _columns(study.name, label, point_id, spec, workload)
    if duration is not None:
        columns["duration_s"] = duration
    run_spec = dataclasses.replace(spec, trace=expand_trace(study, spec.trace, traces_dir))
    allocators = (case.allocators if case and case.allocators else None) or study.allocators
    return [Run(f"{point_id}-{name}", point_id, label, name, run_spec, workload, columns,
                study.timeseries) for name in allocators]


def _make_spec(study: Study, params: Mapping[str, Any]) -> RunSpec:
    try:
        return RunSpec(**params)
    except TypeError as exc:  # the schema admits only RunSpec fields, so this is a bug
        raise FragsimError(f"{study.path.name}: {exc}") from None


def _columns(study: str, case: str, point_id: str, spec: RunSpec,
             workload: Mapping[str, Any] | None) -> dict[str, Any]:
    """The parameter columns: study, case, point id, every RunSpec field, workload_*."""
    out: dict[str, Any] = {"study": study, "case": case, "point_id": point_id}
    for name, value in spec.to_dict().items():
        if name == "time_window_s" and value is not None:
            value = f"{value[0]:g}:{value[1]:g}"
        out[name] = value
    for name, value in (workload or {}).items():
        out[column_name(f"workload.{name}")] = (f"{value[0]}-{value[1]}" if isinstance(value, tuple)
                                                else value)
    return out


def expand_trace(study: Study, trace: str, traces_dir: str | Path | None) -> str:
    """Replace ``${SHARED_TRACES}`` by ``traces_dir`` or $FRAGSIM_SHARED_TRACES."""
    return expand_trace_path(trace, traces_dir, study.path.name)


def expand_trace_path(trace: str, traces_dir: str | Path | None, label: str) -> str:
    """``trace`` with ``${SHARED_TRACES}`` replaced (``label``: the file it came from)."""
    if "${" not in trace:
        return trace
    rest = trace.replace(SHARED_TRACES, "", 1)
    if SHARED_TRACES not in trace or "${" in rest:
        raise FragsimError(f"{label}: trace {trace!r}: the only variable is {SHARED_TRACES}")
    folder = traces_dir if traces_dir is not None else os.environ.get(SHARED_TRACES_ENV)
    if not folder:
        raise FragsimError(
            f"{label}: trace {trace!r} needs the public traces folder: "
            f"pass --traces-dir DIR or set {SHARED_TRACES_ENV}")
    path = Path(folder) / rest.lstrip("/\\")
    if not path.is_file():
        raise FragsimError(f"{label}: trace {trace!r}: {path} not found (traces folder {folder})")
    return str(path)
