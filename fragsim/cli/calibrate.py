"""``fragsim calibrate``: fit a step-cost model to measurements and write it as TOML."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fragsim.cli.args import fraction, positive_int

DESCRIPTION = """\
Fit fragsim's step-cost model to measurements and write it as a TOML file that
`fragsim run --cost-model FILE` and experiment files (cost_model = "FILE") can name:

  step = overhead + per_seq * num_decode
         + max(prefill_token * P + attention_unit * (U + C) + decode_token * num_decode,
               weights + context_token * C)

MEASUREMENTS is one of
  a steps table (CSV, Parquet, JSON Lines): num_prefill_tokens, num_decode,
      decode_context, step_time_s (or _ms, _us), optionally prefill_attention_units;
      fitted by least squares on each step's relative error;
  per-request latencies of a real run: a vLLM benchmark result JSON (vllm bench
      serve --save-result --save-detailed), a BLIS trace v2 CSV (trace_data.csv),
      or a table with arrival_s, prompt_len, output_len, ttft_s, tpot_s; the
      requests are replayed through the engine (the options below describe the
      deployment) until each one's TTFT and time per output token match;
  operating points (TOML, [[points]]): the mean batch a system ran at a rate,
      with the deployment in [system] (experiments/calibration/vllm_paper.toml);
      each point replays num_requests requests, or rate x duration_s (3600: a
      one-hour trace, as the vLLM paper's); a fit is refused when a fitted point's
      queue is still growing at the end of its replay (--allow-transient).

Coefficients not fitted keep their prior: the roofline's for --model and --gpu
(or --prior). One row in five is held back, and the error on those rows is
reported beside the fit's own."""

EPILOG = """\
examples:
  fragsim calibrate steps.csv --model llama-3.1-8b --gpu h100-80gb --out my-h100.toml
  fragsim calibrate bench.json --model llama-3.1-8b --gpu h100-80gb --max-num-seqs 256
  fragsim calibrate experiments/calibration/vllm_paper.toml --out my-vllm-paper.toml --max-evaluations 60
"""


def _fix(text: str) -> tuple[str, float]:
    from fragsim.costmodel import TERMS

    name, _, value = text.partition("=")
    if name not in TERMS or not value:
        raise argparse.ArgumentTypeError(f"expected TERM=SECONDS with TERM one of {', '.join(TERMS)}, "
                                         f"got {text!r}")
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}: {value!r} is not a number of seconds") from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"{name}: must be >= 0 seconds, got {seconds}")
    return name, seconds


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("calibrate", help="fit a step-cost model to measured steps or latencies",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("measurements", help="measurements file (see above)")
    p.add_argument("--out", help="TOML file to write (default: MEASUREMENTS' name + .cost.toml)")
    p.add_argument("--name", help="the fitted model's name (default: the output file's stem)")
    g = p.add_argument_group("what to fit")
    g.add_argument("--free", help="comma list of coefficients to fit (default: what the kind of "
                                  "measurement tells: every term that varies in a steps table; "
                                  "overhead_s, per_seq_s, prefill_token_s, context_token_s from "
                                  "requests; overhead_s, per_seq_s from operating points)")
    g.add_argument("--fix", type=_fix, action="append", default=[], metavar="TERM=SECONDS",
                   help="hold a coefficient at a value (repeatable)")
    g.add_argument("--prior", metavar="NAME|FILE",
                   help="start from this fitted model instead of the roofline of --model/--gpu")
    g.add_argument("--attention-times", metavar="KERNELS.json",
                   help="decode-attention kernel times measured on the device (kernels.json of "
                        "benchmarks/gpu_check.py): they set context_token_s, which is then held "
                        "(needs --model, for its KV bytes per token)")
    g.add_argument("--evaluate", metavar="FILE", action="append", default=[],
                   help="also report the fitted model's error on these measurements, which the fit "
                        "never sees (another run, day or load; repeatable)")
    g.add_argument("--holdout", type=fraction, default=0.2,
                   help="fraction of rows held back to measure the fit's error (default 0.2)")
    g.add_argument("--seed", type=int, default=0, help="seed of the held-back rows (default 0)")
    g.add_argument("--max-evaluations", type=positive_int, default=120,
                   help="replays the requests or points fit may run (default 120)")
    g = p.add_argument_group("the measured deployment (requests and points; [system] of a points file wins)")
    g.add_argument("--model", help="model preset or config.json")
    g.add_argument("--gpu", help="GPU preset")
    g.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree (default 1)")
    g.add_argument("--catalog", help="TOML file with custom models/GPUs")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--kv-slots", type=positive_int, help="KV pool size in tokens")
    g.add_argument("--block-size", type=positive_int, default=16)
    g.add_argument("--max-seq-len", type=positive_int, help="default: the model's context")
    g.add_argument("--allow-transient", action="store_true",
                   help="write the fit even when a fitted operating point's queue was still growing at "
                        "the end of its replay (a transient, not the operating point: give the point "
                        "more requests, e.g. duration_s = 3600 as the vLLM paper's one-hour traces)")
    g.add_argument("--max-num-seqs", type=positive_int, default=256)
    g.add_argument("--max-num-batched-tokens", type=positive_int)
    p.set_defaults(func=main)


def _spec(args: argparse.Namespace, system: dict[str, Any]) -> Any:
    from fragsim.errors import FragsimError
    from fragsim.simulate import RunSpec, _model_gpu

    options: dict[str, Any] = {
        "model": args.model, "gpu": args.gpu, "tp": args.tp, "catalog": args.catalog,
        "gpu_memory_utilization": args.gpu_memory_utilization, "kv_slots": args.kv_slots,
        "block_size": args.block_size, "max_seq_len": args.max_seq_len,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    system = {k: v for k, v in system.items() if k != "source"}
    fields = set(RunSpec.__dataclass_fields__)
    unknown = sorted(set(system) - fields)
    if unknown:
        raise FragsimError(f"{args.measurements}: [system] {', '.join(unknown)}: unknown; allowed: "
                           "any RunSpec field")
    options.update(system)
    if not options["model"] or not options["gpu"]:
        raise FragsimError("this fit replays the measured requests: name the deployment with "
                           "--model and --gpu (and its scheduler options)")
    options = {k: v for k, v in options.items() if v is not None}
    spec = RunSpec(**options)
    if "max_seq_len" not in options:
        model, _ = _model_gpu(spec)
        spec = RunSpec(**{**options, "max_seq_len": int(model.max_position_embeddings)})
    return spec


def _prior(args: argparse.Namespace, spec: Any) -> Any:
    from fragsim.costmodel import RooflineCostModel, StepCostModel, load_cost_model
    from fragsim.simulate import _model_gpu

    if args.prior:
        return load_cost_model(args.prior)
    if spec is None:
        return StepCostModel(overhead_s=1e-3, name="zero-prior")
    model, gpu = _model_gpu(spec)
    return StepCostModel.from_roofline(RooflineCostModel(model, gpu, tp=spec.tp))


def _ms(seconds: float) -> str:
    if seconds == 0:
        return "0"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:,.4g} ms"
    if seconds >= 1e-6:
        return f"{seconds * 1e6:,.4g} µs"
    return f"{seconds * 1e9:,.4g} ns"


def _print_points(out: Any, report: Any) -> None:
    from rich.table import Table

    pts = Table(title="operating points: mean requests running at once", title_justify="left")
    for col in ("point", "allocator", "requests", "measured", "fitted", "error", "", "at the end"):
        pts.add_column(col, justify="right" if col in ("requests", "measured", "fitted", "error") else "left")
    for r in report.rows.itertuples():
        pts.add_row(str(r.label), str(r.allocator), f"{r.num_requests:,}", f"{r.mean_running:,.2f}",
                    f"{r.fitted:,.2f}", f"{r.error:+.1%}", "held out" if r.held_out else "fitted",
                    str(r.queue) if r.steady else f"[red]{r.queue}[/red]")
    out.print(pts)


def main(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from rich.console import Console
    from rich.table import Table

    from fragsim import calibrate
    from fragsim.costmodel import TERM_HELP, TERMS
    from fragsim.files import write_atomically

    m, system = calibrate.load_measurements(args.measurements)
    out_path = Path(args.out) if args.out else Path(Path(args.measurements).name).with_suffix(".cost.toml")
    name = args.name or out_path.name.removesuffix(".toml").removesuffix(".cost")
    free = [t.strip() for t in args.free.split(",") if t.strip()] if args.free else None
    fixed = dict(args.fix)
    err = Console(stderr=True)
    spec = None
    if m.kind != "steps" or args.model or system:
        if m.kind == "steps" and not (args.model and args.gpu):
            from fragsim.errors import FragsimError

            raise FragsimError("--model and --gpu go together (they give the prior)")
        spec = _spec(args, system)
    prior = _prior(args, spec)
    attention: dict[str, Any] | None = None
    if args.attention_times:
        from fragsim.errors import FragsimError
        from fragsim.simulate import _model_gpu

        if spec is None:
            raise FragsimError("--attention-times needs --model and --gpu (the model's KV bytes "
                               "per token turn the kernel's read rate into a cost per token)")
        model, _ = _model_gpu(spec)
        fixed["context_token_s"], attention = calibrate.attention_from_kernels(
            args.attention_times, model.kv_bytes_per_token_per_gpu(spec.tp))
        m.notes.append(f"measured attention: the paged kernel reads KV at "
                       f"{attention['read_gbps']:,.0f} GB/s ({attention['rows']} rows, fit error "
                       f"{attention['mape']:.1%}): context_token_s = {fixed['context_token_s']:.4g} s")
    for note in m.notes:
        err.print(f"[dim]{note}[/dim]", highlight=False)

    def progress(n: int, loss: float) -> None:
        if err.is_terminal:
            err.print(f"  replay {n}: loss {loss:.4g}", end="\r", highlight=False)

    if m.kind == "steps":
        report = calibrate.fit_steps(m, prior, free=free, fixed=fixed, holdout=args.holdout,
                                     seed=args.seed)
    elif m.kind == "requests":
        report = calibrate.fit_requests(m, prior, spec, free=free, fixed=fixed, holdout=args.holdout,
                                        seed=args.seed, max_evaluations=args.max_evaluations,
                                        progress=progress)
    else:
        report = calibrate.fit_points(m, prior, spec, free=free, fixed=fixed,
                                      max_evaluations=args.max_evaluations, progress=progress)
    source = system.get("source") if system else None
    fit_info: dict[str, Any] = {
        "kind": m.kind, "measurements": Path(args.measurements).name, "rows": int(len(m.table)),
        "free": list(report.free), "evaluations": report.num_evaluations,
        "train_error": report.train_error, "holdout_error": report.holdout_error,
    }
    if attention is not None:
        fit_info["attention_times"] = {"file": Path(args.attention_times).name, **attention}
    transient: list[str] = []
    if m.kind == "points":
        fit_info["points"] = {str(r.label): {"measured": float(r.mean_running), "fitted": float(r.fitted),
                                             "held_out": bool(r.held_out), "requests": int(r.num_requests),
                                             "steady": bool(r.steady)}
                              for r in report.rows.itertuples()}
        transient = [str(r.label) for r in report.rows.itertuples() if not r.steady and not r.held_out]
    fitted = replace(report.model, name=name, fit=fit_info,
                     model=spec.model if spec is not None else "",
                     gpu=spec.gpu if spec is not None else "", tp=spec.tp if spec is not None else 1,
                     source=str(source or f"fragsim calibrate {Path(args.measurements).name} "
                                          f"({m.kind}, {len(m.table):,} rows)"))
    out = Console()
    if transient and not args.allow_transient:
        _print_points(out, report)
        from fragsim.errors import FragsimError

        raise FragsimError(f"{len(transient)} fitted point(s) replayed as a transient, their queue still "
                           f"growing at the end: {'; '.join(transient)}. A fit there depends on the "
                           "trace's length: give the points more requests (duration_s = 3600, as the "
                           f"paper's one-hour traces), or --allow-transient to write it anyway; "
                           f"{out_path} not written")
    if transient:
        err.print(f"[bold red]warning: fitted on a transient[/bold red] (--allow-transient): "
                  f"{'; '.join(transient)}", highlight=False)
    text = fitted.to_toml()
    write_atomically(out_path, lambda f: f.write(text.encode()))

    table = Table(title=f"{name}: fitted to {m.kind} in {Path(args.measurements).name}", title_justify="left")
    table.add_column("coefficient")
    table.add_column("value", justify="right")
    table.add_column("")
    table.add_column("what it costs")
    for term in TERMS:
        how = "fitted" if term in report.free else ("fixed" if term in fixed else "prior")
        if term == "context_token_s" and attention is not None:
            how = "measured"
        table.add_row(term, _ms(getattr(fitted, term)), how, TERM_HELP[term])
    out.print(table)
    if m.kind == "points":
        _print_points(out, report)
    for label, errors in (("fit", report.train_error), ("held back", report.holdout_error)):
        parts = [f"{k} {v:.1%}" if "ape" in k or "error" in k else f"{k} {v:,}"
                 for k, v in errors.items() if v == v]
        out.print(f"[dim]error on the {label} rows: {', '.join(parts) or 'none'}[/dim]", highlight=False)
    for other in args.evaluate:
        m_other, _ = calibrate.load_measurements(other)
        errors = calibrate.evaluate(m_other, fitted, spec)
        fit_info.setdefault("evaluated", {})[Path(other).name] = errors
        parts = [f"{k} {v:.1%}" if "ape" in k or "error" in k else f"{k} {v:,}"
                 for k, v in errors.items() if v == v]
        out.print(f"[dim]error on {Path(other).name} (not fitted): {', '.join(parts)}[/dim]",
                  highlight=False)
    if args.evaluate:
        text = replace(fitted, fit=fit_info).to_toml()
        write_atomically(out_path, lambda f: f.write(text.encode()))
    out.print(f"wrote {out_path}")
    return 0
