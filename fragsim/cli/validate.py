"""``fragsim validate``: the simulation checked against real memory."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from fragsim.files import write_atomically

DESCRIPTION = """\
Replay a slice of a trace with every allocation decision executed on a real KV
pool (torch tensors on CUDA, or on the CPU through Triton's interpreter), write
every token's K/V, run decode attention with the Triton kernels each step, and
compare the memory split measured on the device with the simulated one. Exits
non-zero on any mismatch.

Hybrid KV managers (paged-uniform, vllm-hybrid, jenga, static-partition) run on a
miniature of --model: its first layers, with every layer kind the model has, a few
small heads, windows and chunks times --scale, small states. The pool is laid out
as the manager lays it (vLLM's per-layer buffers shared by one layer of each group,
Jenga's large pages carved into small ones, a pool per kind), sliding and chunked
rows read only their window through Triton, states are checked on every read, and
the byte split per row and category measured on the device must equal the
simulated one at every step:

  fragsim validate --device cpu --model gpt-oss-20b --allocator vllm-hybrid,jenga \
      --trace azure-conv --pool-bytes 60000"""


#: the dense allocators validated when --allocator is not given
DENSE_DEFAULT = ("ft-static", "orca-max", "orca-pow2", "orca-oracle", "vllm", "contiguous")


def register(subparsers: Any) -> None:
    from fragsim.cli.args import positive_float, positive_int
    from fragsim.cli.run_options import HYBRID_DEFAULT
    from gpu_backend import POOL_REQUESTS

    p = subparsers.add_parser("validate", help="check the simulation against real device memory",
                              description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the pool lives (default: cuda if available, else cpu)")
    p.add_argument("--trace", default="azure-conv", help="trace or workload (default: %(default)s)")
    p.add_argument("--rate", type=positive_float, help="re-time arrivals (needed for workloads)")
    p.add_argument("--allocator", default=None,
                   help=f"comma list (default: {','.join(DENSE_DEFAULT)}; for a model with layers "
                        f"other than full attention the hybrid KV managers {','.join(HYBRID_DEFAULT)})")
    p.add_argument("--num-requests", type=positive_int, default=None,
                   help="requests to replay (default: 300 on cuda, 60 on cpu)")
    p.add_argument("--offset", type=int, default=0, help="skip this many requests first")
    p.add_argument("--model", default="llama-2-13b",
                   help="model: the hybrid KV managers run a miniature of it; its step times "
                        "time the run (default: %(default)s)")
    p.add_argument("--gpu", default="a100-40gb", help="GPU whose step times time the run "
                                                      "(default: %(default)s)")
    p.add_argument("--kv-slots", type=positive_int,
                   help=f"dense pool size in slots (default: {POOL_REQUESTS} requests of the "
                        "scaled --max-seq-len)")
    p.add_argument("--max-seq-len", type=positive_int, default=2048)
    p.add_argument("--scale", type=positive_float, default=None,
                   help="multiply lengths, max-seq-len and pool by this (default: 1 on cuda, 0.05 on cpu)")
    p.add_argument("--layers", type=positive_int, default=None,
                   help="layers in the pool (default 2; hybrid: the model's first N layers, default enough for every kind)")
    p.add_argument("--q-heads", type=positive_int, default=None, help="query heads (default 40 cuda / 4 cpu)")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="KV heads (default 40 cuda / 2 cpu)")
    p.add_argument("--head-dim", type=positive_int, default=None, help="head dim (default 128 cuda / 16 cpu)")
    p.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    h = p.add_argument_group("hybrid KV managers (--allocator vllm-hybrid, jenga, static-partition, "
                             "paged-uniform)")
    h.add_argument("--pool-bytes", type=positive_int, default=None,
                   help=f"the miniature's pool in bytes (default: the KV of {POOL_REQUESTS} requests "
                        "of the scaled --max-seq-len and a state per state layer for each "
                        "sequence that may run; sized for the miniature, so a model too large "
                        "for any GPU validates)")
    h.add_argument("--q-per-kv", type=positive_int, default=2,
                   help="query heads per KV head in the miniature (default %(default)s)")
    g = p.add_argument_group("block sharing (paged allocators: --allocator vllm)")
    g.add_argument("--parallel-samples", type=positive_int, default=1, metavar="N",
                   help="N samples per prompt over shared prompt blocks (copy-on-write on the device)")
    g.add_argument("--beam-width", type=positive_int, default=1, metavar="W", help="beam search of width W")
    g.add_argument("--prefix-caching", action="store_true", help="reuse cached prompt blocks across requests")
    g.add_argument("--system-prompt-len", type=int, default=0, metavar="S",
                   help="one shared S-token system prompt before every request (before --scale)")
    p.add_argument("--attention-every", type=positive_int, default=None,
                   help="run the attention check every N steps (default 1 cuda / 5 cpu)")
    p.add_argument("--out", default="results", help="results folder (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="one JSON object per allocator on stdout")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    device = args.device
    if device is None or device == "cpu":
        # The interpreter must be on before triton is first imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from fragsim.cli.run import parse_allocators
    from fragsim.errors import FragsimError
    from fragsim.simulate import RunSpec
    from gpu_backend.validate import ModelShape, run_validation

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise FragsimError("--device cuda: no CUDA device is available (use --device cpu)")
    cuda = device == "cuda"
    if args.allocator is None:
        from fragsim.catalog import get_model
        from fragsim.cli.run_options import HYBRID_DEFAULT

        allocators = list(HYBRID_DEFAULT if get_model(args.model).is_hybrid else DENSE_DEFAULT)
    else:
        allocators = parse_allocators(args.allocator)
    try:
        shape = ModelShape(num_layers=args.layers or 2, num_q_heads=args.q_heads or (40 if cuda else 4),
                           num_kv_heads=args.kv_heads or (40 if cuda else 2),
                           head_dim=args.head_dim or (128 if cuda else 16), dtype=args.dtype)
    except ValueError as exc:
        raise FragsimError(str(exc)) from None
    num_requests = args.num_requests or (300 if cuda else 60)
    scale = args.scale if args.scale is not None else (1.0 if cuda else 0.05)
    if scale > 1:
        raise FragsimError(f"--scale must be in (0, 1], got {scale}")
    spec = RunSpec(trace=args.trace, rate=args.rate, model=args.model, gpu=args.gpu,
                   kv_slots=args.kv_slots, max_seq_len=args.max_seq_len,
                   num_requests=num_requests + args.offset, num_samples=args.parallel_samples,
                   beam_width=args.beam_width, prefix_caching=args.prefix_caching,
                   system_prompt_len=args.system_prompt_len)
    from fragsim.simulate import is_hybrid_manager

    hybrid = [a for a in allocators if is_hybrid_manager(a)]
    if hybrid and len(hybrid) != len(allocators):
        raise FragsimError("--allocator: validate hybrid KV managers "
                           f"({', '.join(hybrid)}) apart from the dense allocators")
    if hybrid:
        return _main_hybrid(args, spec, allocators, device, scale)
    every = args.attention_every or (1 if cuda else 5)
    return _run_all(args, spec, allocators, _print, lambda name: run_validation(
        spec, name, device=device, shape=shape, scale=scale, attention_every=every, offset=args.offset))


def _run_all(args: argparse.Namespace, spec: Any, allocators: list[str], show: Any, run: Any) -> int:
    """``run(name)`` for each allocator, each report shown (or a JSON line) as it comes."""
    from fragsim.report import clean_json

    reports = []
    for name in allocators:
        report = run(name)
        reports.append(report)
        if args.json:
            sys.stdout.write(json.dumps(clean_json(report.to_dict())) + "\n")
            sys.stdout.flush()
        else:
            show(report)
    return _finish(args, spec, allocators, reports)


def _finish(args: argparse.Namespace, spec: Any, allocators: list[str], reports: list[Any]) -> int:
    from fragsim.report import clean_json, run_id

    out = Path(args.out) / f"validate-{run_id({'allocators': allocators, **spec.to_dict()})}"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(clean_json([r.to_dict() for r in reports]), indent=2) + "\n"
    write_atomically(out.with_suffix(".json"), lambda f: f.write(text.encode()))
    failed = [r.allocator for r in reports if not r.ok]
    print(f"report: {out.with_suffix('.json')}", file=sys.stderr)
    if failed:
        print(f"fragsim: validation FAILED for {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _main_hybrid(args: argparse.Namespace, spec: Any, allocators: list[str], device: str,
                 scale: float) -> int:
    from fragsim.errors import FragsimError
    from gpu_backend.validate import HybridShape, run_hybrid_validation

    try:
        shape = HybridShape(num_layers=args.layers, num_kv_heads=args.kv_heads or 2,
                            head_dim=args.head_dim or 16, q_per_kv=args.q_per_kv, dtype=args.dtype)
    except ValueError as exc:
        raise FragsimError(str(exc)) from None
    every = args.attention_every or (1 if device == "cuda" else 5)

    def run(name: str) -> Any:
        try:
            return run_hybrid_validation(spec, name, device=device, shape=shape, scale=scale,
                                         attention_every=every, offset=args.offset,
                                         pool_bytes=args.pool_bytes)
        except ValueError as exc:
            raise FragsimError(f"allocator {name!r}: {exc}") from None

    return _run_all(args, spec, allocators, _print_hybrid, run)


def _print_hybrid(report: Any) -> None:
    _print_table(report, f"{report.allocator} on {report.device}, {report.model}: {report.num_requests} "
                         f"requests, a {report.pool_bytes:,}-byte pool", "row: quantity", 1,
                 [("state reads checked", report.state_checks),
                  ("blocks a window freed, taken again", report.window_reuses),
                  ("preemptions", report.preemptions)])


def _print(report: Any) -> None:
    _print_table(report, f"{report.allocator} on {report.device}: {report.num_requests} requests, "
                         f"{report.capacity_slots:,} slots", "quantity", 4, [])


def _print_table(report: Any, title: str, first: str, digits: int, counts: list[tuple[str, int]]) -> None:
    """The simulated-vs-measured table of one report, its checks, then any error."""
    from rich.console import Console
    from rich.table import Table

    status = "[green]agree[/green]" if report.ok else "[red]MISMATCH[/red]"
    table = Table(title=f"{title}, {report.steps_checked:,} steps checked — {status}", title_justify="left")
    table.add_column(first)
    table.add_column("simulated", justify="right")
    table.add_column("measured on device", justify="right")
    table.add_column("equal at every step", justify="center")
    for row in report.table:
        table.add_row(row["quantity"], f"{row['simulated']:,.{digits}f}", f"{row['measured']:,.{digits}f}",
                      "yes" if row["match"] else "[red]NO[/red]")
    table.add_row("attention checks passed", f"{report.attention_checks:,}",
                  f"max |err| {report.max_abs_error:.2e}", "yes" if report.error is None else "[red]NO[/red]")
    table.add_row("stored K/V checks passed", f"{report.content_checks:,}", "", "")
    for label, n in counts:
        table.add_row(label, f"{n:,}", "", "")
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    console.print(table)
    if report.error:
        console.print(f"[red]{report.error}[/red]")
