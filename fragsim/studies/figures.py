"""The figure kinds a study can ask for, drawn from its combined table.

``split_bars``  the vLLM paper's Figure 2: per allocator, a stacked bar of the
                time-weighted KV split (token states / reservation / internal
                fragmentation / free), one panel per value of ``panels``.
``lines``       Figures 12-13 style: ``y`` against ``x``, one line per ``group``
                value (default: allocator), one panel per ``panels`` value and
                one row of panels per ``y`` column.
``bars``        grouped bars: categories ``x``, one bar per ``group`` value, one
                panel per ``y`` column (the seed cases' before/after comparisons).
``timeseries``  a time-series column (e.g. ``external_fragmentation_ratio``)
                against simulated time, one line per ``group`` value.

A row with no value in a ``lines`` figure's ``x`` column or a ``bars`` figure's
``group`` column (a case without the swept thing: no offload tier in a sweep of
tier sizes) is a *reference*: a dashed horizontal line at its value across the
panel, named by its case.

Figures are built on ``matplotlib.figure.Figure`` directly, not pyplot, so they
need no backend and leave no global state: the sweep saves them, a notebook
displays them.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from fragsim.errors import FragsimError
from fragsim.report import SPLIT, SPLIT_COLORS, SPLIT_LABELS
from fragsim.studies.figure_names import LABELS, PERCENT, SYSTEMS
from fragsim.studies.schema import FigureSpec, Study


def draw(spec: FigureSpec, table: pd.DataFrame, timeseries: pd.DataFrame | None,
         study: Study | None = None) -> Figure:
    """Draw one figure; a column it names that the table lacks is a FragsimError."""
    where = f"{study.path.name}: " if study is not None else ""
    source = table
    if spec.kind == "timeseries":
        if timeseries is None:
            raise FragsimError(f"{where}figure {spec.file}: needs [study] timeseries = true")
        keep = [c for c in table.columns if c not in timeseries.columns or c in ("point_id", "allocator")]
        source = timeseries.merge(table[keep], on=["point_id", "allocator"], how="left")
    needed = [c for c in (spec.x, *spec.y, *spec.panels, spec.group) if c]
    missing = [c for c in needed if c not in source.columns]
    if missing:
        raise FragsimError(f"{where}figure {spec.file}: no column {missing[0]!r} in the "
                           f"{'time series' if spec.kind == 'timeseries' else 'table'}")
    kind = {"split_bars": _split_bars, "lines": _lines, "bars": _bars, "timeseries": _timeseries}
    fig = kind[spec.kind](spec, source)
    if spec.title:
        fig.suptitle(spec.title, fontsize=11)
    return fig


# ---------------------------------------------------------------- helpers

def _panels(table: pd.DataFrame, columns: Sequence[str]) -> list[tuple[Any, ...]]:
    """Distinct values of ``columns``, one panel each: ordered by the first column's
    values in order of appearance, then the second's, and so on."""
    if not columns:
        return [()]
    text = table[list(columns)].astype(str)
    ranks = [{v: i for i, v in enumerate(dict.fromkeys(text[c]))} for c in columns]
    first = text.drop_duplicates()
    combos = sorted(first.index, key=lambda i: tuple(r[text.loc[i, c]] for r, c in zip(ranks, columns, strict=True)))
    return [tuple(table.loc[i, c] for c in columns) for i in combos]


def _select(table: pd.DataFrame, columns: Sequence[str], values: tuple[Any, ...]) -> pd.DataFrame:
    mask = np.ones(len(table), dtype=bool)
    for column, value in zip(columns, values, strict=True):
        mask &= (table[column].astype(str) == str(value)).to_numpy()
    return table[mask]


def _panel_title(columns: Sequence[str], values: tuple[Any, ...]) -> str:
    parts = []
    for column, value in zip(columns, values, strict=True):
        text = os.path.basename(str(value)) if column == "trace" else str(value)
        if column == "allocator" and value in SYSTEMS:
            text = SYSTEMS[value][0]
        parts.append(text if column in ("case", "trace", "model", "gpu", "allocator")
                     else f"{_label(column)} = {text}")
    return ", ".join(parts)


def _tick(column: str, value: Any) -> str:
    """A category label that fits under a bar group: trace files by their stem."""
    text = str(value)
    if column == "trace":
        text = os.path.splitext(os.path.basename(text))[0].replace("_", " ")
    return textwrap.fill(text, 16)


def _style(group: str, value: Any, index: int) -> dict[str, Any]:
    if group == "allocator" and value in SYSTEMS:
        label, color, marker = SYSTEMS[value]
        return {"label": label, "color": color, "marker": marker}
    palette = ["#2b6cb0", "#c53030", "#2f855a", "#dd6b20", "#805ad5", "#4a5568", "#b7791f"]
    markers = "osD^vx*"
    label = f"{_label(group)} = {value}" if group not in ("case", "trace") else _tick(group, value)
    return {"label": label, "color": palette[index % len(palette)], "marker": markers[index % len(markers)]}


def _groups(table: pd.DataFrame, group: str) -> list[Any]:
    return list(dict.fromkeys(table[group].tolist()))


def _split_references(table: pd.DataFrame, column: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(reference rows: no value in ``column``, the other rows)."""
    missing = table[column].isna().to_numpy()
    return table[missing], table[~missing]


_REFERENCE_STYLES = ("--", ":", "-.")


def _draw_references(ax: Any, references: pd.DataFrame, y: str, spec: FigureSpec) -> None:
    """Each reference row as a dashed horizontal line at its ``y``, named by its case."""
    for i, (_, row) in enumerate(references.iterrows()):
        value = _values(row.to_frame().T, y)[0]
        if not np.isfinite(value):
            continue
        case = str(row["case"]) if "case" in row and row["case"] else None
        label = case or _style(spec.group, row[spec.group], 0)["label"]
        ax.axhline(value, color="#4a5568", linewidth=1.2, label=label,
                   linestyle=_REFERENCE_STYLES[i % len(_REFERENCE_STYLES)])


def _values(frame: pd.DataFrame, column: str) -> np.ndarray:
    values = frame[column].to_numpy(dtype=np.float64)
    return 100 * values if column in PERCENT else values


def _label(column: str) -> str:
    return LABELS.get(column, column)


def _grid(rows: int, cols: int, width: float = 3.6, height: float = 2.9) -> tuple[Figure, np.ndarray]:
    fig = Figure(figsize=(width * cols + 0.6, height * rows + 0.5), layout="constrained")
    axes = np.asarray(fig.subplots(rows, cols, squeeze=False))
    return fig, axes


def _one_per(frame: pd.DataFrame, columns: Sequence[str], spec: FigureSpec) -> None:
    if frame.duplicated(subset=list(columns)).any():
        raise FragsimError(f"figure {spec.file}: several rows per {', '.join(columns)}; "
                           "add the swept columns to `panels`")


def _legend(fig: Figure, axes: np.ndarray, spec: FigureSpec) -> None:
    """One legend for the figure, unless the panel titles already name every group."""
    if spec.group in spec.panels:
        return
    entries: dict[str, Any] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    # Below the panels: a legend at the top right collides with a centred title.
    fig.legend(list(entries.values()), list(entries), loc="outside lower center", frameon=False,
               fontsize=8, ncol=min(len(entries), 6))


def _bar_value(value: float) -> str:
    """``0.023``, ``3,580``, ``1.08G``: three figures from a million on."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _log_tick(value: float, _: Any = None) -> str:
    """``2``, ``0.5``, ``20M``: a log-axis tick whose mantissa is 1, 2 or 5, else no label."""
    if value <= 0:
        return ""
    mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
    if min(abs(mantissa - m) for m in (1, 2, 5)) > 1e-6:
        return ""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


def _finish(ax: Any, spec: FigureSpec) -> None:
    if spec.hline is not None:
        ax.axhline(100 * spec.hline if spec.y and spec.y[0] in PERCENT else spec.hline,
                   color="#e53e3e", linestyle="--", linewidth=1)
    if spec.logy:
        ax.set_yscale("log")
        low, high = ax.get_ylim()
        if high < 100 * low:  # within two decades: label 1, 2, 5 of each decade, plainly
            ax.yaxis.set_major_formatter(FuncFormatter(_log_tick))
            ax.yaxis.set_minor_formatter(FuncFormatter(_log_tick))
        else:  # decades only
            ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.ticklabel_format(axis="y", useOffset=False)
    if spec.ymax is not None:
        ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]) if spec.logy else 0.0, top=spec.ymax)
    ax.grid(True, alpha=0.3, linewidth=0.6)


# ---------------------------------------------------------------- kinds

def _split_bars(spec: FigureSpec, table: pd.DataFrame) -> Figure:
    panels = _panels(table, spec.panels)
    cols = 3 if len(panels) > 4 else len(panels)
    rows = -(-len(panels) // cols)
    fig, axes = _grid(rows, cols, width=max(2.4, 0.75 * len(_groups(table, spec.group)) + 0.8),
                      height=3.4)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, values in zip(axes.flat, panels, strict=False):
        sub = _select(table, spec.panels, values)
        _one_per(sub, [spec.group], spec)
        names = sub[spec.group].tolist()
        labels = [_style(spec.group, n, i)["label"] for i, n in enumerate(names)]
        bottom = np.zeros(len(sub))
        # Hybrid managers split further; dense rows of the same table have no such parts.
        hybrid = "padding_frac" in sub and bool(sub["padding_frac"].notna().any())
        parts = SPLIT[:3] + ("padding", "out_of_window", "free") if hybrid else SPLIT
        for part in parts:
            heights = 100 * sub[f"{part}_frac"].fillna(0.0).to_numpy(dtype=np.float64)
            ax.bar(labels, heights, bottom=bottom, color=SPLIT_COLORS[part], width=0.7,
                   label=SPLIT_LABELS[part], edgecolor="white", linewidth=0.5)
            for x, (h, b) in enumerate(zip(heights, bottom, strict=True)):
                if part == "token_states" or h >= 12:
                    ax.text(x, b + h / 2, f"{h:.1f}", ha="center", va="center", fontsize=7,
                            color="black" if part == "free" else "white")
            bottom += heights
        ax.set_ylim(0, 100)
        ax.set_title(_panel_title(spec.panels, values), fontsize=9)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("KV cache memory (%)")
    axes[0, -1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8)
    return fig


def _lines(spec: FigureSpec, table: pd.DataFrame) -> Figure:
    assert spec.x is not None
    panels = _panels(table, spec.panels)
    references, table = _split_references(table, spec.x)
    groups = _groups(table, spec.group)
    # One row per y column and one column per panel, or the transpose when there
    # are more y columns than panels, so that the figure stays landscape.
    across = len(spec.y) > len(panels)
    # One y over many panels: they wrap, three or four to a row.
    wrap = 3 if len(panels) % 3 == 0 else 4
    wrapped = len(spec.y) == 1 and len(panels) > 4
    if wrapped:
        fig, axes = _grid(-(-len(panels) // wrap), wrap)
        for ax in axes.flat[len(panels):]:
            ax.set_visible(False)
    else:
        fig, axes = _grid(len(panels), len(spec.y)) if across else _grid(len(spec.y), len(panels))
    for r, y in enumerate(spec.y):
        for c, values in enumerate(panels):
            ax = axes.flat[c] if wrapped else (axes[c, r] if across else axes[r, c])
            sub = _select(table, spec.panels, values)
            for i, g in enumerate(groups):
                line = sub[sub[spec.group] == g].sort_values(spec.x)
                if len(line):
                    ax.plot(line[spec.x].to_numpy(dtype=np.float64), _values(line, y),
                            markersize=4, linewidth=1.4, **_style(spec.group, g, i))
            _draw_references(ax, _select(references, spec.panels, values), y, spec)
            if spec.logx:
                _log_x(ax, table[spec.x])
            _finish(ax, spec)
            if across:
                title = _label(y) + (f"\n{_panel_title(spec.panels, values)}" if spec.panels else "")
                ax.set_title(title, fontsize=9)
            else:
                if r == 0 and spec.panels:
                    ax.set_title(_panel_title(spec.panels, values), fontsize=9)
                if c % wrap == 0 if wrapped else c == 0:
                    ax.set_ylabel(_label(y), fontsize=9)
            if (c == len(panels) - 1) if across else (r == len(spec.y) - 1):
                ax.set_xlabel(_label(spec.x), fontsize=9)
    _legend(fig, axes, spec)
    return fig


def _log_x(ax: Axes, x: pd.Series) -> None:
    """A log x axis labelled at the swept values themselves (1, 2, 4 ... or 0.01, 0.03 ...)
    when there are few enough of them, rather than at powers of the base."""
    ax.set_xscale("log")
    values = sorted(set(x.dropna().astype(float).tolist()))
    if len(values) <= 12:
        ax.set_xticks(values, [f"{v:g}" for v in values], fontsize=8)
        ax.minorticks_off()


def _bars(spec: FigureSpec, table: pd.DataFrame) -> Figure:
    assert spec.x is not None
    panels = _panels(table, spec.panels)
    references, table = _split_references(table, spec.group)
    groups = _groups(table, spec.group)
    fig, axes = _grid(len(panels), len(spec.y), width=3.2)
    width = 0.8 / len(groups)
    for r, values in enumerate(panels):
        sub = _select(table, spec.panels, values)
        refs = _select(references, spec.panels, values)
        _one_per(sub, [spec.x, spec.group], spec)
        categories = list(dict.fromkeys(sub[spec.x].tolist()))
        for c, y in enumerate(spec.y):
            ax = axes[r, c]
            for i, g in enumerate(groups):
                rows = sub[sub[spec.group] == g].set_index(spec.x).reindex(categories)
                heights = _values(rows.reset_index(), y)
                xs = np.arange(len(categories)) + (i - (len(groups) - 1) / 2) * width
                style = _style(spec.group, g, i)
                bars = ax.bar(xs, heights, width=width * 0.95, color=style["color"], label=style["label"])
                if len(groups) <= 3:  # more labels than that overlap
                    ax.bar_label(bars, fmt=_bar_value, fontsize=6, padding=1)
            _draw_references(ax, refs, y, spec)
            ax.set_xticks(np.arange(len(categories)), [_tick(spec.x, v) for v in categories], fontsize=8)
            ax.set_title(_label(y) + (f"\n{_panel_title(spec.panels, values)}" if spec.panels else ""),
                         fontsize=9)
            ax.margins(y=0.15)
            if r == len(panels) - 1:
                ax.set_xlabel(_label(spec.x), fontsize=9)
            _finish(ax, spec)
    _legend(fig, axes, spec)
    return fig


def _timeseries(spec: FigureSpec, series: pd.DataFrame) -> Figure:
    panels = _panels(series, spec.panels)
    groups = _groups(series, spec.group)
    fig, axes = _grid(len(spec.y), len(panels), width=5.0)
    for r, y in enumerate(spec.y):
        for c, values in enumerate(panels):
            ax = axes[r, c]
            sub = _select(series, spec.panels, values)
            for i, g in enumerate(groups):
                line = sub[sub[spec.group] == g]
                style = _style(spec.group, g, i)
                ax.step(line["time_s"].to_numpy(dtype=np.float64), _values(line, y), where="post",
                        color=style["color"], label=style["label"], linewidth=0.9)
            _finish(ax, spec)
            if r == 0 and spec.panels:
                ax.set_title(_panel_title(spec.panels, values), fontsize=9)
            if c == 0:
                ax.set_ylabel(_label(y), fontsize=9)
            ax.set_xlabel(_label("time_s"), fontsize=9)
    _legend(fig, axes, spec)
    return fig
