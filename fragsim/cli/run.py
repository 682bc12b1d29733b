"""``fragsim run``: replay a trace against allocators and compare where the memory goes."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

from fragsim.cli.args import positive_float, positive_int

DESCRIPTION = """\
Replay a request trace against one or more KV-cache allocators and print the
vLLM-paper Figure-2 split of KV memory (token states / reservation / internal
fragmentation / free), external fragmentation, what runs, waits, is preempted or
refused, and the throughput and latency that follow.

With no options: the bundled Azure conversation trace (19,366 requests over
3,500 s) on OPT-13B and one A100-40GB, as in the vLLM paper, for ft-static,
orca-max, orca-pow2, orca-oracle and vllm."""

EPILOG = """\
allocators: a placement (static, contiguous, buddy, paged, paged-shared, vmm) or
  a preset: ft-static (static+max), orca-max / orca-pow2 / orca-oracle (buddy +
  that reservation), vllm (paged, 16-token blocks), vattention (vmm, 2 MiB pages).
  These treat every layer of a hybrid model as full attention.
hybrid KV managers, which allocate each layer kind as it needs (sliding windows
  free their old blocks, state layers hold one state): paged-uniform (every
  layer for every token, the baseline), vllm-hybrid (vLLM 0.33's hybrid KV cache
  manager), jenga (LCM large pages carved per kind), static-partition (a pool
  per kind, sized up front). Their split adds padding and out-of-window bytes.
sharing (paged allocators only): --parallel-samples N and --beam-width W decode
  N (W) sequences per prompt over shared prompt blocks; --prefix-caching reuses
  cached prompt blocks across requests (Mooncake traces carry content hashes;
  --system-prompt-len S gives every request the same first S tokens).
examples:
  fragsim run --allocator vllm,orca-oracle --num-requests 2000 --plot
  fragsim run --allocator vllm,vattention,vmm --page-kb 64
  fragsim run --allocator vllm --trace alpaca-paper --rate 20 --num-requests 2000 --beam-width 4
  fragsim run --trace sharegpt-paper --rate 2 --num-requests 1000
  fragsim run --trace path/to/trace.csv --model llama-2-7b --gpu a100-80gb --json
  fragsim run --model gpt-oss-120b --gpu h100-80gb --max-seq-len 8192 --num-requests 3000 \\
      --allocator paged-uniform,vllm-hybrid,jenga,static-partition --kv-cache-memory-bytes 8589934592 \\
      --workers 4
"""


def _window(text: str) -> tuple[float, float]:
    try:
        start, end = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:END in seconds, got {text!r}") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"need 0 <= START < END, got {text}")
    return start, end


def add_workload_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--trace", default="azure-conv",
                   help="bundled trace (azure-conv, azure-code), workload (sharegpt-paper, "
                        "alpaca-paper) or a trace file path (default: %(default)s)")
    g.add_argument("--num-requests", type=positive_int, help="keep the first N requests")
    g.add_argument("--time-window", type=_window, metavar="START:END",
                   help="keep requests arriving in [START, END) seconds")
    g.add_argument("--rate", type=positive_float, help="re-time arrivals at this many requests/s")
    g.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson",
                   help="arrival process with --rate (default: %(default)s)")
    g.add_argument("--cv", type=positive_float, default=1.0,
                   help="coefficient of variation of gamma inter-arrivals (burstiness; default 1)")
    g.add_argument("--seed", type=int, default=0, help="seed for arrivals and workloads (default 0)")


def add_system_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model, GPU and memory")
    g.add_argument("--model", default="llama-3.1-8b",
                   help="model preset, or a Hugging Face config.json (or its folder) "
                        "(default: %(default)s)")
    g.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                   help="KV cache element type: auto (the model's), fp16, bf16, fp32, fp8, "
                        "fp8_e4m3, fp8_e5m2 (default auto)")
    g.add_argument("--gpu", default="h100-80gb", help="GPU preset (default: %(default)s)")
    g.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree (default 1)")
    g.add_argument("--catalog", help="TOML file with custom models/GPUs")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory the engine may use (default 0.9)")
    g.add_argument("--kv-slots", type=positive_int, help="KV pool size in tokens (overrides the budget)")
    g.add_argument("--kv-cache-memory-bytes", type=positive_int, metavar="BYTES",
                   help="KV pool size in bytes on one GPU, as vLLM's option (overrides the budget; "
                        "dense allocators cut it into slots of every layer's KV)")
    g.add_argument("--hybrid-chunked", action="store_true",
                   help="vllm-hybrid: keep the hybrid manager for chunked local attention (Llama 4), "
                        "as VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1 does")
    g = p.add_argument_group("allocator")
    g.add_argument("--allocator", default="ft-static,orca-max,orca-pow2,orca-oracle,vllm",
                   help="comma list of allocators/presets (default: %(default)s)")
    g.add_argument("--reserve", choices=("max", "pow2", "oracle"),
                   help="reservation policy for plain static/contiguous/buddy placements")
    g.add_argument("--block-size", type=positive_int, default=16, help="paged block size (default 16)")
    g.add_argument("--page-kb", type=int, choices=(64, 128, 256, 2048), default=2048,
                   help="vmm physical page in KiB (default 2048; vattention is 2048 unless given)")
    g.add_argument("--fit", choices=("first", "best"), default="first", help="contiguous placement fit")
    g = p.add_argument_group("scheduler")
    g.add_argument("--max-seq-len", type=positive_int,
                   help="longest prompt+output a request may have (default: the model's context, "
                        "as vLLM's max_model_len)")
    g.add_argument("--max-num-seqs", type=positive_int, default=256,
                   help="most sequences running at once (default 256)")
    g.add_argument("--max-num-batched-tokens", type=positive_int,
                   help="token budget per step (default max(max-seq-len, 2048), at most 8192; longer prompts are chunked)")
    g.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                   help="iteration-level (Orca/vLLM) or request-level (HF/FasterTransformer) batching")
    g.add_argument("--preemption", choices=("recompute", "swap"), default="recompute")
    g.add_argument("--swap-space-gb", type=float, default=4.0, help="CPU swap pool in GiB (default 4)")
    g.add_argument("--queue-timeout", type=positive_float, metavar="S",
                   help="refuse requests that waited longer than S seconds (a 503)")
    g.add_argument("--truncate-prompts", action="store_true",
                   help="cut prompts that exceed max-seq-len instead of refusing them")
    g = p.add_argument_group("block sharing (paged allocators)")
    g.add_argument("--parallel-samples", type=positive_int, default=1, metavar="N",
                   help="decode N samples per prompt, sharing the prompt's blocks (default 1)")
    g.add_argument("--beam-width", type=positive_int, default=1, metavar="W",
                   help="beam search of width W: beams fork and are pruned every step (default 1)")
    g.add_argument("--beam-theta", type=positive_float, default=None, metavar="θ",
                   help="beam model: concentration of the next-token distributions; small = a "
                        "confident model whose beams persist, large = beams collapse onto the "
                        "best one (default: the workload's fitted value, alpaca-paper 0.2, "
                        "sharegpt-paper 0.03; 0.1 for other traces)")
    g.add_argument("--prefix-caching", action="store_true",
                   help="reuse cached prompt blocks across requests (vLLM automatic prefix caching)")
    g.add_argument("--system-prompt-len", type=int, default=0, metavar="S",
                   help="prepend one shared S-token system prompt to every request (default 0)")
    g = p.add_argument_group("cost model")
    g.add_argument("--cost-model", default="auto", metavar="NAME|FILE",
                   help="step times: auto (a fitted preset for the model and GPU if one exists, "
                        "else roofline), roofline, fixed, a preset (vllm-paper, "
                        "blis-llama-3.1-8b-h100) or a TOML file from fragsim calibrate "
                        "(default: %(default)s)")
    g.add_argument("--step-time", type=positive_float, default=0.02,
                   help="seconds per step with --cost-model fixed (default 0.02)")


def spec_from_args(args: argparse.Namespace) -> Any:
    from fragsim.simulate import RunSpec

    max_seq_len = args.max_seq_len
    if max_seq_len is None:
        from fragsim.simulate import _model_gpu

        model, _ = _model_gpu(RunSpec(model=args.model, gpu=args.gpu, catalog=args.catalog,
                                     kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto")))
        max_seq_len = int(model.max_position_embeddings)
    return RunSpec(
        trace=args.trace, model=args.model, gpu=args.gpu, tp=args.tp, catalog=args.catalog,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        reserve=args.reserve, block_size=args.block_size, fit=args.fit,
        max_seq_len=max_seq_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_slots=args.kv_slots,
        kv_cache_memory_bytes=getattr(args, "kv_cache_memory_bytes", None),
        hybrid_chunked=getattr(args, "hybrid_chunked", False),
        batching=args.batching, preemption=args.preemption, swap_space_gb=args.swap_space_gb,
        queue_timeout_s=args.queue_timeout, truncate_prompts=args.truncate_prompts,
        cost_model=args.cost_model, step_time_s=args.step_time, rate=args.rate,
        arrival=args.arrival, cv=args.cv, num_requests=args.num_requests,
        time_window_s=args.time_window, seed=args.seed,
        exact_steps=getattr(args, "exact_steps", False),
        address_map=getattr(args, "plot", False),
        page_kb=getattr(args, "page_kb", 2048),
        num_samples=getattr(args, "parallel_samples", 1),
        beam_width=getattr(args, "beam_width", 1),
        beam_theta=getattr(args, "beam_theta", None),
        prefix_caching=getattr(args, "prefix_caching", False),
        system_prompt_len=getattr(args, "system_prompt_len", 0),
    )


def parse_allocators(text: str) -> list[str]:
    from fragsim.allocators import PLACEMENTS, PRESETS
    from fragsim.errors import FragsimError
    from fragsim.hybrid import MANAGERS

    names = [n.strip() for n in text.split(",") if n.strip()]
    known = list(PRESETS) + list(PLACEMENTS) + list(MANAGERS)
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise FragsimError(f"--allocator: unknown {', '.join(bad) or '(empty)'}; known: {', '.join(known)}")
    return names


def full_attention_note(model: Any, gpu: Any, spec: Any) -> str:
    """What a run of a hybrid model is: every layer simulated as full attention,
    beside the pool vLLM would plan for its layer kinds."""
    from fragsim.capacity import plan_capacity
    from fragsim.simulate import pool_slots

    kinds = sorted({layer.label() for layer in model.layer_specs})
    slots = pool_slots(spec)
    text = (f"{model.name} has {', '.join(kinds)} layers, but this run treats every layer as full "
            f"attention: {model.kv_bytes_per_token_per_gpu(spec.tp):,} B per token, a pool of "
            f"{slots:,} slots")
    try:
        plan = plan_capacity(model, gpu, tp=spec.tp, max_seq_len=spec.max_seq_len,
                             gpu_memory_utilization=spec.gpu_memory_utilization,
                             max_num_batched_tokens=spec.max_num_batched_tokens,
                             kv_cache_memory_bytes=slots * model.kv_bytes_per_token_per_gpu(spec.tp))
    except Exception:  # the note must never stop a run
        return text
    vllm = plan.to_dict()
    naive = slots / spec.max_seq_len
    return (text + f" ({naive:,.1f} requests of {spec.max_seq_len:,} tokens); vLLM's hybrid "
            f"manager would fit {vllm['max_concurrency']:,.1f} in the same memory "
            f"(fragsim capacity --model {spec.model} --gpu {spec.gpu} shows its groups)")


#: why a hybrid KV manager holds more per request than the others (the overload note)
HYBRID_WHY = {
    "paged-uniform": "paged-uniform keeps every layer's KV for every token, a window's old blocks too",
    "static-partition": "static-partition sizes a pool per kind up front, and one kind's free pages "
                        "cannot serve another",
    "vllm-hybrid": "vllm-hybrid pads its groups to one page size",
    "jenga": "jenga strands free small pages in large pages carved for one kind",
}


def _overloaded(s: dict[str, Any]) -> bool:
    return bool(s["mean_waiting"] > 4 * max(s["mean_running"], 1.0))


def overload_notes(summaries: list[dict[str, Any]], spec: Any) -> list[str]:
    """Which allocators could not keep up, and whether the GPU or their reservations are why."""
    over = [s for s in summaries if _overloaded(s)]
    if not over:
        return []
    worst = max(over, key=lambda s: s["mean_waiting"])
    names = ", ".join(s["allocator"] for s in over)
    served = [s for s in summaries if not _overloaded(s)]
    if served:
        paged = [s for s in served if s["allocator"] == "vllm"]
        best = paged[0] if paged else max(served, key=lambda s: s["throughput_requests_per_s"])
        if all(s["allocator"] in HYBRID_WHY for s in over):
            why = ("how each lays out the layer kinds, not the GPU, limits the batch ("
                   + "; ".join(HYBRID_WHY[s["allocator"]] for s in over) + ")")
        else:
            why = ("what each reserves, not the GPU, limits the batch (a max-length reservation is "
                   f"--max-seq-len, {spec.max_seq_len:,} tokens, per request)")
        return [f"{names} could not keep up: {worst['allocator']}'s queue held "
                f"{worst['mean_waiting']:,.0f} requests on average and its p99 time to first token "
                f"was {worst['p99_ttft_s']:,.0f} s, while {best['allocator']} served the same trace "
                f"with {best['mean_waiting']:,.1f} waiting (p99 TTFT {best['p99_ttft_s']:,.2f} s): {why}"]
    return [f"the trace offers more load than this GPU serves: {worst['allocator']}'s queue held "
            f"{worst['mean_waiting']:,.0f} requests on average, so latencies grow over the run "
            "(--rate, --time-window, a larger --gpu or --tp eases it)"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("run", help="replay a trace against allocators (the main job)",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_options(p)
    add_system_options(p)
    g = p.add_argument_group("output")
    g.add_argument("--out", default="results", help="results folder (default: %(default)s)")
    g.add_argument("--no-save", action="store_true", help="print only; write no results folder")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object per allocator (JSON Lines) and nothing else on stdout")
    g.add_argument("--plot", action="store_true",
                   help="also draw the split per allocator, the split over time and an address map")
    g.add_argument("--exact-steps", action="store_true",
                   help="simulate every step on its own (reference mode; slower, same results)")
    g.add_argument("--workers", type=positive_int, default=1, metavar="N",
                   help="run up to N allocators at once, each in its own process (default 1: one "
                        "after another, in this process); the results are the same")
    p.set_defaults(func=main)


# -------------------------------------------------------------- parallel runs

_progress_queue: Any = None


def _init_worker(queue: Any) -> None:
    global _progress_queue
    _progress_queue = queue


def _simulate_in_worker(task: tuple[Any, int, str, Any]) -> Any:
    """Run ``i``, one allocator's, in a pool worker; its progress goes back through the queue."""
    from fragsim.simulate import simulate

    trace, i, name, spec = task
    queue = _progress_queue

    def report(done: int) -> None:
        queue.put((i, done))

    return simulate(trace, name, spec, progress=None if queue is None else report)


def simulate_all(trace: Any, allocators: list[str], spec: Any, workers: int,
                 progress: Any, on_result: Any) -> list[Any]:
    """Every allocator's run, in the order given; ``progress(i, done)`` as run ``i``'s
    requests finish (``done`` is the trace's length once it has ended) and ``on_result(i, result)`` as soon as run ``i`` and every run before it are
    done (so that what is printed keeps the allocators' order).

    With one worker the runs go one after another in this process; with more, each
    runs in a process of a pool (:func:`fragsim.sweep.process_context`), and the
    first failure cancels the runs not yet started."""
    results: list[Any] = [None] * len(allocators)
    if workers <= 1 or len(allocators) <= 1:
        from fragsim.simulate import simulate

        for i, name in enumerate(allocators):
            progress(i, 0)
            results[i] = simulate(trace, name, spec, progress=functools.partial(progress, i))
            progress(i, len(trace))
            on_result(i, results[i])
        return results
    import queue as queue_module
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    from fragsim.sweep import process_context

    context = process_context(["fragsim.simulate"])
    queue = context.Queue()
    pool = ProcessPoolExecutor(max_workers=min(workers, len(allocators)), mp_context=context,
                               initializer=_init_worker, initargs=(queue,))
    shown = 0
    try:
        pending = {pool.submit(_simulate_in_worker, (trace, i, name, spec)): i for i, name in enumerate(allocators)}
        for i in range(len(allocators)):
            progress(i, 0)
        while pending:
            done, _ = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            while True:
                try:
                    i, count = queue.get_nowait()
                except queue_module.Empty:
                    break
                if results[i] is None:   # a report may come after its run's result
                    progress(i, count)
            for future in done:
                i = pending.pop(future)
                results[i] = future.result()
                progress(i, len(trace))
            while shown < len(results) and results[shown] is not None:
                on_result(shown, results[shown])
                shown += 1
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return results


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fragsim.report import comparison_table, dumps, write_results
    from fragsim.simulate import load_workload, run_config

    allocators = parse_allocators(args.allocator)
    spec = spec_from_args(args)
    trace = load_workload(spec)
    err = Console(stderr=True)
    from fragsim.capacity import context_note
    from fragsim.simulate import _model_gpu

    model, gpu = _model_gpu(spec)
    if spec.max_seq_len > model.max_position_embeddings:
        print(f"fragsim: warning: {context_note(model, spec.max_seq_len)}", file=sys.stderr)
    from fragsim.costmodel import describe_cost_model
    from fragsim.simulate import is_hybrid_manager

    cost_name, cost_note = describe_cost_model(spec.cost_model, model, gpu, spec.tp)
    if cost_note:
        print(f"fragsim: warning: {cost_note}", file=sys.stderr)
    dense_on_hybrid = model.is_hybrid and not all(is_hybrid_manager(a) for a in allocators)
    hybrid_note = full_attention_note(model, gpu, spec) if dense_on_hybrid else None
    if hybrid_note:
        print(f"fragsim: note: {hybrid_note}", file=sys.stderr)
    with Progress(TextColumn("{task.description:>12}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, transient=True,
                  disable=not err.is_terminal) as progress:
        bars: dict[int, Any] = {}

        def advance(i: int, done: int) -> None:
            if i not in bars:
                bars[i] = progress.add_task(allocators[i], total=len(trace))
            progress.update(bars[i], completed=done)

        def finished(i: int, result: Any) -> None:
            if args.json:
                sys.stdout.write(dumps(result.summary) + "\n")
                sys.stdout.flush()

        results = simulate_all(trace, allocators, spec, args.workers, advance, finished)
    folder = None
    if not args.no_save:
        folder = write_results(Path(args.out), run_config(spec, allocators), results, plot=args.plot)
    if args.json:
        if folder is not None:
            err.print(f"results: {folder}")
        return 0
    out = Console()
    if not out.is_terminal:
        # the hybrid managers' split has two more columns
        out = Console(width=240 if any("padding_frac" in r.summary for r in results) else 200)
    s0 = results[0].summary
    pool = (f"KV pool {s0['capacity_slots']:,} slots" if s0["capacity_slots"] is not None
            else f"KV pool {s0['kv_pool_bytes'] / 2**30:,.2f} GiB")
    title = (f"{trace.name}: {len(trace):,} requests on {spec.model} / {spec.gpu} (tp={spec.tp}), "
             f"{pool}, max-seq-len {spec.max_seq_len:,}; step times: {cost_name}")
    out.print(comparison_table([r.summary for r in results], title))
    notes = []
    if s0["num_refused_too_long"]:
        notes.append(f"{s0['num_refused_too_long']:,} requests longer than --max-seq-len "
                     f"{spec.max_seq_len} were refused (--truncate-prompts cuts them instead)")
    notes += overload_notes([r.summary for r in results], spec)
    notes.append("memory split: time-weighted mean over the run, % of the KV pool; "
                 "ext. frag = 1 − largest allocatable / free")
    for s in (r.summary for r in results):
        if spec.sharing:
            beams = f" ({spec.beam_width} beams, θ = {s['beam_theta']:g})" if spec.beam_width > 1 else ""
            # the hybrid managers count shared blocks once in their byte split instead
            saved = "" if s.get("by_kind") else \
                f"sharing saves {s['blocks_saved_frac']:.1%} of the blocks{beams}; "
            notes.append(f"{s['allocator']}: {saved}"
                         f"prefix cache hit {s['prefix_cache_hit_rate']:.1%} "
                         f"({s['prefix_cache_hits']:,} of {s['prefix_cache_queries']:,} tokens); "
                         f"{s['num_prefill_tokens']:,} prompt tokens computed")
        if s["vmm_tokens_per_page"]:
            notes.append(f"{s['allocator']}: {s['vmm_tokens_per_page']} tokens a page; page tails hold "
                         f"nothing: {s['page_tail_bytes'] / 2**20:,.1f} MiB of the pool")
    if any(r.summary.get("by_kind") for r in results):
        notes.append("hybrid managers: internal = block tails; padding = phantom layers and padded "
                     "pages; out of window = blocks a sliding or chunked layer holds but never reads "
                     "again; by kind in --json (by_kind) and with --plot")
        for r in results:
            by_kind = r.summary.get("by_kind")
            if by_kind:
                parts = [f"{kind} {100 * v['pool_frac']:.1f}% of the pool "
                         f"({100 * v['token_states_frac_of_held']:.0f}% of it token states)"
                         for kind, v in by_kind.items() if kind != "pool"]
                notes.append(f"{r.allocator}: " + "; ".join(parts))
    if hybrid_note:
        notes.insert(0, hybrid_note)
    for note in notes:
        out.print(f"[dim]{note}[/dim]", highlight=False)
    if folder is not None:
        out.print(f"results: {folder}")
    return 0
