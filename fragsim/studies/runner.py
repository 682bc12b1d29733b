"""Run a study: every run of its grid, cached one file per run, then one table and its figures.

Output folder ``<out>/<study>/``::

    points/<point_id>-<allocator>.json          one row per run: the resume journal
    points/<point_id>-<allocator>.ts.parquet    its time series (studies that keep them)
    results.parquet                             all rows, grid order (the combined table)
    timeseries.parquet                          all time series, keyed by point_id, allocator
    <figure>.png                                the study's [[figures]]
    sweep.json                                  what was run: scale, axes, key columns, version
    study.toml                                  the experiment file as it was

A run whose ``points/`` row exists is not run again, so an interrupted sweep
resumes where it stopped; ``force`` reruns everything. Every file is written to
a temporary name and renamed into place, so none is ever half-written; a row
file is written after its time series, so a row's presence means the run is
complete.

Rows go through JSON (the journal's format) whether they were just computed or
read back, and the combined table through Parquet, so a fresh table and one
read from disk have the same values and dtypes.
"""

from __future__ import annotations

import functools
import io
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import pandas as pd

from fragsim import __version__
from fragsim.files import write_atomically
from fragsim.report import dumps
from fragsim.simulate import RunResult, RunSpec, load_workload, simulate
from fragsim.studies.grid import Run, expand
from fragsim.studies.schema import Study
from fragsim.studies.workloads import build_trace
from fragsim.sweep import execute

TABLE = "results.parquet"
TIMESERIES = "timeseries.parquet"
MANIFEST = "sweep.json"


@dataclass
class RunOutput:
    run_id: str
    row: dict[str, Any]
    timeseries: pd.DataFrame | None = None


@dataclass
class StudyResult:
    study: Study
    table: pd.DataFrame
    timeseries: pd.DataFrame | None
    ran: list[str] = field(default_factory=list)      # run ids simulated now
    cached: list[str] = field(default_factory=list)   # run ids read from points/
    folder: Path | None = None
    figures: list[Path] = field(default_factory=list)


# ---------------------------------------------------------------- one run (in a worker)

def run_one(run: Run) -> RunOutput:
    """Simulate one run; module-level so that process pools and Ray can ship it."""
    trace = _trace(run.spec, _freeze(run.workload))
    result = simulate(trace, run.allocator, run.spec)
    row = {**run.columns, "allocator": run.allocator}
    row.update(_flat({k: v for k, v in result.summary.items() if k != "allocator"}))
    row.update(derived_metrics(result, run.spec))
    series = None
    if run.keep_timeseries:
        series = result.timeseries.copy()
        series.insert(0, "allocator", run.allocator)
        series.insert(0, "point_id", run.point_id)
    return RunOutput(run.run_id, _json_row(row), series)


def _freeze(workload: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    return None if workload is None else tuple(sorted(workload.items()))


@functools.lru_cache(maxsize=16)
def _trace(spec: RunSpec, workload: tuple[tuple[str, Any], ...] | None) -> Any:
    """Load (or generate) a point's trace once per process: every allocator replays it.

    The cache key is the whole spec, a superset of what the trace depends on;
    runs of one point share it exactly, which is the case that matters.
    """
    if workload is None:
        return load_workload(spec)
    return build_trace(dict(workload), spec.num_requests or 1000, spec.seed, spec.rate,
                       spec.arrival, spec.cv)


def derived_metrics(result: RunResult, spec: RunSpec) -> dict[str, float]:
    """Columns the studies plot that the summary does not have, from the requests table.

    ``mean_blocks_per_request`` is ``mean(ceil((prompt + output) / block_size))``
    over finished requests, for paged allocators only (NaN otherwise): how many
    block-table entries a request ends with, the other side of the block-size
    trade-off from internal fragmentation.
    """
    from fragsim.allocators import PRESETS

    requests = result.requests
    done = requests[requests["status"] == "finished"]
    final = (done["prompt_len"] + done["output_len"]).to_numpy(dtype=np.float64)
    placement = PRESETS[result.allocator][0] if result.allocator in PRESETS else result.allocator
    total = result.summary["num_requests"]
    blocks = (float(np.ceil(final / spec.block_size).mean())
              if placement == "paged" and len(final) else math.nan)
    return {
        "refusal_rate": result.summary["num_refused"] / total if total else 0.0,
        "mean_request_tokens": float(final.mean()) if len(final) else math.nan,
        "mean_blocks_per_request": blocks,
    }


def _json_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """The row as the journal stores it (NaN as null, numpy scalars as Python)."""
    decoded: dict[str, Any] = json.loads(dumps(row))
    return decoded


# ---------------------------------------------------------------- the journal

def _row_path(points: Path, run_id: str) -> Path:
    return points / f"{run_id}.json"


def _ts_path(points: Path, run_id: str) -> Path:
    return points / f"{run_id}.ts.parquet"


def _is_done(points: Path, run: Run) -> bool:
    if not _row_path(points, run.run_id).is_file():
        return False
    return not run.keep_timeseries or _ts_path(points, run.run_id).is_file()


def _store(points: Path, output: RunOutput) -> None:
    if output.timeseries is not None:
        write_atomically(_ts_path(points, output.run_id),
                         lambda f: to_parquet(output.timeseries, f))  # type: ignore[arg-type]
    row = json.dumps(output.row, allow_nan=False) + "\n"
    write_atomically(_row_path(points, output.run_id), lambda f: f.write(row.encode()))


def _load(points: Path, run: Run) -> RunOutput:
    row = json.loads(_row_path(points, run.run_id).read_text())
    series = pd.read_parquet(_ts_path(points, run.run_id)) if run.keep_timeseries else None
    return RunOutput(run.run_id, row, series)




# ---------------------------------------------------------------- the study

def run_study(study: Study, scale: float = 1.0, out: str | Path | None = None, *,
              executor: str = "serial", workers: int | None = None, address: str | None = None,
              force: bool = False, traces_dir: str | Path | None = None,
              min_requests: int | None = None, figures: bool = True,
              progress: Callable[[int, int], None] | None = None) -> StudyResult:
    """Run ``study`` (at ``scale``) and return its combined table.

    With ``out``, runs are journaled under ``out/<study>/points`` (and skipped when
    already there) and the table, time series, figures and manifest are written
    to ``out/<study>/``; without it everything stays in memory.
    """
    runs = expand(study, scale, traces_dir, min_requests)
    folder = Path(out) / study.name if out is not None else None
    points = folder / "points" if folder is not None else None
    outputs: dict[str, RunOutput] = {}
    cached: list[str] = []
    if points is not None:
        points.mkdir(parents=True, exist_ok=True)
        if not force:
            for run in runs:
                if _is_done(points, run):
                    outputs[run.run_id] = _load(points, run)
                    cached.append(run.run_id)
    todo = [run for run in runs if run.run_id not in outputs]
    ran: list[str] = []
    total = len(runs)

    def on_done(run: Run, output: RunOutput) -> None:
        if points is not None:
            _store(points, output)
        outputs[run.run_id] = output
        ran.append(run.run_id)
        if progress is not None:
            progress(len(outputs), total)

    if progress is not None:
        progress(len(outputs), total)
    execute(todo, run_one, on_done, executor=executor, workers=workers, address=address)
    table = table_from_rows([outputs[r.run_id].row for r in runs])
    series = [outputs[r.run_id].timeseries for r in runs if r.keep_timeseries]
    timeseries = pd.concat(series, ignore_index=True) if series else None
    result = StudyResult(study, table, timeseries, ran, cached, folder)
    if folder is not None:
        write_outputs(result, scale, min_requests, figures, out_arg=str(out))
    return result


def table_from_rows(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The combined table, with the dtypes it has after a Parquet round trip."""
    buffer = io.BytesIO()
    to_parquet(pd.DataFrame(rows), buffer)
    buffer.seek(0)
    return pd.read_parquet(buffer)


def to_parquet(frame: pd.DataFrame, target: Any) -> None:
    """Parquet without per-column statistics or the pandas schema blob: a table of a
    hundred columns and a few rows shrinks from ~55 KB to ~15 KB (committed references)."""
    frame.to_parquet(target, index=False, compression="zstd", write_statistics=False,
                     store_schema=False)


def key_columns(study: Study) -> list[str]:
    """Columns that identify a row whatever the version: case, the swept axes, allocator."""
    return ["case", *study.axes, "allocator"]


def write_outputs(result: StudyResult, scale: float, min_requests: int | None,
                  figures: bool = True, out_arg: str | None = None) -> None:
    from fragsim.studies.figures import draw

    folder = result.folder
    assert folder is not None
    study = result.study
    write_atomically(folder / TABLE, lambda f: to_parquet(result.table, f))
    if result.timeseries is not None:
        write_atomically(folder / TIMESERIES,
                         lambda f: to_parquet(result.timeseries, f))  # type: ignore[arg-type]
    if figures:
        for spec in study.figures:
            path = folder / spec.file
            write_atomically(path, functools.partial(
                _save_png, draw(spec, result.table, result.timeseries, study)))
            result.figures.append(path)
    write_atomically(folder / "study.toml", lambda f: f.write(study.path.read_bytes()))
    manifest = {
        "study": study.name,
        "description": study.description,
        "command": command_line(study, scale, min_requests, out_arg),
        "scale": scale,
        "min_requests": study.min_requests if min_requests is None else min_requests,
        "num_runs": len(result.table),
        "key_columns": key_columns(study),
        "figures": [spec.file for spec in study.figures] if figures else [],
        "fragsim_version": __version__,
    }
    text = json.dumps(manifest, indent=2) + "\n"
    write_atomically(folder / MANIFEST, lambda f: f.write(text.encode()))


def _save_png(fig: Any, out: IO[bytes]) -> None:
    fig.savefig(out, dpi=100, bbox_inches="tight", format="png")


def command_line(study: Study, scale: float, min_requests: int | None = None,
                 out: str | None = None) -> str:
    """The command that regenerates a study's outputs (for the manifest and the gallery).

    ``--out`` is included only as a relative path: an absolute one would be this
    machine's, and the manifest is committed with the reference results.
    """
    parts = [f"fragsim sweep experiments/{study.path.name}"]
    if scale != 1.0:
        parts.append(f"--scale {scale:g}")
    if min_requests is not None:
        parts.append(f"--min-requests {min_requests}")
    if "${" in json.dumps([dict(study.fixed), *(dict(c.params) for c in study.cases),
                           {k: list(v) for k, v in study.sweep.items()}]):
        parts.append("--traces-dir PATH/TO/shared/traces")
    if out is not None and out != "results" and not Path(out).is_absolute():
        parts.append(f"--out {Path(out).as_posix()}")
    return " ".join(parts)


def _flat(summary: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested summary keys (a hybrid run's ``by_kind``, ``by_row``; the ``tiers`` list,
    by tier name) as columns ``by_kind.<kind>.<key>``, ``tiers.cpu.<key>``, so that a
    study's table is flat and comparable. A cluster's ``instances`` list is left out:
    a point's row is the cluster's total."""
    out: dict[str, Any] = {}
    for key, value in summary.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        elif isinstance(value, list) and all(isinstance(v, dict) and "name" in v for v in value):
            for entry in value:
                out.update(_flat({k: v for k, v in entry.items() if k != "name"},
                                 f"{prefix}{key}.{entry['name']}."))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            continue  # a cluster's instances: the point's row is the cluster's total
        else:
            out[f"{prefix}{key}"] = value
    return out
