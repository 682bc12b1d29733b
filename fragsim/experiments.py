"""Experiments as data: the public entry points of :mod:`fragsim.studies`.

    >>> from fragsim.experiments import load_study, expand, run_study
    >>> study = load_study("experiments/vllm_fig2.toml")      # doctest: +SKIP
    >>> [run.run_id for run in expand(study, scale=0.1)]      # doctest: +SKIP
    >>> result = run_study(study, scale=0.1, out="results")   # doctest: +SKIP
    >>> result.table[["case", "allocator", "token_states_frac"]]  # doctest: +SKIP

The implementation lives in the :mod:`fragsim.studies` package (schema, grid,
workloads, runner, figures, locate); this module keeps the short import path.
"""

from fragsim.studies import (
    WORKLOAD_KINDS,
    Case,
    FigureSpec,
    Run,
    Study,
    StudyResult,
    build_trace,
    draw,
    expand,
    find_reference,
    find_study_file,
    key_columns,
    load_study,
    lognormal_params,
    run_one,
    run_study,
    study_table,
)

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
