"""A cluster's figures: KV transfers in flight over time (``--plot``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def in_flight(starts: np.ndarray, ends: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A step function: at each time, the sum of ``weights`` of intervals [start, end)
    that hold it."""
    times = np.concatenate((starts, ends))
    deltas = np.concatenate((weights, -weights))
    order = np.argsort(times, kind="stable")
    return times[order], np.cumsum(deltas[order])


def plot_transfers(results: Sequence[Any], path: Path) -> None:
    """Per cluster: GB reserved on decode instances for transfers not landed (from the
    reservation to the landing), and GB moving on the link (ports held)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fragsim.report import _savefig

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.2 * len(results) + 0.6), squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=True):
        t = r.transfers
        gb = t["bytes"].to_numpy(dtype=np.float64) / 1e9
        for start, label, color in (("reserved_s", "reserved, not landed", "#b7791f"),
                                    ("start_s", "on the link", "#2b6cb0")):
            x, y = in_flight(t[start].to_numpy(), t["end_s"].to_numpy(), gb)
            ax.step(x, y, where="post", label=label, color=color, linewidth=0.8)
        ax.set_ylabel(f"{r.allocator}\nGB in flight", fontsize=8)
        ax.set_xlabel("simulated time (s)")
        ax.legend(loc="upper right", frameon=False, fontsize=8)
    fig.suptitle("KV transfers from prefill to decode instances")
    _savefig(fig, path)
    plt.close(fig)
