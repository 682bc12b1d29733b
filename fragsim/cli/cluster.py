"""``fragsim cluster CONFIG.toml``: serve a trace on pools of instances described in TOML
(:mod:`fragsim.cluster.config`), and print where the memory went, per pool and in all."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

DESCRIPTION = (
    "Serve a trace on a cluster described in a TOML file: pools of instances, each with "
    "its model, GPU, tp, allocator, cost model, count and role (mixed, prefill or decode), "
    "behind one router, with a KV link from the prefill pools to the decode pools. Prints "
    "the memory split, queue, goodput and latency for the cluster, each pool and each "
    "instance, and the KV transfers. The file's format: `fragsim cluster --example`.")


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = commands.add_parser("cluster", help="serve a trace on heterogeneous pools (TOML)",
                            description=DESCRIPTION)
    p.add_argument("config", nargs="?", metavar="CONFIG.toml", help="the cluster file")
    p.add_argument("--example", action="store_true", help="print a commented cluster file and exit")
    p.add_argument("--traces-dir", default=None, metavar="DIR",
                   help="where ${SHARED_TRACES} in the trace field points (default: "
                        "$FRAGSIM_SHARED_TRACES)")
    p.add_argument("--out", default="results", help="results folder (default: %(default)s)")
    p.add_argument("--no-save", action="store_true", help="print only; write no results folder")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--plot", action="store_true",
                   help="also draw the split, memory over time per instance and transfers in flight")
    p.add_argument("--check", action="store_true",
                   help="check every instance's memory split at every step (slow; for debugging)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fragsim import __version__
    from fragsim.cli.run import cluster_note, table_rows, tier_notes
    from fragsim.cluster import run_members
    from fragsim.cluster.config import __doc__ as example_doc
    from fragsim.cluster.config import load_cluster
    from fragsim.errors import FragsimError
    from fragsim.report import comparison_table, dumps, write_results
    from fragsim.simulate import load_workload

    if args.example:
        print(_example(example_doc or ""))
        return 0
    if args.config is None:
        raise FragsimError("a cluster file is needed: fragsim cluster CONFIG.toml (see --example)")
    config = load_cluster(args.config)
    workload = _expand(config.workload, args.traces_dir, Path(args.config).name)
    trace = load_workload(workload)
    err = Console(stderr=True)
    with Progress(TextColumn("{task.description:>12}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("cluster", total=len(trace))
        result = run_members(trace, config.members, config.settings, config.label,
                             progress=lambda done: bar.update(task, completed=done), check=args.check)
    folder = None
    if not args.no_save:
        record = {"fragsim_version": __version__, "cluster_file": str(args.config), **config.raw}
        folder = write_results(Path(args.out), record, [result], plot=args.plot)
    if args.json:
        sys.stdout.write(dumps(result.summary) + "\n")
        if folder is not None:
            err.print(f"results: {folder}")
        return 0
    out = Console() if Console().is_terminal else Console(width=220)
    s = result.summary
    pools = ", ".join(f"{p['pool']} ×{p['num_instances']} ({p['role']})" for p in s.get("pools", [])) \
        or f"{s['num_instances']} instances"
    out.print(comparison_table(table_rows([result]), f"{trace.name}: {len(trace):,} requests on {pools}"))
    notes = ["memory split: time-weighted mean over the run, % of each KV pool"]
    for part in s["instances"]:
        notes += tier_notes({**part, "allocator": f"#{part['instance']} {part['pool']}"})
    notes.append(cluster_note(s))
    for line in notes:
        out.print(line, soft_wrap=True)
    if folder is not None:
        out.print(f"results: {folder}")
    return 0


def _expand(workload: Any, traces_dir: str | None, label: str) -> Any:
    """${SHARED_TRACES} in the trace field, as studies expand it."""
    import dataclasses

    from fragsim.studies.grid import expand_trace_path

    return dataclasses.replace(workload, trace=expand_trace_path(workload.trace, traces_dir, label))


def _example(doc: str) -> str:
    """The cluster file in the module docstring, as a file."""
    body = doc.split("::", 1)[1].split("Every error", 1)[0]
    return "\n".join(line[4:] for line in body.strip("\n").splitlines()).rstrip() + "\n"
