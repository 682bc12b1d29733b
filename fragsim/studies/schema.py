"""An experiment file: one study, its grid, its fixed parameters and its figures.

A study is data, not code, so that a figure can be regenerated, reviewed and
varied by editing one TOML file. Every key there is (an illustration, not one
consistent file; every table but ``[study]`` is optional)::

    [study]
    description = "..."           # one line, shown in the gallery
    seed = 0                      # seed of every run ([sweep] seed = [...] replicates)
    allocators = ["vllm", ...]    # presets or placements; each point runs all of them
    timeseries = false            # keep each run's time series (timeseries.parquet)
    min_requests = 50             # --scale never takes a point below this many requests

    [fixed]                       # any fragsim.simulate.RunSpec field, or duration_s
    model = "opt-13b"
    duration_s = 3600             # rate × 3600 s of arrivals a point, in place of
                                  # num_requests (needs a rate; scaled by --scale too)
    trace = "azure-conv"          # bundled trace, workload name, file path (relative to
                                  # the current folder) or "${SHARED_TRACES}/file.csv"

    [workload]                    # a generated workload instead of `trace`
    kind = "lognormal"            # see fragsim.studies.workloads.WORKLOAD_KINDS
                                  # (num_requests defaults to 1000 for these)

    [sweep]                       # axes: non-empty lists, crossed (cartesian product)
    rate = [0.5, 1.0]
    workload.long_frac = [0.0, 0.1]   # a [workload] parameter as an axis

    [[cases]]                     # optional: named variants, run one after the other
    label = "ShareGPT"            # the `case` column and the figure panel title
    trace = "sharegpt-paper"      # overrides [fixed]; `allocators` and `workload` too
                                  # (a `workload` of another kind replaces [workload])
    [cases.sweep]                 # axes of this case only, crossed with [sweep]
    rate = [1.0, 2.0]

    [[figures]]                   # what the sweep draws (fragsim.studies.figures)
    kind = "lines"
    file = "latency.png"
    x = "rate"
    y = "mean_normalized_latency_s"

Every mistake is a :class:`~fragsim.errors.FragsimError` that names the file, the
table and the key (``vllm_fig2.toml: [sweep] rate: expected a non-empty list``).

Where it lives: this module reads the file and its ``[study]`` table
(:func:`load_study`); what a study is read into (:class:`Study`, :class:`Case`,
:class:`FigureSpec`) is in :mod:`fragsim.studies.schema_study`, checking keys and
values against :class:`~fragsim.simulate.RunSpec` in
:mod:`fragsim.studies.schema_values`, the other tables in
:mod:`fragsim.studies.schema_tables`. Their names are re-exported here.
"""

from __future__ import annotations

from pathlib import Path

# re-exported: fragsim.studies.schema is where callers look
from fragsim.studies.schema_study import (  # noqa: F401
    Case,
    FigureSpec,
    Study,
    case_workload,
    column_name,
)
from fragsim.studies.schema_tables import (  # noqa: F401
    FIGURE_KEYS,
    FIGURE_KINDS,
    _allocators,
    _cases,
    _check_trace_source,
    _figure,
    _workload,
)
from fragsim.studies.schema_values import (  # noqa: F401
    CHOICES,
    PARAM_TYPES,
    SPEC_TYPES,
    SWEEPABLE,
    Where,
    _axes,
    _list,
    _no_unknown,
    _params,
    _required,
    _table,
    _typed,
    read_toml,
)

STUDY_KEYS = {"description", "seed", "allocators", "timeseries", "min_requests"}
TOP_TABLES = {"study", "fixed", "workload", "sweep", "cases", "figures"}


def load_study(path: str | Path) -> Study:
    """Read and check ``path``; raise FragsimError naming the key on any mistake."""
    path = Path(path)
    where = Where(path)
    raw = read_toml(path, "experiment file")
    unknown = sorted(set(raw) - TOP_TABLES)
    if unknown:
        raise where.error(f"[{unknown[0]}]", None,
                          f"unknown table; allowed: {', '.join(sorted(TOP_TABLES))}")
    head = _table(where, raw, "study", required=True)
    _no_unknown(where, "[study]", head, STUDY_KEYS)
    fixed = _params(where, "[fixed]", _table(where, raw, "fixed"))
    workload = _workload(where, "[workload]", raw.get("workload"))
    sweep = _axes(where, "[sweep]", _table(where, raw, "sweep"))
    overlap = sorted(set(fixed) & set(sweep))
    if overlap:
        raise where.error("[sweep]", overlap[0], "also set in [fixed]; keep one")
    cases = _cases(where, raw.get("cases", []), sweep)
    study = Study(
        name=path.stem,
        path=path,
        description=_typed(where, "[study]", "description", head.get("description", ""), str),
        seed=_typed(where, "[study]", "seed", _required(where, "[study]", "seed", head), int),
        allocators=_allocators(where, "[study]", _required(where, "[study]", "allocators", head)),
        fixed=fixed,
        workload=workload,
        sweep=sweep,
        cases=cases,
        figures=tuple(_figure(where, i, f) for i, f in enumerate(_list(where, raw, "figures"))),
        timeseries=_typed(where, "[study]", "timeseries", head.get("timeseries", False), bool),
        min_requests=_typed(where, "[study]", "min_requests", head.get("min_requests", 50), int),
    )
    _check_trace_source(where, study)
    return study
