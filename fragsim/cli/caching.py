"""``fragsim caching``: a serving workload through the PyTorch caching-allocator
model, and the OOMs that happen with enough free memory (seed 004 §3.2)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from fragsim.errors import FragsimError

HELP = "run a serving workload through the PyTorch caching-allocator model; fragmentation OOMs"
MiB = 1 << 20
PROGRESS_AFTER_S = 2.0  # show a progress bar only for runs that take longer than this


# fragsim.caching.workloads.WORKLOADS, named here so that --help need not import numpy
WORKLOAD_NAMES = ("hf-serving", "rag-longtail")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "caching",
        help=HELP,
        description=(
            HELP + ". Fragmentation ratio = 1 - largest allocatable block / total free "
            "memory (cached free blocks + device memory not reserved); above 20% is the "
            "seed's danger line. rag-longtail: seed 004's RAG service, Llama-2-13B on "
            "31.5 GiB, 200-300-token prompts and 2% of ~1,500; hf-serving: Llama-2-7B on "
            "23.5 GiB, KV for max_seq_len per request."
        ),
    )
    p.add_argument("--workload", choices=WORKLOAD_NAMES, default="rag-longtail",
                   help="workload preset (default rag-longtail)")
    p.add_argument("--hours", type=float, metavar="H", help="simulated hours (preset default 2)")
    p.add_argument("--device-gb", type=float, metavar="G",
                   help="GiB the allocator may take from the device (preset default)")
    p.add_argument("--model", help="model preset (see fragsim capacity --list)")
    p.add_argument("--arrival-rate", type=float, metavar="R", help="requests per second")
    p.add_argument("--max-split-size-mb", type=int, metavar="M",
                   help="PYTORCH_CUDA_ALLOC_CONF max_split_size_mb (>= 20)")
    p.add_argument("--expandable-segments", action="store_true",
                   help="PYTORCH_CUDA_ALLOC_CONF expandable_segments:True")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of fragmentation and free memory over time")
    p.add_argument("--out", metavar="DIR",
                   help="write config.json, summary.json, timeseries.csv, ooms.csv and a figure here")
    p.set_defaults(func=main)


def _plain(value: Any) -> Any:
    """numpy scalars to Python ones, for json."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value.item() if hasattr(value, "item") else value


class _LazyProgress:
    """A rich progress bar on stderr that appears only once a run has taken a while."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.bar: Any = None
        self.task: Any = None

    def __call__(self, fraction: float) -> None:
        if self.bar is None:
            if time.monotonic() - self.started < PROGRESS_AFTER_S:
                return
            from rich.console import Console
            from rich.progress import Progress

            self.bar = Progress(console=Console(file=sys.stderr), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("simulating", total=1.0)
        self.bar.update(self.task, completed=fraction)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def plot_run(result: Any, path: str | Path) -> None:
    """Fragmentation ratio, free memory and reserved memory over simulated time,
    OOMs marked; written atomically."""
    import numpy as np
    from matplotlib.figure import Figure

    from fragsim.caching.workloads import DANGER_RATIO
    from fragsim.files import write_atomically

    ts, ooms, s = result.timeseries, result.ooms, result.summary
    hours = ts["time_s"].to_numpy() / 3600
    fig = Figure(figsize=(12, 9), layout="constrained")
    axes = fig.subplots(3, 1, sharex=True)
    ax = axes[0]
    ax.plot(hours, ts["fragmentation_ratio"], drawstyle="steps-post", lw=0.6, label="device-wide")
    ax.plot(hours, ts["reserved_fragmentation_ratio"], drawstyle="steps-post", lw=0.6, alpha=0.6,
            label="inside reserved segments")
    ax.axhline(DANGER_RATIO, color="tab:red", ls="--", lw=1, label=f"danger line {DANGER_RATIO:.0%}")
    ax.set_ylabel("1 - largest / free")
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left", fontsize=8)
    ax = axes[1]
    for col, label in (("total_free_bytes", "total free (cached + unreserved)"),
                       ("largest_allocatable", "largest allocatable block"),
                       ("largest_free_block", "largest cached free block")):
        ax.plot(hours, ts[col] / MiB, drawstyle="steps-post", lw=0.6, label=label)
    if len(ooms):
        paradox = ooms["enough_total_free"].to_numpy()
        oh = ooms["time_s"].to_numpy() / 3600
        ax.vlines(oh, ooms["size"].to_numpy() / MiB, ooms["total_free_bytes"].to_numpy() / MiB,
                  color="tab:red", lw=0.8, alpha=0.6, label="OOM: request .. total free at that moment")
        ax.scatter(oh[paradox], ooms["size"].to_numpy()[paradox] / MiB, marker="x", color="tab:red",
                   zorder=3, label="OOM request, total free >= request")
        ax.scatter(oh[~paradox], ooms["size"].to_numpy()[~paradox] / MiB, marker="o",
                   facecolors="none", color="black", zorder=3, label="OOM request, out of memory")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylabel("MiB")
    ax.legend(loc="lower right", fontsize=8)
    ax = axes[2]
    gib = float(1 << 30)
    ax.plot(hours, ts["reserved_bytes"] / gib, drawstyle="steps-post", lw=0.6, label="reserved")
    ax.plot(hours, ts["allocated_bytes"] / gib, drawstyle="steps-post", lw=0.6, label="allocated")
    ax.axhline(result.workload.device_bytes / gib, color="black", lw=0.8, ls=":", label="device")
    lo = float(np.min(ts["allocated_bytes"])) / gib
    ax.set_ylim(max(0.0, lo - 1), result.workload.device_bytes / gib * 1.01)
    ax.set_ylabel("GiB")
    ax.set_xlabel("simulated hours")
    ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(
        f"{s['workload']}: {s['model']} on {s['device_bytes'] / gib:g} GiB, seed {s['seed']}: "
        f"{s['num_ooms']} OOMs, {s['num_ooms_enough_total_free']} with enough total free memory"
    )
    write_atomically(path, lambda out: fig.savefig(out, format="png", dpi=110))


def _write_outputs(result: Any, out: Path) -> None:
    from fragsim import __version__
    from fragsim.files import write_atomically

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FragsimError(f"{out}: cannot create the output folder: {exc.strerror or exc}") from None
    config = {**dataclasses.asdict(result.workload), "fragsim_version": __version__}
    write_atomically(out / "config.json", lambda f: f.write(json.dumps(_plain(config), indent=2).encode()))
    write_atomically(out / "summary.json",
                     lambda f: f.write(json.dumps(_plain(result.summary), indent=2).encode()))
    write_atomically(out / "timeseries.csv", lambda f: result.timeseries.to_csv(f, index=False))
    write_atomically(out / "ooms.csv", lambda f: result.ooms.to_csv(f, index=False))
    plot_run(result, out / "fragmentation.png")


def _print(result: Any) -> None:
    s, w = result.summary, result.workload
    print(f"{s['workload']}: {s['model']} on {w.device_gb:g} GiB, {s['simulated_s'] / 3600:.2f} h simulated, "
          f"seed {s['seed']}; max_split_size_mb={w.max_split_size_mb}, "
          f"expandable_segments={w.expandable_segments}")
    print(f"requests: {s['num_arrived']:,} arrived, {s['num_completed']:,} completed, "
          f"{s['num_failed']:,} failed (OOM)")
    print(f"OOMs: {s['num_ooms']:,}, of which {s['num_ooms_enough_total_free']:,} with total free "
          "memory >= the request (enough memory, no block large enough)")
    first = s["first_enough_free_oom"]
    if first:
        holes = first.get("free_blocks_by_size")
        hole_text = f"; {first['num_free_blocks']} free blocks ({', '.join(f'{k}: {v}' for k, v in holes.items())})" if holes else ""
        print(f"first such OOM at {first['time_s']:,.1f} s ({first['tag']}): needed "
              f"{first['size'] / MiB:,.1f} MiB with {first['total_free_bytes'] / MiB:,.1f} MiB free, "
              f"largest free block {first['largest_free_block'] / MiB:,.1f} MiB, device unreserved "
              f"{first['device_free_bytes'] / MiB:,.1f} MiB{hole_text}")
    most = s["most_free_oom"]
    if most and most != {k: first[k] for k in most}:
        print(f"most free memory at an OOM: {most['time_s']:,.1f} s ({most['tag']}): needed "
              f"{most['size'] / MiB:,.1f} MiB with {most['total_free_bytes'] / MiB:,.1f} MiB free, "
              f"largest free block {most['largest_free_block'] / MiB:,.1f} MiB")
    print(f"fragmentation ratio: peak {s['peak_fragmentation_ratio']:.1%}, time-weighted mean "
          f"{s['mean_fragmentation_ratio']:.1%}, above {s['danger_ratio']:.0%} for "
          f"{s['time_above_danger_s']:,.0f} s ({s['fraction_time_above_danger']:.1%} of the time)")
    print(f"reserved: peak {s['peak_reserved_bytes'] / MiB:,.0f} MiB, final "
          f"{s['final_reserved_bytes'] / MiB:,.0f} MiB in {s['final_num_segments']} segments; "
          f"allocated final {s['final_allocated_bytes'] / MiB:,.0f} MiB")


def main(args: argparse.Namespace) -> int:
    from fragsim.caching.workloads import run_workload

    params: dict[str, Any] = {"seed": args.seed, "expandable_segments": args.expandable_segments}
    for name in ("hours", "device_gb", "model", "arrival_rate", "max_split_size_mb"):
        if getattr(args, name) is not None:
            params[name] = getattr(args, name)
    progress = _LazyProgress()
    try:
        result = run_workload(args.workload, progress=progress, **params)
    except ValueError as exc:
        raise FragsimError(f"invalid workload option: {exc}") from None
    finally:
        progress.close()
    if args.plot:
        plot_run(result, args.plot)
    if args.out:
        _write_outputs(result, Path(args.out))
    if args.json:
        print(json.dumps(_plain(result.summary)))
    else:
        _print(result)
        for label, path in (("figure", args.plot), ("outputs", args.out)):
            if path:
                print(f"{label} written to {path}")
    return 0
