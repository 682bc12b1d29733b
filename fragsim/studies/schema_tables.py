"""Reading a study's tables: ``allocators``, ``[workload]``, ``[[cases]]`` and
``[[figures]]``, and the check that every point reads a trace or generates a workload,
never both (:func:`_check_trace_source`). Keys and values are checked with
:mod:`fragsim.studies.schema_values`; what they are read into is
:mod:`fragsim.studies.schema_study`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fragsim.studies.schema_study import Case, FigureSpec, Study, case_workload
from fragsim.studies.schema_values import Where, _axes, _no_unknown, _params, _required, _typed
from fragsim.studies.workloads import TIMED_KINDS, check_workload

FIGURE_KINDS = ("split_bars", "lines", "bars", "timeseries")
FIGURE_KEYS = {"kind", "file", "title", "x", "y", "panels", "group", "logx", "logy",
               "ymax", "hline"}


def _allocators(where: Where, table: str, value: Any) -> tuple[str, ...]:
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


def _workload(where: Where, table: str, value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise where.error(table, None, "expected a table")
    try:
        return check_workload(value, partial=False)
    except ValueError as exc:
        raise where.error(table, None, str(exc)) from None


def _cases(where: Where, raw: Any, sweep: Mapping[str, Any]) -> tuple[Case, ...]:
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


def _figure(where: Where, index: int, raw: Mapping[str, Any]) -> FigureSpec:
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


def _names(where: Where, table: str, key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise where.error(table, key, f"expected a column name or a list of them, got {value!r}")
    return tuple(value)


def _check_trace_source(where: Where, study: Study) -> None:
    """A point reads a trace or generates a workload, never both, never neither."""
    for case in study.cases or (None,):
        table = f"[[cases]] {case.label!r}" if case else "[fixed]"
        params = {**study.fixed, **(case.params if case else {})}
        axes = {**study.sweep, **(case.sweep if case else {})}
        has_trace = "trace" in params or "trace" in axes
        if ("duration_s" in params or "duration_s" in axes) and not ("rate" in params or "rate" in axes):
            raise where.error(table, "duration_s", "needs a rate (requests/s): a point replays "
                              "rate × duration_s requests; without one, give num_requests")
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
            if workload["kind"] in TIMED_KINDS and ("rate" in params or "rate" in axes):
                raise where.error(table if "rate" in params else "[sweep]", "rate",
                                  f"a {workload['kind']} workload carries its own arrival times; "
                                  "drop rate (its [workload] parameters set the pace)")
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
