"""Run outputs: the comparison table, the results folder, the figures.

A results folder is written whole or not at all: everything goes to a hidden
sibling folder first, which is renamed into place at the end, so an interrupted
run never leaves a half-written ``results/<run-id>/``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fragsim.files import write_atomically

SPLIT = ("token_states", "reservation", "internal_fragmentation", "free")
SPLIT_LABELS = {"token_states": "token states", "reservation": "reservation",
                "internal_fragmentation": "internal frag.", "free": "free / external",
                "padding": "padding", "out_of_window": "out of window",
                "store_pending": "held for stores"}
SPLIT_COLORS = {"token_states": "#2b6cb0", "reservation": "#f6ad55",
                "internal_fragmentation": "#e53e3e", "free": "#cbd5e0",
                "padding": "#718096", "out_of_window": "#9f7aea", "store_pending": "#319795"}
#: the parts of an offload tier (fragsim.offload.connector), bottom to top
TIER_SPLIT = ("cached_hit_later", "cached_never_hit", "read_pending", "write_pending",
              "chunk_tail", "swapped", "free")
TIER_LABELS = {"cached_hit_later": "cached, hit later", "cached_never_hit": "cached, never hit again",
               "read_pending": "being read", "write_pending": "being written",
               "chunk_tail": "chunk tails", "swapped": "swapped-out sequences", "free": "free"}
TIER_COLORS = {"cached_hit_later": "#2f855a", "cached_never_hit": "#9ae6b4", "read_pending": "#3182ce",
               "write_pending": "#dd6b20", "chunk_tail": "#e53e3e", "swapped": "#805ad5", "free": "#cbd5e0"}


def run_id(config: dict[str, Any]) -> str:
    digest = hashlib.sha1(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return time.strftime("%Y%m%d-%H%M%S") + "-" + digest


def _json_default(value: Any) -> Any:
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def clean_json(value: Any) -> Any:
    """NaN/inf become null: JSON has no spelling for them."""
    if isinstance(value, dict):
        return {k: clean_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def dumps(value: Any) -> str:
    return json.dumps(clean_json(value), default=_json_default, allow_nan=False)


def write_results(out_root: Path, config: dict[str, Any], results: Sequence[Any],
                  plot: bool = False) -> Path:
    """Write ``out_root/<run-id>/`` atomically; returns the final folder."""
    out_root.mkdir(parents=True, exist_ok=True)
    rid = run_id(config)
    final = out_root / rid
    tmp = Path(tempfile.mkdtemp(prefix=f".{rid}-", dir=out_root))
    try:
        (tmp / "config.json").write_text(json.dumps(clean_json(config), indent=2, default=_json_default) + "\n")
        summaries = [r.summary for r in results]
        (tmp / "summary.json").write_text(
            json.dumps(clean_json(summaries), indent=2, default=_json_default) + "\n")
        for r in results:
            r.requests.to_parquet(tmp / f"requests-{r.allocator}.parquet", index=False)
            r.timeseries.to_parquet(tmp / f"timeseries-{r.allocator}.parquet", index=False)
            if getattr(r, "transfers", None) is not None:
                r.transfers.to_parquet(tmp / f"transfers-{r.allocator}.parquet", index=False)
        if plot:
            plot_split_bars(summaries, tmp / "memory_split.png")
            plot_split_over_time([i for r in results for i in _instances(r)], tmp / "memory_over_time.png")
            if any(s.get("tiers") for s in summaries):
                plot_tiers(summaries, tmp / "tiers.png")
            moved = [r for r in results if getattr(r, "transfers", None) is not None and len(r.transfers)]
            if moved:
                from fragsim.cluster.plots import plot_transfers

                plot_transfers(moved, tmp / "transfers.png")
            hybrid = [r for r in results if r.summary.get("by_kind")]
            if hybrid:
                plot_kinds_over_time(hybrid, tmp / "memory_by_kind.png")
            maps = [r for r in results if r.address_map is not None and "owner" in r.address_map]
            if maps:
                plot_address_maps(maps, tmp / "address_map.png")
            kind_maps = [r for r in results if r.address_map is not None and "row" in r.address_map]
            if kind_maps:
                plot_kind_maps(kind_maps, tmp / "address_map_by_kind.png")
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


# ------------------------------------------------------------------ tables

def comparison_table(summaries: Sequence[dict[str, Any]], title: str) -> Any:
    """A rich table: one row per allocator, the four-way split and what follows from it."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    columns = [
        ("allocator", "allocator", "left"),
        ("token states", "token_states_frac", "pct"),
        ("reserved", "reservation_frac", "pct"),
        ("internal", "internal_fragmentation_frac", "pct"),
        *([("padding", "padding_frac", "pct"), ("out of window", "out_of_window_frac", "pct")]
          if any("padding_frac" in s for s in summaries) else []),
        ("free", "free_frac", "pct"),
        *([("held for stores", "store_pending_frac", "pct")] if any(s.get("tiers") for s in summaries)
          else []),
        *([("held to send", "kv_sending_frac", "pct")] if any("kv_sending_frac" in s for s in summaries)
          else []),
        ("ext. frag mean/peak", None, "ext"),
        ("running mean/peak", None, "run"),
        ("blocked frag/cap", None, "blocked"),
        ("preempt", "num_preemptions", "int"),
        ("refused", "num_refused", "int"),
        ("tok/s", "throughput_tokens_per_s", "f1"),
        ("TTFT s mean/p99", None, "ttft"),
        ("norm. latency s/tok", "mean_normalized_latency_s", "f3"),
    ]
    widest = max((len(str(s["allocator"])) for s in summaries), default=9)
    for header, _, kind in columns:
        table.add_column(header, justify="left" if kind == "left" else "right", no_wrap=True,
                         min_width=widest if kind == "left" else None)
    for s in summaries:
        row = []
        for _, col, kind in columns:
            key = col or ""
            if kind == "left":
                row.append(str(s[key]))
            elif kind == "pct":
                row.append(f"{100 * s[key]:.1f}%" if s.get(key) is not None else "–")
            elif kind == "int":
                row.append(f"{s[key]:,}")
            elif kind == "f1":
                row.append(f"{s[key]:,.1f}")
            elif kind == "f3":
                row.append(_num(s[key], 3))
            elif kind == "ext":
                row.append(f"{100 * s['mean_external_fragmentation_ratio']:.1f}% / "
                           f"{100 * s['peak_external_fragmentation_ratio']:.0f}%")
            elif kind == "run":
                row.append(f"{s['mean_running']:.1f} / {s['peak_running']:.0f}")
            elif kind == "blocked":
                row.append(f"{s['num_blocked_fragmentation']:,} / {s['num_blocked_capacity']:,}")
            elif kind == "ttft":
                row.append(f"{_num(s['mean_ttft_s'], 2)} / {_num(s['p99_ttft_s'], 2)}")
        table.add_row(*row)
    return table


def _num(value: float, digits: int) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.{digits}f}"


# ------------------------------------------------------------------ figures

def _savefig(fig: Any, path: Path) -> None:
    write_atomically(path, lambda out: fig.savefig(out, format="png", dpi=130, bbox_inches="tight"))


def _instances(result: Any) -> list[Any]:
    """A run, or a cluster's instances (each labelled with its index) for per-instance figures."""
    instances = getattr(result, "instances", None)
    if not instances:
        return [result]
    return [dataclasses.replace(r, allocator=f"{r.allocator} #{i}") for i, r in enumerate(instances)]


def plot_split_bars(summaries: Sequence[dict[str, Any]], path: Path, title: str | None = None) -> None:
    """The vLLM paper's Figure 2: KV memory split per allocator, as stacked bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s["allocator"] for s in summaries]
    fig, ax = plt.subplots(figsize=(1.4 * len(names) + 2.5, 4.0))
    bottom = np.zeros(len(names))
    hybrid = any("padding_frac" in s for s in summaries)
    split = SPLIT[:3] + ("padding", "out_of_window", "free") if hybrid else SPLIT
    if any(s.get("store_pending_frac") for s in summaries):
        split = (split[0], "store_pending", *split[1:])
    for q in split:
        vals = np.array([100 * (s.get(f"{q}_frac") or 0.0) for s in summaries])
        bars = ax.bar(names, vals, bottom=bottom, color=SPLIT_COLORS[q], label=SPLIT_LABELS[q],
                      edgecolor="white", linewidth=0.5)
        for rect, v, b in zip(bars, vals, bottom, strict=True):
            if v >= 6:
                ax.text(rect.get_x() + rect.get_width() / 2, b + v / 2, f"{v:.1f}",
                        ha="center", va="center", fontsize=8, color="white" if q != "free" else "black")
        bottom += vals
    ax.set_ylabel("KV cache memory (%), time-weighted mean")
    ax.set_ylim(0, 100)
    ax.set_title(title or "Where the KV cache memory goes")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    _savefig(fig, path)
    plt.close(fig)


def plot_tiers(summaries: Sequence[dict[str, Any]], path: Path) -> None:
    """Where each offload tier's bytes go (time-weighted), one bar per allocator and tier,
    each labelled with its hit tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"{s['allocator']}\n{t['name']} {t['capacity_bytes'] / 2**30:,.1f} GiB", t)
            for s in summaries for t in s.get("tiers") or ()]
    fig, ax = plt.subplots(figsize=(1.6 * len(bars) + 3.0, 4.0))
    names = [name for name, _ in bars]
    bottom = np.zeros(len(bars))
    for q in TIER_SPLIT:
        vals = np.array([100 * t[f"{q}_frac"] for _, t in bars])
        rects = ax.bar(names, vals, bottom=bottom, color=TIER_COLORS[q], label=TIER_LABELS[q],
                       edgecolor="white", linewidth=0.5)
        for rect, v, b in zip(rects, vals, bottom, strict=True):
            if v >= 6:
                ax.text(rect.get_x() + rect.get_width() / 2, b + v / 2, f"{v:.1f}",
                        ha="center", va="center", fontsize=8)
        bottom += vals
    for i, (_, t) in enumerate(bars):
        ax.text(i, 101, f"hits {t['hits_tokens']:,} tok", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tier memory (%), time-weighted mean")
    ax.set_ylim(0, 108)
    ax.set_title("Where the bytes of each offload tier go")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    _savefig(fig, path)
    plt.close(fig)


def plot_split_over_time(results: Sequence[Any], path: Path) -> None:
    """The four-way split over time, one panel per allocator (stacked areas)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(n, 1, figsize=(9, 1.9 * n + 0.6), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=True):
        ts: pd.DataFrame = r.timeseries
        cap = r.summary["capacity_slots"] or r.summary["kv_pool_bytes"]
        ys = [100 * ts[q].to_numpy() / cap for q in SPLIT]
        ax.stackplot(ts["time_s"], *ys, colors=[SPLIT_COLORS[q] for q in SPLIT],
                     labels=[SPLIT_LABELS[q] for q in SPLIT], step="post")
        ax2 = ax.twinx()
        ax2.plot(ts["time_s"], ts["running"], color="black", linewidth=0.7, label="running")
        ax2.set_ylabel("running", fontsize=8)
        ax.set_ylim(0, 100)
        ax.set_ylabel(f"{r.allocator}\n% of pool", fontsize=8)
    axes[0, 0].legend(loc="upper left", bbox_to_anchor=(1.08, 1.0), frameon=False, fontsize=8)
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.suptitle("KV memory over time")
    _savefig(fig, path)
    plt.close(fig)


KIND_COLORS = ["#2b6cb0", "#2f855a", "#b7791f", "#805ad5", "#c53030", "#2c7a7b"]


def plot_kinds_over_time(results: Sequence[Any], path: Path) -> None:
    """A hybrid manager's pool over time by layer kind: for each kind its token states
    (dark), its blocks out of the window (hatched) and the rest it holds (reservation,
    block tails, padding; light); free memory grey. One panel per manager."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    n = len(results)
    fig, axes = plt.subplots(n, 1, figsize=(9, 2.1 * n + 0.8), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=True):
        ts: pd.DataFrame = r.timeseries
        cap = r.summary["kv_pool_bytes"]
        kinds = [k for k in r.summary["by_kind"] if k != "pool"]
        ys, colors, labels, hatches = [], [], [], []
        for i, kind in enumerate(kinds):
            base = KIND_COLORS[i % len(KIND_COLORS)]
            other = sum(ts[f"{kind}.{c}"].fillna(0).to_numpy()
                        for c in ("reservation", "internal_fragmentation", "padding"))
            for part, alpha, label, hatch in (
                    (ts[f"{kind}.token_states"].fillna(0).to_numpy(), 1.0, f"{kind}: token states", None),
                    (ts[f"{kind}.out_of_window"].fillna(0).to_numpy(), 0.55, f"{kind}: out of window", "///"),
                    (other, 0.3, f"{kind}: reserved, tails, padding", None)):
                ys.append(100 * part / cap)
                colors.append(to_rgba(base, alpha))
                labels.append(label)
                hatches.append(hatch)
        free = sum(ts[f"{k}.free"].fillna(0).to_numpy() for k in r.summary["by_kind"])
        pad = ts["pool.padding"].fillna(0).to_numpy() if "pool.padding" in ts else 0 * free
        ys += [100 * pad / cap, 100 * free / cap]
        colors += [to_rgba("#718096"), to_rgba("#e2e8f0")]
        labels += ["pool padding", "free"]
        hatches += [None, None]
        areas = ax.stackplot(ts["time_s"], *ys, colors=colors, labels=labels, step="post")
        for area, hatch in zip(areas, hatches, strict=True):
            if hatch:
                area.set_hatch(hatch)
        ax.set_ylim(0, 100)
        ax.set_ylabel(f"{r.allocator}\n% of pool", fontsize=8)
    axes[0, 0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=7)
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.suptitle("KV pool by layer kind over time")
    _savefig(fig, path)
    plt.close(fig)


def plot_kind_maps(results: Sequence[Any], path: Path) -> None:
    """Time × pool unit for the hybrid managers, coloured by the layer kind that holds
    each unit (white: free): vLLM's groups interleave in one pool, a static partition
    keeps bands, Jenga carves large pages for one kind at a time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n + 1.6, 4.2), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        amap = r.address_map
        kinds = list(dict.fromkeys(amap["kinds"]))
        colors = ["#ffffff"] + [KIND_COLORS[i % len(KIND_COLORS)] for i in range(len(kinds))]
        index = np.array([kinds.index(k) + 1 for k in amap["kinds"]])
        rows = amap["row"]
        shown = np.where(rows < 0, 0, index[np.maximum(rows, 0)])
        t = amap["time_s"]
        ax.imshow(shown.T, aspect="auto", origin="lower", interpolation="nearest",
                  cmap=ListedColormap(colors), vmin=0, vmax=len(colors) - 1,
                  extent=(float(t[0]), float(t[-1]) if len(t) > 1 else float(t[0]) + 1, 0, rows.shape[1]))
        ax.set_title(r.allocator, fontsize=9)
        ax.set_xlabel("time (s)")
        ax.set_ylabel(f"{amap['unit']} (binned)", fontsize=7)
        ax.legend(handles=[Patch(facecolor=c, edgecolor="#999999", label=k)
                           for c, k in zip(colors, ["free", *kinds], strict=True)],
                  loc="upper right", fontsize=7, frameon=True)
    fig.suptitle("The pool's address space over time by layer kind (white = free)", fontsize=9)
    _savefig(fig, path)
    plt.close(fig)


def plot_address_maps(results: Sequence[Any], path: Path) -> None:
    """Time × slot, each request's stored tokens in its own colour, owned-but-unfilled
    slots grey, free slots white: external fragmentation shows as white stripes that no
    waiting request fits into, over-reservation as grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n + 1, 4.2), sharey=False, squeeze=False)
    rng = np.random.default_rng(0)
    palette = ListedColormap(np.vstack([[1, 1, 1, 1], [0.62, 0.62, 0.62, 1],
                                        plt.cm.tab20(rng.permutation(20) % 20)]))
    for ax, r in zip(axes[0], results, strict=True):
        amap = r.address_map
        owner = amap["owner"]
        color = np.where(owner == -1, 0, np.where(owner == -2, 1, 2 + owner % 20))
        t = amap["time_s"]
        ax.imshow(color.T, aspect="auto", origin="lower", cmap=palette, vmin=0, vmax=21,
                  interpolation="nearest",
                  extent=(float(t[0]), float(t[-1]) if len(t) > 1 else float(t[0]) + 1, 0,
                          r.summary["capacity_slots"]))
        ax.set_title(r.allocator, fontsize=9)
        ax.set_xlabel("time (s)")
    axes[0, 0].set_ylabel("slot (address)")
    fig.suptitle("Address space over time: a colour per request where its tokens are stored, "
                 "grey = owned but unfilled (reservation, internal fragmentation), white = free",
                 fontsize=9)
    _savefig(fig, path)
    plt.close(fig)
