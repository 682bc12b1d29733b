"""``fragsim trace stats``: what a trace holds, before any simulation is run on it.

TRACE is a bundled trace (``azure-conv``, ``azure-code``), a synthetic workload
(``sharegpt-paper``, ``alpaca-paper``) or a path to a trace file of any format
:func:`fragsim.traces.load_trace` reads. ``--rate`` gives the trace generated
arrivals (Poisson, or Gamma with ``--cv``), as ``fragsim run`` would replay a
length-only file; without it, length-only traces report no rate or burstiness.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import TYPE_CHECKING

from fragsim.errors import FragsimError

if TYPE_CHECKING:
    from fragsim.traces import Trace
    from fragsim.traces.stats import Stats

DEFAULT_WORKLOAD_REQUESTS = 1000
NO_TIME = "(length-only trace: --rate R gives it arrivals)"
STATS_DESCRIPTION = (
    "Print a trace's size, time span, rate, inter-arrival CV and token-length "
    "percentiles. TRACE is a bundled trace, a synthetic workload or a trace file. "
    "--rate replaces the arrivals with generated ones (as a run would for a "
    "length-only file); without it, length-only traces report no rate."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "trace", help="inspect request traces", description="Inspect request traces."
    )
    parser.set_defaults(func=lambda _args: parser.print_help() or 0)
    commands = parser.add_subparsers(dest="trace_command", metavar="SUBCOMMAND")
    stats = commands.add_parser(
        "stats",
        help="rows, rate, burstiness and length percentiles of a trace",
        description=STATS_DESCRIPTION,
    )
    stats.add_argument(
        "trace",
        metavar="TRACE",
        help="bundled trace (azure-conv, azure-code), workload (sharegpt-paper, "
        "alpaca-paper) or path to a trace file",
    )
    stats.add_argument("--json", action="store_true", help="print one JSON object, no table")
    stats.add_argument("--plot", metavar="PATH", help="write length and arrival histograms as PNG")
    arrivals = stats.add_argument_group("generated arrivals (replace the trace's own)")
    arrivals.add_argument("--rate", type=float, metavar="R", help="requests per second")
    arrivals.add_argument(
        "--arrival", choices=("poisson", "gamma"), help="arrival process (default poisson)"
    )
    arrivals.add_argument(
        "--cv", type=float, metavar="X", help="inter-arrival coefficient of variation (gamma)"
    )
    arrivals.add_argument("--seed", type=int, metavar="S", help="random seed (default 0)")
    stats.add_argument(
        "--num-requests",
        type=int,
        metavar="N",
        help=f"first N rows of a file; size of a workload (default {DEFAULT_WORKLOAD_REQUESTS})",
    )
    stats.set_defaults(func=main)
    from fragsim.cli import trace_hits, trace_sessions

    trace_hits.register(commands)
    trace_sessions.register(commands)


def main(args: argparse.Namespace) -> int:
    from fragsim.traces import trace_stats

    trace = _resolve(args)
    stats = trace_stats(trace)
    if args.plot:  # before printing, so a failed plot leaves stdout empty
        from fragsim.traces.plot import plot_trace

        plot_trace(trace, args.plot)
    if args.json:
        print(json.dumps(stats, allow_nan=False))
    else:
        _print_table(stats)
        if args.plot:
            print(f"wrote {args.plot}")
    return 0


def load_file(path: str, num_requests: int | None) -> Trace:
    """A trace file, its loader's warnings printed as ours, cut to its first rows."""
    from fragsim.traces import load_trace, slice_trace

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace = load_trace(path)
    for warning in caught:
        print(f"fragsim: warning: {warning.message}", file=sys.stderr)
    if num_requests is not None:
        trace = slice_trace(trace, num_requests=num_requests)
    return trace


def _resolve(args: argparse.Namespace) -> Trace:
    """The trace TRACE names, with generated arrivals when ``--rate`` asks for them."""
    from fragsim.traces import WORKLOADS, assign_arrivals, make_workload

    if args.rate is None and (args.arrival is not None or args.cv is not None):
        raise FragsimError("--arrival and --cv describe generated arrivals and need --rate")
    arrival = "poisson" if args.arrival is None else args.arrival
    cv = 1.0 if args.cv is None else args.cv
    seed = 0 if args.seed is None else args.seed
    if args.num_requests is not None and args.num_requests < 1:
        raise FragsimError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.trace in WORKLOADS:
        num_requests = args.num_requests or DEFAULT_WORKLOAD_REQUESTS
        return make_workload(args.trace, num_requests, args.rate, seed, arrival, cv)
    if args.seed is not None and args.rate is None:
        raise FragsimError("--seed seeds generated arrivals (or a workload) and needs --rate here")
    trace = load_file(args.trace, args.num_requests)
    if args.rate is not None:
        trace = assign_arrivals(trace, args.rate, arrival, cv, seed)
    return trace


def _print_table(stats: Stats) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False)
    summary = Table(show_header=False)
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    summary.add_row("requests", _number(stats["num_requests"]))
    summary.add_row("time span", _number(stats["duration_s"], 1, " s"))
    summary.add_row("rate", _number(stats["rate_req_per_s"], 2, " req/s"))
    summary.add_row("inter-arrival CV", _number(stats["interarrival_cv"], 2))
    if stats["num_block_refs"] is not None:
        summary.add_row("block refs", _number(stats["num_block_refs"]))
        summary.add_row("distinct blocks", _number(stats["num_distinct_blocks"]))
        summary.add_row("block size", _number(stats["block_hash_size"], 0, " tokens"))
    lengths = Table("tokens", "input", "output")
    for figure in ("mean", "min", "p50", "p90", "p99", "max"):
        lengths.add_row(
            figure,
            _number(stats[f"prompt_len_{figure}"], 1),
            _number(stats[f"output_len_{figure}"], 1),
        )
    lengths.columns[1].justify = lengths.columns[2].justify = "right"
    console.print(f"[bold]{escape(stats['name'])}[/bold]  {escape(stats['source'])}")
    console.print(summary)
    if not stats["has_timestamps"]:
        console.print(NO_TIME)
    console.print(lengths)


def _number(value: float | None, decimals: int = 0, unit: str = "") -> str:
    """Thousands separators; whole numbers without decimals, others with ``decimals``."""
    if value is None:
        return "-"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.{decimals}f}{unit}"
    return f"{int(value):,}{unit}"
