"""Every CUDA check in one script, for one GPU, in under 8 minutes.

    python benchmarks/gpu_check.py OUT_DIR            # writes OUT_DIR/report.json and figures

1. ``fragsim validate --device cuda`` for every allocator on a 300-request slice of
   azure-conv with a 13B-shaped pool (40 KV heads, head_dim 128, 2 layers): the
   measured split must equal the simulated one at every step.
2. Decode-attention throughput of the paged and contiguous Triton kernels in GB/s
   against the device's measured copy bandwidth, batch 1/16/64 × context
   512/2048/8192, llama-2-7b heads, fp16 (``triton.testing.do_bench``). Targets:
   paged >= 70% of copy bandwidth at batch 64 × 2048, and within 10% of contiguous.
   ``OUT_DIR/kernels.json`` feeds the step-cost fit's attention term:
   ``fragsim calibrate STEPS --model M --gpu G --attention-times OUT_DIR/kernels.json``.
3. The PyTorch caching-allocator model against PyTorch's real allocator.
4. Hybrid models on real memory: ``fragsim validate --device cuda`` for every hybrid
   KV manager on a gpt-oss-shaped miniature (sliding 128 + full, 8 KV heads × 64) and
   a Mamba-hybrid-shaped one (Nemotron-H: Mamba-2 + full), each pool laid out as its
   manager lays it; the byte split per row and category must agree at every step.
5. The windowed Triton kernels (sliding window, chunked local, MLA) in GB/s against
   the copy bandwidth, reading a pool laid out as vLLM's hybrid manager lays it
   (K and V of a block side by side in one page: a block stride, not a slot stride).

Part 2b sweeps the decode kernels' launch knobs (tile, warps, pipeline stages) at
batch 64 × 2048 and 16 × 8192 and names the fastest (``kernel_sweep.json``).

Each part has its own time budget and its own entry in the report; a part that
fails or runs out of time is recorded as such and the others still run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

#: in the order they are validated: when the budget runs out, the ones that matter most
#: ran (ft-static's request-level batching takes the most steps, so it goes last)
ALLOCATORS = ["vllm", "orca-oracle", "orca-pow2", "orca-max", "contiguous", "ft-static"]


def part_validate(out: Path, budget_s: float, num_requests: int,
                  allocators: list[str] | None = None) -> dict[str, Any]:
    from fragsim.simulate import RunSpec
    from gpu_backend.validate import ModelShape, run_validation

    shape = ModelShape(num_layers=2, num_q_heads=40, num_kv_heads=40, head_dim=128, dtype="float16")
    spec = RunSpec(trace="azure-conv", model="llama-2-13b", gpu="a100-40gb", num_requests=num_requests)
    rows, deadline = [], time.monotonic() + budget_s
    for name in [a for a in ALLOCATORS if not allocators or a in allocators]:
        if time.monotonic() > deadline:
            rows.append({"allocator": name, "skipped": "time budget spent"})
            continue
        report = run_validation(spec, name, device="cuda", shape=shape, attention_every=4)
        rows.append(report.to_dict())
        print(f"validate {name}: {'agree' if report.ok else 'MISMATCH'} "
              f"({report.steps_checked} steps, {report.wall_time_s:.1f} s)", flush=True)
    (out / "validate.json").write_text(json.dumps(rows, indent=1, default=str))
    ok = all(r.get("ok") for r in rows if "skipped" not in r)
    return {"ok": ok, "allocators": rows}


def part_kernels(out: Path) -> dict[str, Any]:
    import torch

    from gpu_backend.kernel_bench import bench_decode_attention, format_table

    rows = bench_decode_attention("cuda", (1, 16, 64), (512, 2048, 8192), 32, 32, 128, 16, torch.float16)
    print(format_table(rows), flush=True)
    (out / "kernels.json").write_text(json.dumps(rows, indent=1, default=str))
    target = _kernel_targets(rows)
    _plot_kernels(rows, out / "kernels.png")
    return {"rows": rows, **target}


def _kernel_targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def find(layout: str) -> dict[str, Any] | None:
        return next((r for r in rows if r.get("layout") == layout and r.get("batch") == 64
                     and r.get("context") == 2048), None)

    paged, contiguous = find("paged"), find("contiguous")
    if not paged or not contiguous:
        return {"targets_met": None}
    frac = paged["gbps"] / paged["copy_gbps"]
    gap = 1 - paged["gbps"] / contiguous["gbps"]
    return {"paged_fraction_of_copy_64x2048": frac, "paged_gap_to_contiguous_64x2048": gap,
            "targets_met": bool(frac >= 0.7 and gap <= 0.1)}


def _plot_kernels(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["batch"], r["context"]) for r in rows})
    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.4
    for i, layout in enumerate(("contiguous", "paged")):
        vals = [next((r["gbps"] for r in rows if r["layout"] == layout and (r["batch"], r["context"]) == c), 0)
                for c in cases]
        ax.bar([j + (i - 0.5) * width for j in range(len(cases))], vals, width, label=layout)
    if rows:
        ax.axhline(rows[0]["copy_gbps"], color="black", linestyle="--", label="copy bandwidth")
    ax.set_xticks(range(len(cases)), [f"b{b}\nctx{c}" for b, c in cases], fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title("Decode attention, llama-2-7b heads, fp16")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


#: the knobs part 2b tries on the cases that miss the target
SWEEP_GRID = {"block_n": (64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4)}


def part_kernel_sweep(out: Path) -> dict[str, Any]:
    """Which launch knobs read the pool fastest at batch 64 × 2048 and 16 × 8192."""
    from gpu_backend.kernel_bench import sweep_decode_attention

    rows = sweep_decode_attention("cuda", grid=SWEEP_GRID)
    (out / "kernel_sweep.json").write_text(json.dumps(rows, indent=1, default=str))
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        key = f"{r['layout']} b{r['batch']} ctx{r['context']}"
        if "gbps" in r and r["gbps"] > best.get(key, {}).get("gbps", 0):
            best[key] = r
    for key, r in best.items():
        knobs = ", ".join(f"{k}={r[k]}" for k in SWEEP_GRID)
        print(f"sweep best {key}: {r['gbps']:.0f} GB/s ({100 * r['frac_of_copy']:.1f}% of copy) "
              f"with {knobs}", flush=True)
    return {"best": best, "errors": sum("error" in r for r in rows)}


HYBRID_MANAGERS = ["vllm-hybrid", "jenga", "static-partition", "paged-uniform"]


def part_hybrid_validate(out: Path, budget_s: float, num_requests: int,
                         managers: list[str] | None = None) -> dict[str, Any]:
    from fragsim.simulate import RunSpec
    from gpu_backend.validate import (
        CUDA_HYBRID_SCALE,
        CUDA_HYBRID_SHAPES,
        HybridShape,
        run_hybrid_validation,
    )

    rows, deadline = [], time.monotonic() + budget_s
    # manager by manager, every model for each: a budget that runs out still saw every model
    for name in [m for m in HYBRID_MANAGERS if not managers or m in managers]:
        for model, shape, pool_bytes in CUDA_HYBRID_SHAPES:
            spec = RunSpec(trace="azure-conv", model=model, gpu="h100-80gb", num_requests=num_requests,
                           max_seq_len=4096, rate=20.0)
            if time.monotonic() > deadline:
                rows.append({"model": model, "allocator": name, "skipped": "time budget spent"})
                continue
            try:
                report = run_hybrid_validation(spec, name, device="cuda", shape=HybridShape(**shape),
                                               scale=CUDA_HYBRID_SCALE, attention_every=2,
                                               pool_bytes=pool_bytes)
            except ValueError as exc:   # a pool too small for the manager's layout
                rows.append({"model": model, "allocator": name, "skipped": str(exc)})
                continue
            rows.append({"model": model, **report.to_dict()})
            print(f"validate {model} {name}: {'agree' if report.ok else 'MISMATCH'} "
                  f"({report.steps_checked} steps, {report.wall_time_s:.1f} s)", flush=True)
    (out / "hybrid_validate.json").write_text(json.dumps(rows, indent=1, default=str))
    ok = all(r.get("ok") for r in rows if "skipped" not in r)
    return {"ok": ok, "runs": rows}


def part_window_kernels(out: Path) -> dict[str, Any]:
    from gpu_backend.window_bench import bench_window_attention, format_table

    rows = bench_window_attention("cuda")
    print(format_table(rows), flush=True)
    (out / "window_kernels.json").write_text(json.dumps(rows, indent=1, default=str))
    _plot_window(rows, out / "window_kernels.png")
    return {"rows": rows}


def _plot_window(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(f"{r['kind']} {r['span'] or ''}".strip() for r in rows))
    cases = sorted({(r["batch"], r["context"]) for r in rows})
    fig, ax = plt.subplots(figsize=(10, 3.8))
    width = 0.8 / max(1, len(kinds))
    for i, kind in enumerate(kinds):
        vals = [next((r["gbps"] for r in rows if f"{r['kind']} {r['span'] or ''}".strip() == kind
                      and (r["batch"], r["context"]) == c), 0) for c in cases]
        ax.bar([j + (i - len(kinds) / 2 + 0.5) * width for j in range(len(cases))], vals, width, label=kind)
    if rows:
        ax.axhline(rows[0]["copy_gbps"], color="black", linestyle="--", label="copy bandwidth")
    ax.set_xticks(range(len(cases)), [f"b{b}\nctx{c}" for b, c in cases], fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title("Windowed and MLA decode attention over a hybrid pool's pages, fp16")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def part_native_caching(out: Path) -> dict[str, Any]:
    from gpu_backend import native_caching

    folder = out / "native_caching"
    folder.mkdir(exist_ok=True)
    code = native_caching.main(["--workload", "rag-longtail", "--hours", "0.05", "--out", str(folder)])
    return {"exit_code": code, "folder": str(folder)}


PARTS = ("native_caching", "kernels", "kernel_sweep", "window_kernels", "validate", "hybrid_validate")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="folder for report.json and the figures")
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--validate-budget", type=float, default=180.0, help="seconds for part 1")
    parser.add_argument("--hybrid-budget", type=float, default=90.0, help="seconds for part 4")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts to run (default: all of {', '.join(PARTS)})")
    parser.add_argument("--allocators", default="",
                        help="comma-separated dense allocators and hybrid KV managers to validate "
                             "(default: all); lets a second run finish what a budget left out")
    args = parser.parse_args(argv)
    wanted = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(wanted) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown part(s) {', '.join(unknown)}; allowed: {', '.join(PARTS)}")
    chosen = [a.strip() for a in args.allocators.split(",") if a.strip()] or None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    parts = [("native_caching", lambda: part_native_caching(out)),
             ("kernels", lambda: part_kernels(out)),
             ("kernel_sweep", lambda: part_kernel_sweep(out)),
             ("window_kernels", lambda: part_window_kernels(out)),
             ("validate", lambda: part_validate(out, args.validate_budget, args.num_requests, chosen)),
             ("hybrid_validate", lambda: part_hybrid_validate(out, args.hybrid_budget, 120, chosen))]
    for name, fn in parts:
        if name not in wanted:
            continue
        t0 = time.perf_counter()
        try:
            report[name] = fn()
        except Exception:  # noqa: BLE001 - every part reports, whatever breaks
            report[name] = {"error": traceback.format_exc()}
        report[name]["wall_s"] = round(time.perf_counter() - t0, 1)
        (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
        print(f"{name}: {report[name]['wall_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
