"""``fragsim capacity``: the KV budget of a model on a GPU, and the static
reservation arithmetic of the seed documents, exact to the byte."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from fragsim.errors import FragsimError
from fragsim.layers import count_labels

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
    p.add_argument("--model", help="model preset or catalog entry (see --list), or a Hugging Face "
                                   "config.json (or the folder holding one)")
    from fragsim.catalog import DEFAULT_GPU

    p.add_argument("--gpu", default=DEFAULT_GPU,
                   help="GPU preset or catalog entry (see --list; default: %(default)s, as fragsim run)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default 1)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="fraction of GPU memory the engine may use, in (0, 1] (default: the "
                        "release's, as vllm serve: 0.92 in 0.33, 0.9 in 0.19)")
    p.add_argument("--max-seq-len", type=int, metavar="L",
                   help="longest sequence, prompt + output, in tokens "
                        "(default: the model's max_position_embeddings, as vLLM's max_model_len)")
    p.add_argument("--batch", type=int, metavar="B",
                   help="max batch of a static allocator; enables the static figures")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: the attention backend's on this GPU, "
                        "usually 16; vLLM raises it for state layers)")
    p.add_argument("--avg-len", type=float, metavar="A",
                   help="average request length in tokens: static utilization = A / L")
    p.add_argument("--max-num-batched-tokens", type=int, metavar="T",
                   help="tokens in the largest forward pass: sizes the activation estimate and "
                        "the tokens in flight (default: vllm serve's for the card: 2048 on "
                        "A100s, 8192 on H100/H200, 16384 from 160 GiB)")
    p.add_argument("--max-num-seqs", type=int, metavar="S",
                   help="sequences in one batch: sizes the dummy sampling step of vLLM's profile "
                        "and its CUDA graphs (default: vllm serve's for the card: 1024 from "
                        "70 GiB except A100s, else 256)")
    from fragsim.vllm_memory import DEFAULT_RELEASE, RELEASES

    p.add_argument("--vllm-version", default=None, metavar="X.Y",
                   help=f"whose start-up profile rules to follow: {', '.join(RELEASES)} "
                        f"(default: {DEFAULT_RELEASE}, or the version a --from-log names)")
    p.add_argument("--quantization", default=None, metavar="METHOD",
                   help="quantize an unquantized checkpoint on load, as vllm serve --quantization "
                        "fp8 does (linear layers in one byte); a quantized checkpoint keeps its own "
                        "format")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs, as vllm serve --enforce-eager")
    p.add_argument("--from-log", metavar="FILE",
                   help="a real vLLM start-up log: take its settings (tp, utilization, lengths, "
                        "version) where not given, and show term by term where the "
                        "prediction differs from what it printed")
    p.add_argument("--activation-bytes", type=int, metavar="N",
                   help="use this measured activation peak instead of the estimate")
    p.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                   help="KV cache element type: auto (the model's), fp16, bf16, fp32, fp8, "
                        "fp8_e4m3, fp8_e5m2 (default auto)")
    p.add_argument("--kv-cache-memory-bytes", type=int, metavar="N",
                   help="bytes of KV cache per GPU, as vLLM's option of that name "
                        "(default: the budget computed from the GPU, weights and activations)")
    p.add_argument("--seq-len", type=int, metavar="L",
                   help="show the blocks one sequence holds per KV cache group once it has "
                        "stored L tokens and computes token L+1")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="plan as vllm serve --no-enable-prefix-caching (state layers then keep "
                        "one max_model_len block each)")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="one step in flight instead of two (changes the concurrency vLLM logs "
                        "for sliding and chunked layers)")
    p.add_argument("--hybrid-chunked", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM's hybrid KV cache manager for chunked local attention (Llama 4): on by "
                        "default, as in vLLM 0.33; --no-hybrid-chunked turns it off, as "
                        "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0 does")
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
        "models": {n: {**{k: v for k, v in dataclasses.asdict(m).items() if k != "weights"},
                       "kv_bytes_per_token": m.kv_bytes_per_token,
                       "weight_bytes": m.weight_bytes} for n, m in models.items()},
        "gpus": {n: dataclasses.asdict(g) for n, g in gpus.items()},
    }


def _print_list(console: Any, models: dict[str, Any], gpus: dict[str, Any]) -> None:
    from rich.table import Table

    mt = Table(title="Models")
    for col in ("name", "layers", "heads", "kv heads", "head dim", "params",
                "KV/token (all full)", "", "max pos", "layer kinds"):
        mt.add_column(col, justify="left" if col in ("name", "layer kinds") else "right")
    for m in models.values():
        exact, _, binary = _byte_cells(m.kv_bytes_per_token)
        counts = count_labels(m.layer_specs)
        mt.add_row(m.name, str(m.num_layers), str(m.num_heads), str(m.num_kv_heads),
                   str(m.head_dim), f"{m.num_params / 1e9:.2f}B", exact, binary,
                   f"{m.max_position_embeddings:,}",
                   " + ".join(f"{n} {label}" for label, n in counts.items()))
    gt = Table(title="GPUs")
    for col in ("name", "memory", "", "driver total", "HBM", "fp16 dense", "PCIe"):
        gt.add_column(col, justify="left" if col == "name" else "right")
    for g in gpus.values():
        exact, _, binary = _byte_cells(g.memory_bytes)
        driver = "" if g.driver_total_bytes is None else _byte_cells(g.driver_total_bytes)[2]
        gt.add_row(g.name, exact, binary, driver, f"{g.hbm_bandwidth / 1e9:,.0f} GB/s",
                   f"{g.fp16_flops / 1e12:,.1f} TFLOP/s", f"{g.pcie_bandwidth / 1e9:,.0f} GB/s")
    console.print(mt)
    console.print(gt)


def _print_report(console: Any, r: Any, model: Any) -> None:
    from rich.table import Table

    dtype = {1: "fp8", 2: "fp16", 4: "fp32"}[model.dtype_bytes]
    if model.kv_cache_dtype != "auto":
        dtype += f", KV {model.kv_cache_dtype}"
    t = Table(title=f"{r.model} on {r.gpu}, tp={r.tp}, {dtype}",
              caption=(f"{model.num_layers} layers, {model.num_heads} heads, "
                       f"{model.num_kv_heads} kv heads, head_dim {model.head_dim}, "
                       f"{model.num_params:,} params"))
    t.add_column("figure")
    for col in ("value", "decimal", "binary"):
        t.add_column(col, justify="right")

    def row(label: str, n: int | None) -> None:
        t.add_row(label, *_byte_cells(n))

    naive = " (naive: every layer full attention)" if model.is_hybrid else ""
    row(f"KV per token (whole model){naive}", r.kv_bytes_per_token)
    row(f"KV per token per GPU ({r.num_kv_heads_per_gpu} kv heads)", r.kv_bytes_per_token_per_gpu)
    row(f"KV of one {r.max_seq_len}-token sequence", r.kv_bytes_per_seq)
    t.add_section()
    row("GPU memory (driver total)" if r.gpu_memory_from_driver else "GPU memory (nvidia-smi)",
        r.gpu_memory_bytes)
    row(f"× utilization {r.gpu_memory_utilization:g} (requested)", r.usable_memory_bytes)
    row("− weights per GPU", r.weight_bytes_per_gpu)
    how = (f"profile run: {r.max_num_batched_tokens:,} tokens, {r.max_num_seqs:,} sequences"
           if r.activation_estimated else "given")
    row(f"− torch activation peak ({how})", r.activation_bytes)
    row("− non-torch memory" + (" (communicators at tp > 1)" if r.tp > 1 else ""),
        r.non_torch_bytes)
    if r.cuda_graph_subtracted:
        row("− CUDA graphs (estimated)", r.cuda_graph_bytes)
    row(f"= available KV cache memory (vLLM {r.vllm_version})", r.kv_budget_bytes)
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


def _print_plan(console: Any, d: dict[str, Any], model: Any) -> None:
    """Per layer kind, vLLM's groups and pool, and what a sequence holds."""
    from rich.table import Table

    kinds = Table(title="KV bytes per token per GPU, by layer kind")
    kinds.add_column("kind")
    kinds.add_column("layers", justify="right")
    kinds.add_column("bytes per token", justify="right")
    counts = count_labels(model.layer_specs)
    per_kind = d["bytes_per_token_by_kind"]
    for label, n in counts.items():
        kind = label.split()[0]
        value = f"{per_kind[kind]:,} B" if kind in per_kind else "state"
        kinds.add_row(label, str(n), value)
    if d["state_bytes_per_seq"]:
        kinds.add_row("state per sequence", "", f"{d['state_bytes_per_seq']:,} B")
    kinds.add_row("naive: every layer full attention", str(model.num_layers),
                  f"{d['naive_bytes_per_token']:,} B")
    console.print(kinds)

    t = Table(title=(f"vLLM's KV cache groups ({'hybrid manager' if d['hybrid_kv_cache_manager'] else 'every attention layer as full'}, "
                     f"prefix caching {'on' if d['prefix_caching'] else 'off'})"))
    for col in ("group", "kind", "layers", "padding layers", "window", "block size"):
        t.add_column(col, justify="left" if col == "kind" else "right")
    if d["blocks_per_seq"] is not None:
        t.add_column(f"blocks at {d['seq_len']:,} tokens", justify="right")
    for i, g in enumerate(d["kv_cache_groups"]):
        row = [str(i), g["kind"], str(g["num_layers"]), str(g["num_padding_layers"]),
               "" if g["sliding_window"] is None else f"{g['sliding_window']:,}",
               f"{g['block_size']:,}"]
        if d["blocks_per_seq"] is not None:
            row.append(f"{d['blocks_per_seq'][i]['blocks']:,}")
        t.add_row(*row)
    console.print(t)

    p = Table(title="vLLM's pool")
    p.add_column("figure")
    p.add_column("vLLM (layer kinds)", justify="right")
    p.add_column("naive (all full)", justify="right")
    p.add_row("KV cache memory", f"{d['kv_cache_memory_bytes']:,} B", "")
    p.add_row("page (one block, one layer)", f"{d['page_size_bytes']:,} B", "")
    p.add_row("bytes per block (all groups)", f"{d['bytes_per_block']:,} B",
              f"{d['naive_bytes_per_token'] * d['naive_block_size']:,} B")
    if d["padding_bytes_per_block"]:
        p.add_row("of it padding", f"{d['padding_bytes_per_block']:,} B", "")
    p.add_row("num_gpu_blocks", f"{d['num_gpu_blocks']:,}", f"{d['naive_num_gpu_blocks']:,}")
    p.add_row(f"max concurrency at {d['max_seq_len']:,} tokens", f"{d['max_concurrency']:.2f}x",
              f"{d['naive_max_concurrency']:.2f}x")
    p.add_row("GPU KV cache size (tokens, as vLLM logs it)", f"{d['kv_cache_tokens']:,}", "")
    if d["blocks_per_seq"] is not None:
        p.add_row(f"bytes one {d['seq_len']:,}-token sequence holds", f"{d['bytes_per_seq']:,} B",
                  f"{d['seq_len'] * d['naive_bytes_per_token']:,} B")
    console.print(p)
    if d["naive_max_concurrency"]:    # with no pool at all there is nothing to compare
        ratio = d["max_concurrency"] / d["naive_max_concurrency"]
        console.print(f"the naive estimate is off by {ratio:.2f}x in concurrency "
                      f"({d['max_num_batched_tokens']:,} batched tokens, "
                      f"{d['in_flight_tokens']:,} in flight)", highlight=False, soft_wrap=True)
    for note in d["vllm_notes"]:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)


def _print_log(console: Any, r: Any, d: dict[str, Any]) -> None:
    """The lines vLLM would print at start-up, with its own rounding."""
    from fragsim.vllm_memory import predicted_log

    console.print(f"vLLM {r.vllm_version} start-up log, predicted (times left out):", highlight=False)
    for line in predicted_log(r, d):
        console.print(f"  {line}", highlight=False, soft_wrap=True)


def _print_comparison(console: Any, rows: list[tuple[str, str, str, str]], where: str) -> None:
    from rich.table import Table

    t = Table(title=f"fragsim against {where}")
    for col in ("term", "fragsim", "log", "difference"):
        t.add_column(col, justify="left" if col == "term" else "right")
    for row in rows:
        t.add_row(*row)
    console.print(t)


def _preset_for(hub_id: str) -> str | None:
    """The preset a logged model id names: its hub name, or that name with an
    instruction-tuned suffix (not a quantized variant, which is another checkpoint)."""
    from fragsim.presets import COPIED, PUBLISHED

    hubs = {**{k: v for k, v in PUBLISHED.items()},
            **{k: src.split("huggingface.co/")[-1].split("/blob")[0] for k, (_, src) in COPIED.items()}}
    name = hub_id.rstrip("/").split("/")[-1].lower()
    for preset, hub in sorted(hubs.items(), key=lambda kv: -len(kv[1])):
        base = hub.split("/")[-1].lower()
        if name == base or (name.startswith(base) and name[len(base):] in
                            ("-instruct", "-it", "-chat", "-hf", "-base")):
            return preset
    return None


def _log_settings(args: argparse.Namespace) -> tuple[Any, str]:
    """Read ``--from-log`` and fill the options it sets that the command line left out."""
    from pathlib import Path

    from fragsim.vllm_log import read_log

    path = Path(args.from_log)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise FragsimError(f"cannot read log {args.from_log!r}: {exc.strerror}") from None
    logged = read_log(text)
    if logged.kv_cache_gib is None and logged.kv_cache_tokens is None:
        raise FragsimError(f"{args.from_log}: not a vLLM start-up log: no 'Available KV cache "
                           "memory' nor 'GPU KV cache size' line found")
    s = logged.settings
    fill = {"tp": "tensor_parallel_size", "max_seq_len": "max_model_len",
            "max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens"}
    for option, key in fill.items():
        if getattr(args, option) is None and key in s:
            setattr(args, option, int(s[key]))
    if args.gpu_memory_utilization is None and "gpu_memory_utilization" in s:
        args.gpu_memory_utilization = float(s["gpu_memory_utilization"])
    if args.kv_cache_dtype == "auto" and s.get("kv_cache_dtype", "auto") != "auto":
        args.kv_cache_dtype = s["kv_cache_dtype"]
    if args.quantization is None and s.get("quantization") not in (None, "None"):
        args.quantization = str(s["quantization"])
    if not args.enforce_eager and s.get("enforce_eager") is True:
        args.enforce_eager = True
    if args.vllm_version is None and "vllm_version" in s:
        from fragsim.vllm_memory import nearest_release

        args.vllm_version = nearest_release(str(s["vllm_version"]))
    if not args.model:
        named = str(s.get("model", ""))
        match = _preset_for(named)
        if not match:
            raise FragsimError(f"{args.from_log}: the log's model is {named or 'not named'}; "
                               "give --model (a preset or the model's config.json)")
        args.model = match
    return logged, str(path)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from fragsim.capacity import plan_capacity
    from fragsim.catalog import GPUS, MODELS, get_gpu, get_model, load_catalog, with_kv_cache_dtype

    custom_models, custom_gpus = load_catalog(args.catalog) if args.catalog else ({}, {})
    # Piped or captured output has no terminal width; 80 columns would wrap the tables.
    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 160)
    if args.list:
        models, gpus = {**MODELS, **custom_models}, {**GPUS, **custom_gpus}
        if args.json:
            print(json.dumps(_catalog_dump(models, gpus)))
        else:
            _print_list(console, models, gpus)
        return 0
    logged = where = None
    if args.from_log:
        logged, where = _log_settings(args)
    if args.tp is None:
        args.tp = 1
    if not args.model:
        raise FragsimError("--model is required (--list shows the choices)")
    from fragsim.weights import with_online_quantization

    model = with_kv_cache_dtype(get_model(args.model, args.catalog), args.kv_cache_dtype)
    model = with_online_quantization(model, args.quantization)
    gpu = get_gpu(args.gpu, args.catalog)
    report = plan_capacity(
        model, gpu, tp=args.tp, gpu_memory_utilization=args.gpu_memory_utilization,
        max_seq_len=args.max_seq_len, batch=args.batch,
        block_size=16 if args.block_size is None else args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        activation_bytes=args.activation_bytes, avg_len=args.avg_len,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, prefix_caching=args.prefix_caching,
        seq_len=args.seq_len, async_scheduling=args.async_scheduling,
        chunked_hybrid=args.hybrid_chunked, vllm_block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, vllm_version=args.vllm_version,
        enforce_eager=args.enforce_eager,
    )
    data = report.to_dict()
    rows = None
    if logged is not None:
        from fragsim.vllm_memory import compare_with_log

        rows, checks = compare_with_log(report, data, logged, model, gpu, plan_kwargs={
            "tp": args.tp, "max_seq_len": report.max_seq_len,
            "max_num_batched_tokens": report.max_num_batched_tokens,
            "prefix_caching": args.prefix_caching, "async_scheduling": args.async_scheduling,
            "chunked_hybrid": args.hybrid_chunked, "vllm_block_size": args.block_size,
            "max_num_seqs": report.max_num_seqs, "vllm_version": report.vllm_version,
            "gpu_memory_utilization": report.gpu_memory_utilization})
        data["from_log"] = {"path": where, "logged": logged.figures(), "settings": logged.settings,
                            "checks": checks}
    if args.json:
        print(json.dumps(data))
        return 0
    _print_report(console, report, model)
    _print_plan(console, data, model)
    _print_log(console, report, data)
    if rows is not None:
        _print_comparison(console, rows, where or "")
        for line in data["from_log"]["checks"]:
            console.print(line, highlight=False, soft_wrap=True)
    return 0
