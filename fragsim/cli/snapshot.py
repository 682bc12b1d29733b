"""``fragsim snapshot``: where a PyTorch memory snapshot's reserved bytes went."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

HELP = "read a torch.cuda memory snapshot (pickle): internal/external fragmentation, segment map"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "snapshot",
        help=HELP,
        description=(
            HELP + ". Accepts the dict torch.cuda.memory._dump_snapshot() writes and the "
            "plain segment list of torch.cuda.memory_snapshot(). Fragmentation ratio = "
            "1 - largest free block / free bytes inside the reserved segments. The file is "
            "unpickled with a loader that builds only builtin containers, never code."
        ),
    )
    p.add_argument("file", metavar="FILE.pickle", help="snapshot file")
    p.add_argument("--device", type=int, metavar="N", help="only segments of device N")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--plot", metavar="PATH", help="write a PNG map of the segments")
    p.add_argument("--top", type=int, default=20, metavar="K",
                   help="segments listed in the table, most free bytes first (default 20; 0: all)")
    p.set_defaults(func=main)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.2f}"


def _print(summary: Any, path: str, top: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 120)
    t = Table(title=f"{path}: {summary.num_segments} segments, {summary.num_blocks} blocks")
    t.add_column("")
    t.add_column("bytes", justify="right")
    t.add_column("MiB", justify="right")
    t.add_column("of reserved", justify="right")
    reserved = summary.reserved_bytes or 1
    for label, n in (
        ("reserved", summary.reserved_bytes),
        ("allocated (active_allocated)", summary.allocated_bytes),
        ("requested", summary.requested_bytes),
        ("internal = allocated - requested", summary.internal_bytes),
        ("pending free (another stream)", summary.pending_free_bytes),
        ("external = inactive", summary.external_bytes),
        ("  in segments still in use", summary.inactive_split_bytes),
        ("  in whole-free segments", summary.releasable_bytes),
        ("largest free block", summary.largest_free_bytes),
    ):
        t.add_row(label, f"{n:,}", _mib(n), f"{n / reserved:.1%}")
    console.print(t)
    console.print(
        f"fragmentation ratio (1 - largest free / free): {summary.fragmentation_ratio:.1%}"
        + ("  [above the 20% danger line]" if summary.fragmentation_ratio > 0.2 else ""),
        highlight=False,
    )
    holes = ", ".join(f"{k}: {v}" for k, v in summary.free_blocks_by_size.items())
    console.print(f"free blocks by size: {holes}", highlight=False)
    if not summary.requested_known:
        console.print("note: some blocks lack requested_size (older PyTorch); internal counted as 0",
                      highlight=False)
    if summary.num_oom_traces:
        console.print(f"note: the trace records {summary.num_oom_traces} OOM event(s)", highlight=False)
    segs = sorted(summary.segments, key=lambda s: (-s.inactive_bytes, s.address))
    if top:
        segs = segs[:top]
    st = Table(title=f"segments ({len(segs)} of {summary.num_segments}, most free first)")
    for col in ("#", "address", "pool", "MiB", "allocated", "free", "largest free", "blocks"):
        st.add_column(col, justify="left" if col in ("address", "pool") else "right")
    for s in segs:
        st.add_row(str(s.index), f"{s.address:#x}", s.segment_type + (" exp" if s.is_expandable else ""),
                   _mib(s.total_size), _mib(s.allocated_bytes), _mib(s.inactive_bytes),
                   _mib(s.largest_free_bytes), str(s.num_blocks))
    console.print(st)


def main(args: argparse.Namespace) -> int:
    from fragsim.caching.snapshot import analyze, load_snapshot, plot_segment_map

    if args.top < 0:
        from fragsim.errors import FragsimError

        raise FragsimError(f"--top must be >= 0, got {args.top}")
    data = load_snapshot(args.file)
    summary = analyze(data, device=args.device, source=f"{args.file}: ")
    if args.plot:
        plot_segment_map(summary, args.plot, title=str(args.file))
    if args.json:
        print(json.dumps(summary.to_dict()))
    else:
        _print(summary, args.file, args.top)
        if args.plot:
            print(f"segment map written to {args.plot}")
    return 0
