"""``fragsim trace hits``: prefix hit rate against offload-tier capacity, in request order.

The trace's requests are replayed one after another against one tier of each
capacity, with the calls vLLM 0.33's offloading connector makes
(:mod:`fragsim.offload.replay`): no time, no GPU cache, as the Mooncake paper's
hit-rate-against-capacity figure is drawn.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING

from fragsim.cli.args import positive_int
from fragsim.errors import FragsimError

if TYPE_CHECKING:
    from fragsim.offload import HitRate

DEFAULT_CAPACITIES = "1e6,3e6,1e7,3e7,1e8"
DESCRIPTION = (
    "Replay a trace in request order against an offload tier of each capacity and print "
    "the prefix hit rate: each request looks its full prompt chunks up from the first "
    "until the first miss, loads the hits, stores the rest and finishes, as vLLM 0.33's "
    "offloading connector calls its CPU manager. Also printed: the most any capacity "
    "gives (every chunk kept) and the cache ratio (chunks seen before anywhere in the "
    "prompt). TRACE needs content hashes (Mooncake's hash_ids, or a session trace from "
    "'fragsim trace sessions')."
)


def capacities(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected numbers like 1e6,3e6, got {part!r}") from None
        if not math.isfinite(value) or value < 1:
            raise argparse.ArgumentTypeError(f"a capacity must be >= 1 token, got {part}")
        out.append(int(value))
    return out


def register(commands: argparse._SubParsersAction) -> None:
    hits = commands.add_parser(
        "hits", help="offload-tier prefix hit rate against capacity (request order)",
        description=DESCRIPTION)
    hits.add_argument("trace", metavar="TRACE",
                      help="trace file with content hashes (Mooncake JSONL with hash_ids)")
    hits.add_argument("--capacity-tokens", type=capacities, default=capacities(DEFAULT_CAPACITIES),
                      metavar="C1,C2,...",
                      help=f"tier capacities in tokens, rounded down to whole chunks "
                           f"(default {DEFAULT_CAPACITIES})")
    hits.add_argument("--policy", choices=("lru", "arc"), default="lru",
                      help="eviction policy (default lru)")
    hits.add_argument("--block-size", type=positive_int, default=512, metavar="TOKENS",
                      help="tokens per offloaded chunk (default 512, one Mooncake hash id)")
    hits.add_argument("--store-threshold", type=positive_int, default=1, metavar="N",
                      help="store a chunk only once it has been offered N times "
                           "(vLLM's store_threshold; default 1)")
    hits.add_argument("--num-requests", type=positive_int, metavar="N", help="first N requests")
    hits.add_argument("--json", action="store_true",
                      help="print a JSON list, one object per capacity, no table")
    hits.add_argument("--plot", metavar="PATH", help="write hit rate against capacity as PNG")
    hits.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from fragsim.cli.trace import load_file

    trace = load_file(args.trace, args.num_requests)
    if trace.block_hashes is None:
        raise FragsimError(
            f"{args.trace}: the trace has no content hashes, so no request can hit another's "
            "blocks; use a trace with hash_ids (e.g. Mooncake's) or 'fragsim trace sessions'")
    if args.plot:
        from pathlib import Path

        parent = Path(args.plot).parent
        if not parent.is_dir():
            raise FragsimError(f"{args.plot}: cannot write the plot: no directory {parent}")
    results = _replay(trace, args)
    if args.plot:
        _plot(results, trace.name, args.plot)
    if args.json:
        print(json.dumps([r.to_dict() for r in results]))
    else:
        _print_table(results, trace.name)
        if args.plot:
            print(f"wrote {args.plot}")
    return 0


def _replay(trace: object, args: argparse.Namespace) -> list[HitRate]:
    from rich.progress import Progress

    from fragsim.offload import hit_rates

    show = not args.json and sys.stderr.isatty()
    with Progress(transient=True, disable=not show) as bar:
        task = bar.add_task("replaying", total=len(args.capacity_tokens))
        return hit_rates(trace, args.capacity_tokens, args.policy, args.block_size,  # type: ignore[arg-type]
                         args.store_threshold, progress=lambda done: bar.update(task, completed=done))


def _print_table(results: list[HitRate], name: str) -> None:
    from rich.console import Console
    from rich.table import Table

    first = results[0]
    table = Table(title=f"{name}: {first.requests:,} requests, {first.block_refs:,} chunk "
                        f"references of {first.block_size} tokens, {first.policy.upper()}")
    for header in ("capacity (tokens)", "chunks", "hit rate", "hit chunks", "evictions",
                   "failed stores"):
        table.add_column(header, justify="right")
    for r in results:
        table.add_row(f"{r.capacity_tokens:,}", f"{r.capacity_tokens // r.block_size:,}",
                      f"{r.hit_rate:.1%}", f"{r.hit_blocks:,}", f"{r.evictions:,}",
                      f"{r.failed_stores:,}")
    console = Console(highlight=False)
    console.print(table)
    console.print(f"most any capacity gives (every chunk kept): {first.max_hit_rate:.1%}")
    console.print(f"cache ratio (chunk seen before, anywhere in the prompt): {first.cache_ratio:.1%}")


def _plot(results: list[HitRate], name: str, path: str) -> None:
    from matplotlib.figure import Figure

    from fragsim.files import write_atomically

    first = results[0]
    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.add_subplot()
    x = [r.capacity_tokens for r in results]
    ax.plot(x, [100 * r.hit_rate for r in results], marker="o", label=f"{first.policy.upper()} hit rate")
    ax.axhline(100 * first.max_hit_rate, color="tab:green", linestyle="--",
               label=f"every chunk kept {first.max_hit_rate:.1%}")
    ax.axhline(100 * first.cache_ratio, color="tab:gray", linestyle=":",
               label=f"cache ratio {first.cache_ratio:.1%}")
    if len(set(x)) > 1:
        ax.set_xscale("log")
    ax.set_xlabel("tier capacity (tokens)")
    ax.set_ylabel("prefix hit rate (% of chunk references)")
    ax.set_ylim(0, max(5.0, 100 * max(first.max_hit_rate, first.cache_ratio) * 1.1))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(f"{name}: {first.block_size}-token chunks, request order")
    write_atomically(path, lambda out: fig.savefig(out, format="png", dpi=120), "the plot")
