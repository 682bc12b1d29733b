"""The cross-check end to end: vLLM builds the KV cache specs itself from the same
config.json that fragsim plans.

``vllm_crosscheck.py`` hands fragsim's own layer pages to vLLM, so a spec fragsim
gets wrong goes in on both sides. Here ``vllm_reference_config.py`` gives vLLM 0.33.0
only the config.json and the serving options: vLLM's ModelConfig reads the file, its
model class is built on the meta device, its layers make their own specs, and its
platform code sizes the blocks (for an H200). Then its grouping, sizing, capacity and
``allocate_slots`` run as in ``vllm_crosscheck.py``, and every figure is compared
with fragsim's plan of the same file on an H200:

    groups (kind, layers, block size, page), block size, state block size,
    num_gpu_blocks, bytes per block, tokens in flight, the blocks a request may need
    in each group, the maximum concurrency and the "GPU KV cache size" in tokens,
    the blocks held after a prompt's step and after a decode step at each length

    python benchmarks/vllm_crosscheck.py --vllm-python /path/to/venv/bin/python --from-config
    python benchmarks/vllm_crosscheck.py --vllm-python ... --from-config \\
        --model fragsim/model_configs/nemotron-h-56b.json --max-model-len 8192 --memory-gib 60

The models are the presets and every config.json in tests/fixtures/configs/ (or the
``--model`` names and paths given), each with prefix caching on and off and with
each ``--kv-dtypes``; a model whose block grows for its state layers is also run at
a max model length of 2 and 3 times that block. Every case is tensor parallel 1.
Prints one line per case and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fragsim.catalog import get_gpu, get_model, with_kv_cache_dtype
from fragsim.vllm_plan import VllmPlan, plan_vllm

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "tests" / "fixtures" / "configs"
SEQ_LENS = [1, 127, 128, 129, 1000, 1040, 4096, 8192, 10000]
_VLLM_KINDS = {"full_attention": "full", "sliding_window": "sliding", "chunked_local_attention": "chunked",
               "mla_attention": "mla", "mamba": "mamba"}


def config_of(name: str) -> dict[str, Any]:
    """The config.json of a path (the file or its folder) or of a preset."""
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.exists():
        return dict(json.loads(path.read_text()))
    from fragsim import presets

    bundled = presets.FILES / f"{name}.json"
    if bundled.exists():
        return dict(json.loads(bundled.read_text()))
    return dict(presets.COPIED[name][0])


def default_models() -> list[str]:
    from fragsim import presets

    files = sorted(str(p.relative_to(Path.cwd()) if p.is_relative_to(Path.cwd()) else p)
                   for p in FIXTURES.glob("*.json"))
    return list(presets.ORDER) + files


def _boundary_lens(block: int, max_len: int) -> list[int]:
    lens = {n for n in SEQ_LENS} | {k * block + d for k in (1, 2) for d in (-1, 0, 1)}
    return sorted(n for n in lens if 1 <= n < max_len)


def cases_of(name: str, gpu, kv_dtypes: list[str], max_model_len: int, memory: int,
             max_num_batched_tokens: int) -> list[tuple[str, VllmPlan, dict[str, Any]]]:
    """Every case of one model: fragsim's plan and the reference's input."""
    raw = config_of(name)
    base = get_model(name)
    out = []
    for dtype in kv_dtypes:
        model = with_kv_cache_dtype(base, dtype)
        for prefix in (True, False):
            lens = [min(max_model_len, model.max_position_embeddings)]
            first = plan_vllm(model, gpu, memory, max_model_len=lens[0], prefix_caching=prefix,
                              max_num_batched_tokens=max_num_batched_tokens)
            if first.mamba_block_size is not None and first.block_size > 16:
                lens += [2 * first.block_size, 3 * first.block_size]
            # chunked local attention: fragsim's default, and the hybrid manager kept on
            # and turned off (VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1 / 0)
            hybrids = [None, True, False] if any(la.kind == "chunked" for la in model.layer_specs) else [None]
            for mml in lens:
                for hybrid in hybrids:
                    plan = plan_vllm(model, gpu, memory, max_model_len=mml, prefix_caching=prefix,
                                     max_num_batched_tokens=max_num_batched_tokens, hybrid_manager=hybrid)
                    label = f"{name} kv={dtype} prefix={'on' if prefix else 'off'} len={mml:,}"
                    if hybrid is not None:
                        label += f" hybrid-chunked={int(hybrid)}"
                    case = {"config": raw, "max_model_len": mml, "enable_prefix_caching": prefix,
                            "max_num_batched_tokens": plan.max_num_batched_tokens,
                            "kv_cache_dtype": dtype, "available_memory": memory,
                            "hybrid_chunked": hybrid,
                            "seq_lens": _boundary_lens(plan.block_size, mml)}
                    out.append((label, plan, case))
    return out


def _ranks(kinds: list[str], groups: list[list[int]]) -> list[list[int]]:
    """Each group's layers as their places among the layers of its kind: vLLM numbers
    a model's layers its own way (MLP-only layers counted in Nemotron-H, Falcon-H1's
    Mamba mixers after every attention layer), fragsim its cache-holding layers in order."""
    of_kind: dict[str, list[int]] = {}
    for kind, layers in zip(kinds, groups, strict=True):
        of_kind.setdefault(kind, []).extend(layers)
    rank = {kind: {n: i for i, n in enumerate(sorted(ns))} for kind, ns in of_kind.items()}
    return [sorted(rank[kind][n] for n in layers) for kind, layers in zip(kinds, groups, strict=True)]


def _vllm_layers(ref: dict[str, Any]) -> list[list[int]]:
    return _ranks([g["kind"] for g in ref["groups"]],
                  [[int(m.group(1)) for n in g["layer_names"] if (m := re.search(r"\.(\d+)\.", n))]
                   for g in ref["groups"]])


def compare(plan: VllmPlan, ref: dict[str, Any]) -> list[str]:
    """Every figure that differs, as 'what: fragsim != vLLM'."""
    bad = []
    ours = [("mamba" if g.page.base == "mamba" else g.page.kind, layers, g.page.block_size,
             g.page.page_size_bytes)
            for g, layers in zip(plan.groups, _ranks([g.page.base for g in plan.groups],
                                                     [list(g.layers) for g in plan.groups]), strict=True)]
    theirs = [(_VLLM_KINDS.get(g["kind"], g["kind"]), layers, g["block_size"], g["page_size_bytes"])
              for g, layers in zip(ref["groups"], _vllm_layers(ref), strict=True)]
    if sorted(ours) != sorted(theirs):
        bad.append(f"groups {ours} != {theirs}")
    mine = {(o[0], tuple(o[1])): plan.rule(g).max_blocks(plan.max_model_len, g.page.block_size,
                                                          plan.in_flight_tokens)
            for o, g in zip(ours, plan.groups, strict=True)}
    vllm = {(t[0], tuple(t[1])): g["max_blocks_per_request"] for t, g in zip(theirs, ref["groups"], strict=True)}
    if mine != vllm:
        bad.append(f"blocks a request may need, by group {sorted(mine.values())} != {sorted(vllm.values())}")
    figures = [("block_size", plan.block_size, ref["block_size"]),
               ("mamba_block_size", plan.mamba_block_size, ref["mamba_block_size"]),
               ("in_flight_tokens", plan.in_flight_tokens, ref["max_in_flight_tokens"]),
               ("bytes_per_block", plan.bytes_per_block, ref["bytes_per_block"]),
               ("num_gpu_blocks", plan.num_gpu_blocks, ref["num_blocks"]),
               ("blocks_per_request", plan.blocks_per_request, sum(vllm.values())),
               ("kv_cache_tokens", plan.kv_cache_tokens, ref["kv_cache_tokens"])]
    bad += [f"{name} {a} != {b}" for name, a, b in figures if a != b]
    if abs(plan.max_concurrency - ref["max_concurrency"]) > 1e-9 * max(1.0, ref["max_concurrency"]):
        bad.append(f"max_concurrency {plan.max_concurrency} != {ref['max_concurrency']}")
    order = [ours.index(t) if t in ours else 0 for t in theirs]    # fragsim's group of each of vLLM's
    for what, ours_at, theirs_at in (("prompt", plan.blocks_at_prompt, ref["blocks_at_prompt"]),
                                     ("decode", plan.blocks_per_seq, ref["blocks_per_seq"])):
        for n, held in theirs_at.items():
            mine_at = [ours_at(int(n))[i] for i in order]
            if mine_at != held:
                bad.append(f"blocks held at {what} {n}: {mine_at} != {held}")
    return bad


def _run(vllm_python: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reference's answer for each case (an error where it has none)."""
    if not cases:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp, "cases.json"), Path(tmp, "answers.jsonl")
        inp.write_text(json.dumps({"cases": cases}))
        run = subprocess.run([vllm_python, str(HERE / "vllm_reference_config.py"), str(inp), str(out)],
                             capture_output=True, text=True)
        answers = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    tail = (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]
    return answers + [{"error": f"the reference stopped: {tail}"}] * (len(cases) - len(answers))


def from_config_main(args: argparse.Namespace) -> int:
    gpu = get_gpu(args.gpu)
    if gpu.arch != "sm90":
        print(f"--from-config: the reference answers as an H200 (sm90); {args.gpu} is {gpu.arch}",
              file=sys.stderr)
        return 2
    memory = int(args.memory_gib * 2**30)
    all_cases = []
    for name in args.model or default_models():
        try:
            all_cases += cases_of(name, gpu, args.kv_dtypes.split(","), args.max_model_len, memory,
                                  args.max_num_batched_tokens)
        except Exception as e:  # noqa: BLE001 - one model fragsim cannot read is one error line
            all_cases.append((f"{name}", None, {"error": f"fragsim: {type(e).__name__}: {e}"}))
    runnable = [c for c in all_cases if c[1] is not None]
    chunks = [runnable[i::args.jobs] for i in range(args.jobs)]
    with ThreadPoolExecutor(args.jobs) as pool:
        answers = list(pool.map(lambda chunk: _run(args.vllm_python, [c[2] for c in chunk]), chunks))
    refs = {id(case[2]): ans for chunk, got in zip(chunks, answers, strict=True)
            for case, ans in zip(chunk, got, strict=True)}
    failures = agree = 0
    for label, plan, case in all_cases:
        ref = refs.get(id(case), case)
        if "error" in ref:
            print(f"ERROR {label}: {ref['error'].splitlines()[0][:300]}")
            failures += 1
            continue
        bad = compare(plan, ref)
        failures += bool(bad)
        agree += not bad
        print(f"{'ok  ' if not bad else 'DIFF'} {label}: {len(plan.groups)} groups, block "
              f"{plan.block_size:,}, {plan.num_gpu_blocks:,} blocks, {plan.blocks_per_request:,} a request, "
              f"{plan.max_concurrency:.2f}x, {plan.kv_cache_tokens:,} tokens "
              f"[vLLM: {', '.join(ref['attention_backends'])}"
              + (f"; {ref['weight_quantization_dropped']} weights read unquantized"
                 if ref["weight_quantization_dropped"] else "")
              + "]" + "".join(f"\n     {b}" for b in bad))
    print(f"{agree} of {len(all_cases)} cases agree")
    return 1 if failures else 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--kv-dtypes", default="auto,fp8", help="with --from-config: KV cache dtypes (default auto,fp8)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="with --from-config (default: vllm serve's for the card)")
    ap.add_argument("--jobs", type=int, default=4, help="with --from-config: reference processes (default 4)")


if __name__ == "__main__":
    sys.exit("run it as: python benchmarks/vllm_crosscheck.py --from-config ...")
