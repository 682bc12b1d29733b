"""``fragsim capacity``: the KV budget of a model on a GPU, and the static
reservation arithmetic of the seed documents, exact to the byte."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from fragsim.errors import FragsimError

HELP = "KV-cache budget, slots and blocks of a model on a GPU; static reservation cost"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "capacity",
        help=HELP,
        description=(
            HELP + ". Budget per GPU as vLLM computes it: memory × utilization − "
            "weights/tp − activation peak; slots = budget // KV bytes per token per GPU."
        ),
    )
    p.add_argument("--model", help="model preset or catalog entry (see --list)")
    p.add_argument("--gpu", help="GPU preset or catalog entry (see --list)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                   help="fraction of GPU memory the engine may use, in (0, 1] (default 0.9)")
    p.add_argument("--max-seq-len", type=int, metavar="L",
                   help="longest sequence, prompt + output, in tokens "
                        "(default: the model's max_position_embeddings, as vLLM's max_model_len)")
    p.add_argument("--batch", type=int, metavar="B",
                   help="max batch of a static allocator; enables the static figures")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--avg-len", type=float, metavar="A",
                   help="average request length in tokens: static utilization = A / L")
    p.add_argument("--max-num-batched-tokens", type=int, metavar="T",
                   help="tokens in the largest forward pass, sizes the activation estimate "
                        "(default 2048)")
    p.add_argument("--activation-bytes", type=int, metavar="N",
                   help="use this measured activation peak instead of the estimate")
    p.add_argument("--catalog", metavar="FILE.toml", help="extra models/GPUs ([models.NAME], [gpus.NAME])")
    p.add_argument("--list", action="store_true", help="list the model and GPU presets and exit")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=main)


def _units(n: int, base: int, names: tuple[str, ...]) -> str:
    value, unit = float(n), 0
    while abs(value) >= base and unit < len(names) - 1:
        value /= base
        unit += 1
    return f"{value:,.2f} {names[unit]}"


def _byte_cells(n: int | None) -> tuple[str, str, str]:
    """Exact bytes, decimal (GB) and binary (GiB) renderings."""
    if n is None:
        return "-", "", ""
    return (f"{n:,} B", _units(n, 1000, ("B", "kB", "MB", "GB", "TB")),
            _units(n, 1024, ("B", "KiB", "MiB", "GiB", "TiB")))


def _catalog_dump(models: dict[str, Any], gpus: dict[str, Any]) -> dict[str, Any]:
    return {
        "models": {n: {**dataclasses.asdict(m), "kv_bytes_per_token": m.kv_bytes_per_token,
                       "weight_bytes": m.weight_bytes} for n, m in models.items()},
        "gpus": {n: dataclasses.asdict(g) for n, g in gpus.items()},
    }


def _print_list(console: Any, models: dict[str, Any], gpus: dict[str, Any]) -> None:
    from rich.table import Table

    mt = Table(title="Models")
    for col in ("name", "layers", "heads", "kv heads", "head dim", "params",
                "KV/token", "", "max pos"):
        mt.add_column(col, justify="left" if col == "name" else "right")
    for m in models.values():
        exact, _, binary = _byte_cells(m.kv_bytes_per_token)
        mt.add_row(m.name, str(m.num_layers), str(m.num_heads), str(m.num_kv_heads),
                   str(m.head_dim), f"{m.num_params / 1e9:.2f}B", exact, binary,
                   f"{m.max_position_embeddings:,}")
    gt = Table(title="GPUs")
    for col in ("name", "memory", "", "HBM", "fp16 dense", "PCIe"):
        gt.add_column(col, justify="left" if col == "name" else "right")
    for g in gpus.values():
        exact, _, binary = _byte_cells(g.memory_bytes)
        gt.add_row(g.name, exact, binary, f"{g.hbm_bandwidth / 1e9:,.0f} GB/s",
                   f"{g.fp16_flops / 1e12:,.1f} TFLOP/s", f"{g.pcie_bandwidth / 1e9:,.0f} GB/s")
    console.print(mt)
    console.print(gt)


def _print_report(console: Any, r: Any, model: Any) -> None:
    from rich.table import Table

    dtype = {1: "fp8", 2: "fp16", 4: "fp32"}[model.dtype_bytes]
    t = Table(title=f"{r.model} on {r.gpu}, tp={r.tp}, {dtype}",
              caption=(f"{model.num_layers} layers, {model.num_heads} heads, "
                       f"{model.num_kv_heads} kv heads, head_dim {model.head_dim}, "
                       f"{model.num_params:,} params"))
    t.add_column("figure")
    for col in ("value", "decimal", "binary"):
        t.add_column(col, justify="right")

    def row(label: str, n: int | None) -> None:
        t.add_row(label, *_byte_cells(n))

    row("KV per token (whole model)", r.kv_bytes_per_token)
    row(f"KV per token per GPU ({r.num_kv_heads_per_gpu} kv heads)", r.kv_bytes_per_token_per_gpu)
    row(f"KV of one {r.max_seq_len}-token sequence", r.kv_bytes_per_seq)
    t.add_section()
    row("GPU memory", r.gpu_memory_bytes)
    row(f"× utilization {r.gpu_memory_utilization:g}", r.usable_memory_bytes)
    row("− weights per GPU", r.weight_bytes_per_gpu)
    how = f"estimate, {r.max_num_batched_tokens} tokens" if r.activation_estimated else "given"
    row(f"− activation peak ({how})", r.activation_bytes)
    row("= KV budget per GPU", r.kv_budget_bytes)
    t.add_section()
    t.add_row("KV slots", f"{r.kv_slots:,}", "", "")
    t.add_row(f"blocks of {r.block_size}", f"{r.num_blocks:,}", "", "")
    t.add_row(f"max concurrency at {r.max_seq_len} tokens", f"{r.max_concurrency:.2f}x", "", "")
    t.add_row(f"static: {r.max_seq_len}-token sequences that fit", f"{r.static_max_batch:,}", "", "")
    if r.batch is not None:
        t.add_section()
        row(f"static reservation {r.batch} × {r.max_seq_len}", r.static_kv_bytes)
        if r.tp > 1:
            row("static reservation per GPU", r.static_kv_bytes_per_gpu)
        row("weights + activations + static, per GPU", r.static_total_bytes_per_gpu)
        t.add_row("static fits the KV budget", "yes" if r.static_fits else "NO", "", "")
    if r.avg_len is not None:
        t.add_section()
        t.add_row(f"static utilization at avg {r.avg_len:g} tokens",
                  f"{r.static_utilization:.1%}", "", "")
        if r.static_used_bytes is not None:
            row("static bytes holding tokens", r.static_used_bytes)
        t.add_row(f"paged: {r.avg_len:g}-token requests that fit",
                  f"{r.paged_concurrency_at_avg_len:,}", "", "")
    console.print(t)
    if r.static_formula:
        console.print(f"static = {r.static_formula}", highlight=False, soft_wrap=True)
    for note in r.notes:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from fragsim.capacity import plan_capacity
    from fragsim.catalog import GPUS, MODELS, get_gpu, get_model, load_catalog

    custom_models, custom_gpus = load_catalog(args.catalog) if args.catalog else ({}, {})
    # Piped or captured output has no terminal width; 80 columns would wrap the tables.
    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 120)
    if args.list:
        models, gpus = {**MODELS, **custom_models}, {**GPUS, **custom_gpus}
        if args.json:
            print(json.dumps(_catalog_dump(models, gpus)))
        else:
            _print_list(console, models, gpus)
        return 0
    if not args.model or not args.gpu:
        raise FragsimError("--model and --gpu are required (--list shows the choices)")
    model = get_model(args.model, args.catalog)
    gpu = get_gpu(args.gpu, args.catalog)
    report = plan_capacity(
        model, gpu, tp=args.tp, gpu_memory_utilization=args.gpu_memory_utilization,
        max_seq_len=args.max_seq_len, batch=args.batch, block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        activation_bytes=args.activation_bytes, avg_len=args.avg_len,
    )
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        _print_report(console, report, model)
    return 0
