"""Experiments as data: TOML studies, their grids, runs, tables and figures.

:mod:`~fragsim.studies.schema` reads and checks a study file,
:mod:`~fragsim.studies.grid` expands it into runs with stable ids,
:mod:`~fragsim.studies.workloads` generates the workloads seed cases describe by
statistics, :mod:`~fragsim.studies.runner` runs and journals them and writes the
combined table, :mod:`~fragsim.studies.figures` draws the figures and
:mod:`~fragsim.studies.locate` finds studies and reference results for notebooks.
``fragsim sweep`` (``fragsim/cli/sweep.py``) is the command-line face of it all.
"""

from fragsim.studies.figures import draw
from fragsim.studies.grid import Run, expand
from fragsim.studies.locate import find_reference, find_study_file, study_table
from fragsim.studies.runner import StudyResult, key_columns, run_one, run_study
from fragsim.studies.schema import Case, FigureSpec, Study, load_study
from fragsim.studies.workloads import WORKLOAD_KINDS, build_trace, lognormal_params

__all__ = [
    "WORKLOAD_KINDS",
    "Case",
    "FigureSpec",
    "Run",
    "Study",
    "StudyResult",
    "build_trace",
    "draw",
    "expand",
    "find_reference",
    "find_study_file",
    "key_columns",
    "load_study",
    "lognormal_params",
    "run_one",
    "run_study",
    "study_table",
]
