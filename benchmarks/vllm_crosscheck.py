"""fragsim's vLLM plan against vLLM 0.33.0's own planning and KV cache manager.

For each model (presets, or config.json files given with --model), fragsim's layer
pages go to ``vllm_reference.py``, which builds vLLM's real KV cache specs from them
and runs vLLM's grouping, sizing, concurrency and ``allocate_slots``; the figures
must agree exactly. The block size is fragsim's choice, handed to vLLM as decided
(vLLM's backend selection needs a GPU), so this checks the planning, not the
backend table.

    python benchmarks/vllm_crosscheck.py --vllm-python /path/to/vllm-venv/bin/python
    python benchmarks/vllm_crosscheck.py --vllm-python ... --trace azure-conv

With ``--trace``, each model's ``vllm-hybrid`` run on that trace is recorded step by
step (exact steps, each batched growth as the extends it stands for), every
allocate, extend and free its engine made, and the same operations are replayed on
one vLLM KVCacheManager: whether each succeeded, the blocks each group holds for
the request and the pool's free blocks must agree after every operation (the free
count is not compared while a failed extension waits for its retry: vLLM has
already dropped that request's skipped blocks, fragsim's manager drops them on the
retry).

With ``--prefix-caching`` (a trace with content hashes, e.g. Mooncake's
conversation trace), the run is ``vllm-hybrid`` with prefix caching and vLLM's
manager gets ``enable_caching=True``: each admission first asks vLLM's
``get_computed_blocks`` with fragsim's prompt-block keys as the request's block
hashes, and the tokens hit must agree as well; the blocks fragsim registers at
the end of a step are registered with vLLM's ``cache_blocks`` at the same point
(``allocate_slots`` is told to delay its own caching). A failed extension frees
its window's blocks in both, so free counts are compared after every operation.

With ``--from-config``, vLLM builds the specs itself from each model's config.json
instead (``vllm_crosscheck_config.py``, through ``vllm_reference_config.py``): the
specs fragsim hands over here are then checked too.

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_crosscheck_config import add_arguments, from_config_main  # noqa: E402

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


TRACE_MODELS = ["gpt-oss-20b", "gemma-3-27b", "jamba-mini-1.5", "nemotron-h-8b", "qwen3-next-80b-a3b"]
#: with --prefix-caching: the hybrids whose kinds all hit (state layers are not modelled)
PREFIX_MODELS = ["gpt-oss-20b", "gemma-3-27b"]


def record_run(model_name: str, gpu_name: str, trace: str, num_requests: int, pool: int,
               max_seq_len: int, prefix_caching: bool = False) -> tuple[VllmPlan, list[list], list[list]]:
    """A vllm-hybrid run's manager operations and its state after each one (with
    prefix caching, an admission's state ends with the tokens it hit)."""
    from fragsim.simulate import RunSpec, load_workload, make_engine

    ops: list[list] = []
    states: list[list] = []
    asked: list = [[], 0, 0]   # the last lookup: keys, max_len, tokens hit

    def record(op: list, ok: bool, seq: int) -> None:
        """The manager's operation and its state after it (``HybridManager.on_op``)."""
        if op[0] == "l":
            asked[:] = op[1:]
            return
        held = m.blocks_held(seq) if seq in m.state.live else [0] * len(m.rows)
        if not prefix_caching:
            ops.append(op)
            states.append([ok, m.num_free_blocks(), held])
            return
        tokens = None
        if op[0] == "a":
            prompt = op[4] if op[4] is not None else op[2] - 1
            op = op[:4] + [asked[0], asked[1], prompt]
            tokens = asked[2]
        ops.append(op)
        states.append([ok, m.num_free_blocks(), held, tokens])

    spec = RunSpec(trace=trace, model=model_name, gpu=gpu_name, max_seq_len=max_seq_len,
                   num_requests=num_requests, kv_cache_memory_bytes=pool, exact_steps=True,
                   tp=8 if get_model(model_name).weight_bytes > 100e9 else 1,
                   prefix_caching=prefix_caching,
                   max_num_batched_tokens=8192 if prefix_caching else None)
    engine = make_engine(load_workload(spec), "vllm-hybrid", spec)
    m = engine.kv.manager  # type: ignore[attr-defined]
    m.on_op = record
    engine.run()
    return m.plan, ops, states


def compare_replay(ours: list[list], theirs: list[list], ops: list[list],
                   caching: bool = False) -> list[str]:
    bad: list[str] = []
    pending: set[int] = set()
    for i, (op, a, b) in enumerate(zip(ops, ours, theirs, strict=True)):
        seq = op[1]
        if caching:
            # Window blocks go back before a failed check in both: every field, every op.
            if a != b:
                shown = op[:4] + ([f"{len(op[4])} keys", op[5]] if op[0] == "a" else [])
                bad.append(f"op {i} {shown}: fragsim {a} != vLLM {b}")
                if len(bad) >= 5:
                    break
            continue
        if op[0] == "e":
            if a[0]:
                pending.discard(seq)
            else:
                pending.add(seq)
        elif op[0] == "f":
            pending.discard(seq)
        if a[0] != b[0] or a[2] != b[2] or (not pending and a[1] != b[1]):
            bad.append(f"op {i} {op}: fragsim {a} != vLLM {b}")
            if len(bad) >= 5:
                break
    return bad


def trace_main(args: argparse.Namespace) -> int:
    failures = 0
    caching = bool(args.prefix_caching)
    for name in args.model or (PREFIX_MODELS if caching else TRACE_MODELS):
        plan, ops, states = record_run(name, args.gpu, args.trace, args.num_requests,
                                       int(args.memory_gib * 2**30), args.max_model_len, caching)
        model = get_model(name)
        tp = 8 if model.weight_bytes > 100e9 else 1
        inp = reference_input(model, plan, tp)
        inp["seq_lens"] = []
        inp["ops"] = ops
        inp["replay_caching"] = caching
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(inp, f)
        run = subprocess.run([args.vllm_python, str(HERE / "vllm_reference.py"), f.name],
                             capture_output=True, text=True)
        if run.returncode:
            print(f"ERROR {name}: {run.stderr.strip().splitlines()[-1]}")
            failures += 1
            continue
        ref = json.loads(run.stdout)
        theirs = ref["replay"] if caching else [r[:3] for r in ref["replay"]]
        bad = compare(plan, ref) + compare_replay(states, theirs, ops, caching)
        failures += bool(bad)
        failed = sum(1 for s in states if not s[0])
        counts = {k: sum(1 for op in ops if op[0] == k) for k in "aecf"}
        hits = [s[3] for op, s in zip(ops, states, strict=True) if caching and op[0] == "a" and s[0]]
        extra = (f" ({counts['a']:,} admissions, {counts['e']:,} extends, {counts['c']:,} cache "
                 f"registrations, {counts['f']:,} frees; {sum(1 for h in hits if h):,} admissions hit, "
                 f"{sum(hits):,} tokens)") if caching else ""
        print(f"{'ok  ' if not bad else 'DIFF'} {name} on {args.trace} ({args.num_requests} requests, "
              f"{args.memory_gib:g} GiB): {len(ops):,} operations{extra}, {failed:,} refused for lack of "
              f"blocks, {len(plan.groups)} groups" + "".join(f"\n     {b}" for b in bad))
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", required=True, help="python of a virtualenv with vllm==0.33.0")
    ap.add_argument("--model", action="append", help="preset or config.json (default: the hybrid presets)")
    ap.add_argument("--gpu", default="h200-141gb")
    ap.add_argument("--memory-gib", type=float, default=40.0, help="KV cache memory (default 40)")
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--trace", help="replay a vllm-hybrid run on this trace through vLLM's manager")
    ap.add_argument("--num-requests", type=int, default=300, help="with --trace (default 300)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="with --trace: prefix caching on both sides, hits compared too (a trace with "
                         "content hashes, e.g. mooncake_conversation.jsonl)")
    ap.add_argument("--from-config", action="store_true",
                    help="vLLM builds the specs itself from each config.json (presets and "
                         "tests/fixtures/configs/ by default)")
    add_arguments(ap)
    args = ap.parse_args()
    if args.from_config:
        return from_config_main(args)
    if args.trace:
        return trace_main(args)
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
