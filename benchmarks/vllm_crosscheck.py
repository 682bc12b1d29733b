"""fragsim's vLLM plan against vLLM 0.33.0's own planning and KV cache manager.

For each model (presets, or config.json files given with --model), fragsim's layer
pages go to ``vllm_reference.py``, which builds vLLM's real KV cache specs from them
and runs vLLM's grouping, sizing, concurrency and ``allocate_slots``; the figures
must agree exactly. The block size is fragsim's choice, handed to vLLM as decided
(vLLM's backend selection needs a GPU), so this checks the planning, not the
backend table.

    python benchmarks/vllm_crosscheck.py --vllm-python /path/to/vllm-venv/bin/python

Prints one line per case and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from fragsim.catalog import get_gpu, get_model, with_kv_cache_dtype
from fragsim.vllm_plan import VllmPlan, plan_vllm

HERE = Path(__file__).resolve().parent
MODELS = ["llama-3.1-8b", "mistral-7b-v0.1", "gemma-2-9b", "gemma-3-27b", "gpt-oss-20b",
          "gpt-oss-120b", "llama-4-scout", "deepseek-v3", "qwen3-next-80b-a3b",
          "jamba-mini-1.5", "nemotron-h-8b"]
SEQ_LENS = [1, 127, 128, 129, 1000, 1040, 4096, 8192, 10000]
_STATE_DTYPE = {2: "bfloat16", 4: "float32"}


def reference_input(model, plan: VllmPlan, tp: int) -> dict:
    kv = "fp8" if model.kv_dtype_bytes == 1 else "bfloat16"
    layers = []
    for layer in model.layer_specs:
        if layer.kind == "shared":
            continue
        if layer.state is not None:
            tensors = layer.state.tensors(model.dtype_bytes, tp)
            pad = next(g.page.page_padded for g in plan.groups if g.page.base == "mamba")
            layers.append({"kind": "mamba", "shapes": [list(s) for s, _ in tensors],
                           "dtypes": [_STATE_DTYPE[b] for _, b in tensors], "page_size_padded": pad,
                           "mamba_cache_mode": "align" if plan.prefix_caching else "none",
                           "num_prefill_checkpoint_blocks": plan.num_prefill_checkpoint_blocks})
            continue
        layers.append({"kind": layer.kind, "num_kv_heads": layer.kv_heads_per_gpu(tp),
                       "head_size": layer.head_size(), "dtype": kv, "window": layer.window,
                       "chunk": layer.chunk})
    return {"layers": layers, "block_size": plan.block_size,
            "mamba_block_size": plan.mamba_block_size or plan.block_size,
            "available_memory": plan.kv_cache_memory_bytes, "max_model_len": plan.max_model_len,
            "max_num_batched_tokens": plan.max_num_batched_tokens,
            "max_in_flight_tokens": plan.in_flight_tokens,
            "disable_hybrid_kv_cache_manager": not plan.hybrid_manager,
            "enable_prefix_caching": plan.prefix_caching,
            "seq_lens": [n for n in SEQ_LENS if n < plan.max_model_len]}


def compare(plan: VllmPlan, ref: dict) -> list[str]:
    bad = []
    ours = [(g.num_layers, g.page.block_size, g.page.page_size_bytes) for g in plan.groups]
    theirs = [(g["num_layers"], g["block_size"], g["page_size_bytes"]) for g in ref["groups"]]
    if ours != theirs:
        bad.append(f"groups {ours} != {theirs}")
    for name, mine, vllm in [("bytes_per_block", plan.bytes_per_block, ref["bytes_per_block"]),
                             ("num_blocks", plan.num_gpu_blocks, ref["num_blocks"]),
                             ("kv_cache_tokens", plan.kv_cache_tokens, ref["kv_cache_tokens"])]:
        if mine != vllm:
            bad.append(f"{name} {mine} != {vllm}")
    if abs(plan.max_concurrency - ref["max_concurrency"]) > 1e-9 * max(1.0, ref["max_concurrency"]):
        bad.append(f"max_concurrency {plan.max_concurrency} != {ref['max_concurrency']}")
    for n, held in ref["blocks_per_seq"].items():
        if plan.blocks_per_seq(int(n)) != held:
            bad.append(f"blocks at {n}: {plan.blocks_per_seq(int(n))} != {held}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", required=True, help="python of a virtualenv with vllm==0.33.0")
    ap.add_argument("--model", action="append", help="preset or config.json (default: the hybrid presets)")
    ap.add_argument("--gpu", default="h200-141gb")
    ap.add_argument("--memory-gib", type=float, default=40.0, help="KV cache memory (default 40)")
    ap.add_argument("--max-model-len", type=int, default=32768)
    args = ap.parse_args()
    gpu = get_gpu(args.gpu)
    failures = 0
    for name in args.model or MODELS:
        for dtype in ("auto", "fp8"):
            for prefix in (True, False):
                model = with_kv_cache_dtype(get_model(name), dtype)
                tp = 8 if model.weight_bytes > 400e9 else 1
                for hybrid in ([None, True] if any(la.kind == "chunked" for la in model.layer_specs)
                               else [None]):
                    plan = plan_vllm(model, gpu, int(args.memory_gib * 2**30), tp=tp,
                                     max_model_len=args.max_model_len, prefix_caching=prefix,
                                     hybrid_manager=hybrid)
                    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                        json.dump(reference_input(model, plan, tp), f)
                    run = subprocess.run([args.vllm_python, str(HERE / "vllm_reference.py"), f.name],
                                         capture_output=True, text=True)
                    label = (f"{name} kv={dtype} prefix={'on' if prefix else 'off'}"
                             f"{' hybrid-chunked' if hybrid else ''}")
                    if run.returncode:
                        print(f"ERROR {label}: {run.stderr.strip().splitlines()[-1]}")
                        failures += 1
                        continue
                    bad = compare(plan, json.loads(run.stdout))
                    failures += bool(bad)
                    print(f"{'ok  ' if not bad else 'DIFF'} {label}: {len(plan.groups)} groups, "
                          f"block {plan.block_size}, {plan.num_gpu_blocks:,} blocks, "
                          f"{plan.max_concurrency:.3f}x" + ("".join(f"\n     {b}" for b in bad)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
