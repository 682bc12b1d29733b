"""``fragsim sweep``: run an experiment file's whole grid, resumably, in parallel."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from fragsim.cli.args import positive_float, positive_int

DESCRIPTION = """\
Run every point of an experiment file (experiments/*.toml): the cartesian
product of its [sweep] lists (per [[cases]] variant), each point against each
of its allocators. Each run is journaled as one small file keyed by a hash of
its parameters, so an interrupted sweep resumes where it stopped and a rerun
only draws the figures again. Writes OUT/<study>/results.parquet (one row per
point and allocator: the parameters, then the `fragsim run --json` keys) and
the study's figures."""

EPILOG = """\
examples:
  fragsim sweep experiments/vllm_fig2.toml
  fragsim sweep experiments/rate_sweep.toml --scale 0.1 --traces-dir ../shared/traces
  fragsim sweep experiments/vllm_fig13.toml --executor ray --address auto
  fragsim sweep experiments/block_size.toml --dry-run
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("sweep", help="run an experiment file's grid; table + figures",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", metavar="FILE", help="experiment file (TOML)")
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="local: a process pool on this machine; ray: Ray tasks (default: %(default)s)")
    p.add_argument("--address", help="with --executor ray: an existing cluster (e.g. auto, "
                                     "ray://HOST:10001); default: start a local instance")
    p.add_argument("--workers", type=positive_int,
                   help="parallel runs (default: the CPUs available; 1 runs in this process)")
    p.add_argument("--out", default="results", help="results root; writes OUT/<study>/ (default: %(default)s)")
    p.add_argument("--scale", type=positive_float, default=1.0,
                   help="fraction of each point's requests, for quick runs (default 1)")
    p.add_argument("--min-requests", type=positive_int,
                   help="--scale keeps at least this many requests per point (default: the study's)")
    p.add_argument("--traces-dir", help="folder for ${SHARED_TRACES} in trace paths "
                                        "(default: $FRAGSIM_SHARED_TRACES)")
    p.add_argument("--force", action="store_true", help="rerun points that already have results")
    p.add_argument("--dry-run", action="store_true", help="list the runs and exit")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fragsim.studies import expand, load_study, run_study

    study = load_study(args.file)
    if args.address and args.executor != "ray":
        print("fragsim: --address applies to --executor ray only", file=sys.stderr)
        return 2
    if args.dry_run:
        return _dry_run(study, expand(study, args.scale, args.traces_dir, args.min_requests))
    err = Console(stderr=True)
    start = time.perf_counter()
    with Progress(TextColumn(f"{study.name:>18}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, transient=True,
                  disable=not err.is_terminal) as progress:
        task = progress.add_task(study.name, total=None)

        def report(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        result = run_study(study, scale=args.scale, out=args.out, executor=args.executor,
                           workers=args.workers, address=args.address, force=args.force,
                           traces_dir=args.traces_dir, min_requests=args.min_requests,
                           progress=report)
    seconds = time.perf_counter() - start
    err.print(f"{study.name}: {len(result.table)} runs ({len(result.ran)} ran, "
              f"{len(result.cached)} cached) in {seconds:.1f} s")
    print(result.folder)
    for path in result.figures:
        print(path)
    return 0


def _dry_run(study: Any, runs: list[Any]) -> int:
    axes = [a.replace("workload_", "workload.") for a in study.axes]
    print(f"{study.name}: {len(runs)} runs")
    for run in runs:
        values = ", ".join(f"{a}={run.columns.get(a.replace('.', '_'))}" for a in axes)
        print(f"  {run.run_id}  {run.case or '-'}  {values}  n={run.spec.num_requests}")
    return 0
