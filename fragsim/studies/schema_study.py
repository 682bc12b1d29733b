"""What an experiment file is read into: the :class:`Study`, its named :class:`Case`
variants and its :class:`FigureSpec` figures, with the two rules the grid shares
(:func:`column_name`, :func:`case_workload`). Reading and checking the file is
:mod:`fragsim.studies.schema`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
