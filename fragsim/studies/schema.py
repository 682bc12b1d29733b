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

    [fixed]                       # any fragsim.simulate.RunSpec field
    model = "opt-13b"
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
"""

from __future__ import annotations

import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any

from fragsim.costmodel import COST_MODELS
from fragsim.errors import FragsimError
from fragsim.simulate import RunSpec
from fragsim.studies.workloads import check_workload

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

#: RunSpec fields a study may set, with their types (the seed lives in [study])
SPEC_TYPES: dict[str, Any] = {
    name: hint for name, hint in typing.get_type_hints(RunSpec).items() if name != "seed"
}
SWEEPABLE = {**SPEC_TYPES, "seed": int}

#: RunSpec string fields with a closed set of values, checked before anything runs
CHOICES: dict[str, tuple[str, ...]] = {
    "batching": ("continuous", "static"),
    "preemption": ("recompute", "swap"),
    "arrival": ("poisson", "gamma"),
    "cost_model": COST_MODELS,
    "fit": ("first", "best"),
    "reserve": ("max", "pow2", "oracle"),
}

STUDY_KEYS = {"description", "seed", "allocators", "timeseries", "min_requests"}
TOP_TABLES = {"study", "fixed", "workload", "sweep", "cases", "figures"}
FIGURE_KINDS = ("split_bars", "lines", "bars", "timeseries")
FIGURE_KEYS = {"kind", "file", "title", "x", "y", "panels", "group", "logx", "logy",
               "ymax", "hline"}


@dataclass(frozen=True)
class FigureSpec:
    """One figure a study draws from its combined table (see fragsim.studies.figures)."""

    kind: str
    file: str
    title: str | None = None
    x: str | None = None
    y: tuple[str, ...] = ()
    panels: tuple[str, ...] = ()      # one panel per distinct value of these columns
    group: str = "allocator"          # one colour (line, bar) per value of this column
    logx: bool = False
    logy: bool = False
    ymax: float | None = None
    hline: float | None = None        # a reference line, e.g. the seed's 20% danger line


@dataclass(frozen=True)
class Case:
    """A named variant: parameters that override [fixed], and axes of its own."""

    label: str
    params: Mapping[str, Any]
    sweep: Mapping[str, tuple[Any, ...]]
    allocators: tuple[str, ...] | None = None
    workload: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Study:
    name: str
    path: Path
    description: str
    seed: int
    allocators: tuple[str, ...]
    fixed: Mapping[str, Any]
    workload: Mapping[str, Any] | None
    sweep: Mapping[str, tuple[Any, ...]]
    cases: tuple[Case, ...]
    figures: tuple[FigureSpec, ...]
    timeseries: bool = False
    min_requests: int = 50

    @property
    def axes(self) -> list[str]:
        """Every swept parameter, as named in the table (workload ones as ``workload_x``)."""
        names = list(self.sweep)
        for case in self.cases:
            names += [k for k in case.sweep if k not in names]
        return [column_name(k) for k in names]


def column_name(key: str) -> str:
    """Table column of a parameter: ``workload.long_frac`` -> ``workload_long_frac``."""
    return key.replace(".", "_")


class _Where:
    """Builds error messages that name the file and the table."""

    def __init__(self, path: Path) -> None:
        self.file = path.name

    def error(self, table: str, key: str | None, message: str) -> FragsimError:
        where = f"{self.file}: {table}" + (f" {key}" if key else "")
        return FragsimError(f"{where}: {message}")


def load_study(path: str | Path) -> Study:
    """Read and check ``path``; raise FragsimError naming the key on any mistake."""
    path = Path(path)
    where = _Where(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FragsimError(f"{path}: no such experiment file") from None
    except tomllib.TOMLDecodeError as exc:
        raise FragsimError(f"{path.name}: not valid TOML: {exc}") from None
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


# ---------------------------------------------------------------- tables and keys

def _table(where: _Where, raw: Mapping[str, Any], name: str, required: bool = False) -> dict[str, Any]:
    if name not in raw:
        if required:
            raise where.error(f"[{name}]", None, "missing table")
        return {}
    value = raw[name]
    if not isinstance(value, dict):
        raise where.error(f"[{name}]", None, f"expected a table, got {type(value).__name__}")
    return value


def _list(where: _Where, raw: Mapping[str, Any], name: str) -> list[Any]:
    value = raw.get(name, [])
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise where.error(f"[[{name}]]", None, "expected an array of tables")
    return value


def _no_unknown(where: _Where, table: str, values: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise where.error(table, unknown[0], f"unknown key; allowed: {', '.join(sorted(allowed))}")


def _required(where: _Where, table: str, key: str, values: Mapping[str, Any]) -> Any:
    if key not in values:
        raise where.error(table, key, "required")
    return values[key]


def _typed(where: _Where, table: str, key: str, value: Any, kind: type) -> Any:
    if not _is_a(value, kind):
        raise where.error(table, key, f"expected {_type_name(kind)}, got {value!r}")
    return float(value) if kind is float else value


def _is_a(value: Any, kind: Any) -> bool:
    """Does a TOML value fit a RunSpec annotation (int, float, str, bool, X | None, tuple)?"""
    if isinstance(kind, UnionType) or typing.get_origin(kind) is typing.Union:
        return any(_is_a(value, k) for k in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if typing.get_origin(kind) is tuple:
        args = typing.get_args(kind)
        return (isinstance(value, list | tuple) and len(value) == len(args)
                and all(_is_a(v, a) for v, a in zip(value, args, strict=True)))
    return isinstance(value, kind)


def _type_name(kind: Any) -> str:
    if isinstance(kind, UnionType) or typing.get_origin(kind) is typing.Union:
        return " or ".join(_type_name(k) for k in typing.get_args(kind) if k is not type(None))
    if typing.get_origin(kind) is tuple:
        return f"a list of {len(typing.get_args(kind))} numbers"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        kind, getattr(kind, "__name__", str(kind)))


def _param(where: _Where, table: str, key: str, value: Any, allow_seed: bool = False) -> Any:
    """One RunSpec value, checked against the field's type and its allowed values."""
    kind = (SWEEPABLE if allow_seed else SPEC_TYPES).get(key)
    if kind is None:
        if key == "seed":
            raise where.error(table, key, "set the seed in [study] (or sweep it in [sweep])")
        raise where.error(table, key, "unknown parameter; allowed: any RunSpec field "
                          f"({', '.join(sorted(SPEC_TYPES))})")
    if not _is_a(value, kind):
        raise where.error(table, key, f"expected {_type_name(kind)}, got {value!r}")
    if key in CHOICES and value is not None and value not in CHOICES[key]:
        raise where.error(table, key, f"expected one of {', '.join(CHOICES[key])}, got {value!r}")
    if isinstance(value, list):
        return tuple(float(v) for v in value)
    if kind is float and isinstance(value, int):
        return float(value)
    return value


def _params(where: _Where, table: str, values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _param(where, table, k, v) for k, v in values.items()}


def _axes(where: _Where, table: str, values: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
    """Sweep axes: every value a non-empty list; workload parameters as ``workload.x``."""
    axes: dict[str, tuple[Any, ...]] = {}
    for key, value in values.items():
        if key == "workload" and isinstance(value, dict):
            for wkey, wvalues in value.items():
                axes[f"workload.{wkey}"] = _axis(where, table, f"workload.{wkey}", wvalues)
            continue
        axes[key] = tuple(_param(where, table, key, v, allow_seed=True)
                          for v in _axis(where, table, key, value))
    return axes


def _axis(where: _Where, table: str, key: str, value: Any) -> tuple[Any, ...]:
    if not isinstance(value, list) or not value:
        raise where.error(table, key, "expected a non-empty list")
    if len({repr(v) for v in value}) != len(value):
        raise where.error(table, key, f"repeated values in {value!r}")
    return tuple(value)


def _allocators(where: _Where, table: str, value: Any) -> tuple[str, ...]:
    from fragsim.allocators import PLACEMENTS, PRESETS
    from fragsim.hybrid import MANAGERS

    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise where.error(table, "allocators", "expected a non-empty list of names")
    known = list(PRESETS) + list(PLACEMENTS) + list(MANAGERS)
    for name in value:
        if name not in known:
            raise where.error(table, "allocators", f"unknown allocator {name!r}; known: {', '.join(known)}")
    if len(set(value)) != len(value):
        raise where.error(table, "allocators", f"repeated names in {value!r}")
    return tuple(value)


def _workload(where: _Where, table: str, value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise where.error(table, None, "expected a table")
    try:
        return check_workload(value, partial=False)
    except ValueError as exc:
        raise where.error(table, None, str(exc)) from None


def _cases(where: _Where, raw: Any, sweep: Mapping[str, Any]) -> tuple[Case, ...]:
    if not isinstance(raw, list) or not all(isinstance(c, dict) for c in raw):
        raise where.error("[[cases]]", None, "expected an array of tables")
    cases = []
    for i, entry in enumerate(raw, start=1):
        table = f"[[cases]] #{i}"
        entry = dict(entry)
        label = _typed(where, table, "label", _required(where, table, "label", entry), str)
        allocators = (_allocators(where, table, entry.pop("allocators"))
                      if "allocators" in entry else None)
        workload = entry.pop("workload", None)
        if workload is not None:
            if not isinstance(workload, dict):
                raise where.error(table, "workload", "expected a table")
            try:
                workload = check_workload(workload, partial=True)
            except ValueError as exc:
                raise where.error(table, "workload", str(exc)) from None
        axes = _axes(where, f"{table} sweep", entry.pop("sweep", {}))
        entry.pop("label")
        params = _params(where, table, entry)
        clash = sorted((set(params) | set(axes)) & set(sweep))
        if clash:
            raise where.error(table, clash[0], "is already swept in [sweep]")
        cases.append(Case(label, params, axes, allocators, workload))
    labels = [c.label for c in cases]
    if len(set(labels)) != len(labels):
        raise where.error("[[cases]]", "label", f"repeated labels in {labels!r}")
    return tuple(cases)


def _figure(where: _Where, index: int, raw: Mapping[str, Any]) -> FigureSpec:
    table = f"[[figures]] #{index + 1}"
    _no_unknown(where, table, raw, FIGURE_KEYS)
    kind = _typed(where, table, "kind", _required(where, table, "kind", raw), str)
    if kind not in FIGURE_KINDS:
        raise where.error(table, "kind", f"expected one of {', '.join(FIGURE_KINDS)}, got {kind!r}")
    file = _typed(where, table, "file", _required(where, table, "file", raw), str)
    if not file.endswith(".png") or "/" in file or "\\" in file:
        raise where.error(table, "file", f"expected a plain name ending in .png, got {file!r}")
    y = _names(where, table, "y", raw.get("y", []))
    if kind in ("lines", "bars", "timeseries") and not y:
        raise where.error(table, "y", f"required for a {kind} figure")
    x = raw.get("x")
    if kind in ("lines", "bars") and x is None:
        raise where.error(table, "x", f"required for a {kind} figure")
    spec = FigureSpec(
        kind=kind, file=file,
        title=_typed(where, table, "title", raw["title"], str) if "title" in raw else None,
        x=_typed(where, table, "x", x, str) if x is not None else None,
        y=y,
        panels=_names(where, table, "panels", raw.get("panels", [])),
        group=_typed(where, table, "group", raw.get("group", "allocator"), str),
        logx=_typed(where, table, "logx", raw.get("logx", False), bool),
        logy=_typed(where, table, "logy", raw.get("logy", False), bool),
        ymax=_typed(where, table, "ymax", raw["ymax"], float) if "ymax" in raw else None,
        hline=_typed(where, table, "hline", raw["hline"], float) if "hline" in raw else None,
    )
    return spec


def _names(where: _Where, table: str, key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise where.error(table, key, f"expected a column name or a list of them, got {value!r}")
    return tuple(value)


def case_workload(study: Study, case: Case | None) -> dict[str, Any] | None:
    """The workload a case generates: [workload] with the case's own keys on top, or
    only the case's when it names another kind."""
    own = dict(case.workload) if case is not None and case.workload else None
    base = dict(study.workload) if study.workload else None
    if own is None or base is None:
        return own or base
    if own.get("kind", base["kind"]) != base["kind"]:
        return own
    return {**base, **own}


def _check_trace_source(where: _Where, study: Study) -> None:
    """A point reads a trace or generates a workload, never both, never neither."""
    for case in study.cases or (None,):
        table = f"[[cases]] {case.label!r}" if case else "[fixed]"
        params = {**study.fixed, **(case.params if case else {})}
        axes = {**study.sweep, **(case.sweep if case else {})}
        has_trace = "trace" in params or "trace" in axes
        workload = case_workload(study, case)
        if has_trace and workload is not None:
            raise where.error(table, "trace", "set together with [workload]; keep one")
        if not has_trace and workload is None:
            raise where.error(table, "trace", "no trace and no [workload]: say what to replay")
        if workload is not None:
            try:
                check_workload(workload, partial=False)
            except ValueError as exc:
                raise where.error(table, "workload", str(exc)) from None
        for key, values in axes.items():
            if not key.startswith("workload."):
                continue
            if workload is None:
                raise where.error("[sweep]", key, "sweeps a workload parameter without [workload]")
            for value in values:
                try:
                    check_workload({**workload, key.split(".", 1)[1]: value}, partial=False)
                except ValueError as exc:
                    raise where.error("[sweep]", key, str(exc)) from None

