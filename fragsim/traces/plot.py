"""A one-figure portrait of a trace: its two length histograms and its arrival rate."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fragsim.errors import FragsimError
from fragsim.files import write_atomically
from fragsim.traces.request import Trace

if TYPE_CHECKING:
    from matplotlib.axes import Axes

MAX_TIME_BINS = 300  # finer bins turn the arrival curve into noise at this figure width


def plot_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write a PNG of ``trace``: input and output length histograms on a log-x axis
    (lengths span four orders of magnitude), and arrivals per second over time
    when the trace has timestamps. Written atomically: a reader never sees half a file.
    """
    target = Path(path)
    if not target.parent.is_dir():  # fail before the slow drawing, not after
        raise FragsimError(f"{target}: cannot write the plot: no directory {target.parent}")
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    timed = trace.has_timestamps and len(trace) > 1 and trace.duration_s > 0
    fig = Figure(figsize=(12, 3.6 if not timed else 7.2), layout="constrained")
    grid = fig.add_gridspec(2 if timed else 1, 2)
    for column, (label, values) in enumerate(
        (("input (prompt) tokens", trace.prompt_len), ("output tokens", trace.output_len))
    ):
        _length_histogram(fig.add_subplot(grid[0, column]), label, values)
    if timed:
        _arrival_rate(fig.add_subplot(grid[1, :]), trace)
    fig.suptitle(f"{trace.name}: {len(trace):,} requests")
    write_atomically(target, lambda out: fig.savefig(out, format="png", dpi=120), "the plot")


def _length_histogram(ax: Axes, label: str, values: np.ndarray) -> None:
    # Log-spaced edges snapped to half-integers: at small lengths a log bin is
    # narrower than one token, and unsnapped bins would show empty gaps there.
    edges = np.unique(np.rint(np.geomspace(values.min(), values.max() + 1, 61))) - 0.5
    ax.hist(values, bins=edges.tolist(), color="tab:blue")
    ax.set_xscale("log")
    mean = float(values.mean())
    ax.axvline(mean, color="tab:red", linestyle="--", label=f"mean {mean:,.1f}")
    ax.set_xlabel(label)
    ax.set_ylabel("requests")
    ax.legend()


def _arrival_rate(ax: Axes, trace: Trace) -> None:
    duration = trace.duration_s
    bin_s = max(1.0, float(np.ceil(duration / MAX_TIME_BINS)))
    edges = np.arange(0.0, duration + bin_s, bin_s)
    counts, _ = np.histogram(trace.arrival_s, bins=edges)
    ax.plot(edges[:-1], counts / bin_s, drawstyle="steps-post", linewidth=0.7)
    ax.set_xlabel("time since first arrival (s)")
    unit = "per second" if bin_s == 1 else f"per second, {bin_s:g} s bins"
    ax.set_ylabel(f"arrivals {unit}")
