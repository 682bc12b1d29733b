"""Find experiment files and committed reference results, for notebooks and tests.

A notebook runs from ``notebooks/`` in a checkout, from a temporary copy in the
tests, or from anywhere a user puts it. It looks for ``experiments/<study>.toml``
and ``results/reference/<study>/`` in, in order: the folder an environment
variable names (``FRAGSIM_EXPERIMENTS_DIR``, ``FRAGSIM_REFERENCE_DIR``), the
current folder and its parents, and the checkout the package was installed from
(an editable install).
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from fragsim.errors import FragsimError
from fragsim.studies.runner import TABLE, TIMESERIES, StudyResult, run_study
from fragsim.studies.schema import load_study

EXPERIMENTS_ENV = "FRAGSIM_EXPERIMENTS_DIR"
REFERENCE_ENV = "FRAGSIM_REFERENCE_DIR"
SCALE_ENV = "FRAGSIM_NOTEBOOK_SCALE"
MIN_REQUESTS_ENV = "FRAGSIM_NOTEBOOK_MIN_REQUESTS"
DEFAULT_NOTEBOOK_SCALE = 0.1


def _candidates(env: str, relative: str) -> list[Path]:
    found = [Path(os.environ[env])] if os.environ.get(env) else []
    here = Path.cwd().resolve()
    found += [folder / relative for folder in (here, *here.parents)]
    found.append(Path(__file__).resolve().parents[2] / relative)
    return found


def find_study_file(name: str) -> Path:
    """``experiments/<name>.toml`` (see the module docstring for where it looks)."""
    for folder in _candidates(EXPERIMENTS_ENV, "experiments"):
        path = folder / f"{name}.toml"
        if path.is_file():
            return path
    raise FragsimError(f"experiment {name!r} not found; set {EXPERIMENTS_ENV} to the experiments folder")


def find_reference(name: str) -> Path | None:
    """``results/reference/<name>/`` holding a combined table, or None."""
    for folder in _candidates(REFERENCE_ENV, os.path.join("results", "reference")):
        if (folder / name / TABLE).is_file():
            return folder / name
    return None


def study_table(name: str) -> tuple[pd.DataFrame, pd.DataFrame | None, str]:
    """A study's combined table and time series, and a line saying where they came from.

    With ``FRAGSIM_NOTEBOOK_SCALE`` set, the study runs now at that scale (in
    memory, one process; ``FRAGSIM_NOTEBOOK_MIN_REQUESTS`` overrides the study's
    floor on requests per point); otherwise the committed reference is read, and
    only when there is none does the study run, at scale 0.1.
    """
    scale_text = os.environ.get(SCALE_ENV)
    reference = None if scale_text else find_reference(name)
    if reference is not None:
        series_path = reference / TIMESERIES
        series = pd.read_parquet(series_path) if series_path.is_file() else None
        return pd.read_parquet(reference / TABLE), series, f"read from {reference.name}/ (reference)"
    scale = float(scale_text) if scale_text else DEFAULT_NOTEBOOK_SCALE
    floor = os.environ.get(MIN_REQUESTS_ENV)
    result = run_small(name, scale, int(floor) if floor else None)
    return result.table, result.timeseries, f"ran now at scale {scale:g} ({len(result.table)} runs)"


def run_small(name: str, scale: float, min_requests: int | None = None) -> StudyResult:
    """Run a study in memory at ``scale`` (traces folder from $FRAGSIM_SHARED_TRACES)."""
    return run_study(load_study(find_study_file(name)), scale=scale, min_requests=min_requests,
                     figures=False)
