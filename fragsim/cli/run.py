"""``fragsim run``: replay a trace against allocators and compare where the memory goes.

This module is the command: its parser (:func:`register`, with the help's
description and examples) and :func:`main`, which runs and prints the table and its
notes. Its options and the run spec they make are :mod:`fragsim.cli.run_options`'s,
the notes on a hybrid model and on an overload :mod:`fragsim.cli.run_notes`'s, the
runs themselves (in order or in a pool of processes) :mod:`fragsim.cli.run_parallel`'s;
their names are re-exported here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fragsim.cli.args import positive_int

# re-exported: fragsim.cli.run is where callers look (fragsim.cli.validate, the tests)
from fragsim.cli.run_notes import HYBRID_WHY, full_attention_note, overload_notes  # noqa: F401
from fragsim.cli.run_options import (  # noqa: F401
    add_system_options,
    add_workload_options,
    default_allocators,
    parse_allocators,
    spec_from_args,
)
from fragsim.cli.run_parallel import simulate_all

DESCRIPTION = """\
Replay a request trace against one or more KV-cache allocators and print the
vLLM-paper Figure-2 split of KV memory (token states / reservation / internal
fragmentation / free), external fragmentation, what runs, waits, is preempted or
refused, and the throughput and latency that follow.

With no options: the bundled Azure conversation trace (19,366 requests over
3,500 s) on Llama-3.1-8B and one H100-80GB with the model's whole context, as
vLLM serves it by default, for ft-static, orca-max, orca-pow2, orca-oracle and
vllm. A model with layers other than full attention (--model gpt-oss-20b, say) is
compared across the hybrid KV managers instead (vllm-hybrid, jenga,
static-partition, paged-uniform), the way such a model is served; with block
sharing (--prefix-caching, --parallel-samples, --beam-width) the default list keeps
the allocators that can share blocks and says which it left out."""

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
      --kv-cache-memory-bytes 8589934592 --workers 4
"""


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


def cluster_note(s: dict[str, Any]) -> str:
    """One line on a cluster: its router, goodput, balance, and the router's estimate."""
    line = (f"{s['allocator']}: {s['num_instances']} instances, {s['router']} router; goodput "
            f"{s['goodput_rps']:,.2f} req/s (TTFT ≤ {s['slo_ttft_s']:g} s and TPOT ≤ {s['slo_tpot_s']:g} s) "
            f"of {s['throughput_requests_per_s']:,.2f}; busiest instance {s['load_imbalance']:.2f}× the "
            f"mean requests")
    if s.get("router_estimated_hit_tokens") is not None:
        found = s["prefix_cache_hits"] + s.get("external_prefix_cache_hits", 0)
        line += (f"; the router expected {s['router_estimated_hit_tokens']:,} prefix tokens cached, "
                 f"the instances found {found:,}")
    if s.get("num_kv_transfers") is not None:
        line += (f"\n  {s['num_disaggregated']:,} requests split prefill/decode: {s['num_kv_transfers']:,} KV "
                 f"transfers, {s['kv_transfer_bytes'] / 1e9:,.1f} GB, {s['mean_kv_transfer_s'] * 1e3:,.1f} ms "
                 f"each on the link, {s['mean_kv_transfer_wait_s'] * 1e3:,.1f} ms from the decode side's "
                 f"reservation to landing; of the cluster's KV, {s['kv_sending_frac']:.1%} held by prefill "
                 f"instances for transfers, {s['kv_receiving_frac']:.1%} reserved by decode instances for "
                 f"them, {s['kv_duplicated_frac']:.2%} at both ends")
        by_kind = s.get("kv_transfer_bytes_by_kind")
        if by_kind:
            line += "; by layer kind: " + ", ".join(f"{kind} {size / 1e9:,.2f} GB" for kind, size in by_kind.items())
    return line


#: a cluster with more instances shows its total and pools only (``--json`` has them all)
MAX_INSTANCE_ROWS = 8


def table_rows(results: list[Any]) -> list[dict[str, Any]]:
    """The table's rows: one per run; a cluster's total, a row per pool (with a
    prefill/decode split), then a row per instance (up to :data:`MAX_INSTANCE_ROWS`)."""
    rows = []
    for r in results:
        s = r.summary
        if "instances" not in s:
            rows.append(s)
            continue
        rows.append({**s, "allocator": f"{s['allocator']} ×{s['num_instances']} {s['router']}"})
        rows += [{**pool, "allocator": f"  {pool['pool']} ×{pool['num_instances']}"} for pool in s.get("pools", [])]
        if len(s["instances"]) <= MAX_INSTANCE_ROWS:
            rows += [{**inst, "allocator": f"  #{inst['instance']}" + (f" {inst['pool']}" if "pools" in s else "")}
                     for inst in s["instances"]]
    return rows


def tier_notes(s: dict[str, Any]) -> list[str]:
    """Lines on a run's offload tiers: hits past the GPU, then each tier's blocks, where
    its bytes went and what it moved."""
    tiers = s.get("tiers") or []
    if not tiers:
        return []
    queries, hits = s["external_prefix_cache_queries"], s["external_prefix_cache_hits"]
    out = [f"{s['allocator']}: offload ({tiers[0]['backend']}) hit {hits / queries if queries else 0.0:.1%} "
           f"of the {queries:,} prompt tokens past the GPU hit, mean load wait "
           f"{1000 * tiers[0]['mean_load_wait_s']:,.1f} ms; GPU blocks held for stores "
           f"{s['store_pending_frac']:.2%} of the pool"]
    for t in tiers:
        flight = t["write_pending_frac"] + t["read_pending_frac"]
        tails = f", {t['chunk_tail_frac']:.1%} chunk tails" if t["chunk_tail_frac"] else ""
        if t.get("swapped_frac"):
            tails += f", {t['swapped_frac']:.1%} swapped-out sequences"
        out.append(
            f"  {t['name']} {t['capacity_bytes'] / 2**30:,.2f} GiB ({t['policy']}, {t['block_size']}-token "
            f"blocks): {t['hits_tokens']:,} tokens hit; stored {t['stored_blocks']:,} blocks, evicted "
            f"{t['evicted_blocks']:,}, {t['failed_stores']:,} stores refused; its bytes: "
            f"{t['cached_hit_later_frac']:.1%} cached then hit, {t['cached_never_hit_frac']:.1%} never hit "
            f"again, {flight:.1%} in flight{tails}, {t['free_frac']:.1%} free; loads "
            f"{t['load_bytes'] / 1e9:,.1f} GB ({t['load_time_s']:,.2f} s), stores "
            f"{t['store_bytes'] / 1e9:,.1f} GB ({t['store_time_s']:,.2f} s)")
    return out


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fragsim.report import comparison_table, dumps, write_results
    from fragsim.simulate import load_workload, run_config

    spec = spec_from_args(args)
    from fragsim.capacity import context_note
    from fragsim.simulate import _model_gpu

    model, gpu = _model_gpu(spec)
    if args.allocator is None:
        allocators, left_out = default_allocators(model, spec)
        if left_out:
            print(f"fragsim: note: {left_out}", file=sys.stderr)
    else:
        allocators = parse_allocators(args.allocator)
    trace = load_workload(spec)
    err = Console(stderr=True)
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
        # the hybrid managers' split has two more columns, a run with a tier one
        out = Console(width=240 if any("padding_frac" in r.summary or r.summary.get("tiers")
                                       for r in results) else 200)
    s0 = results[0].summary
    inst = s0["instances"][0] if "instances" in s0 else s0
    pool = (f"KV pool {inst['capacity_slots']:,} slots" if inst["capacity_slots"] is not None
            else f"KV pool {inst['kv_pool_bytes'] / 2**30:,.2f} GiB")
    if "instances" in s0:
        pool = f"{s0['num_instances']} instances, each a {pool}"
    title = (f"{trace.name}: {len(trace):,} requests on {spec.model} / {spec.gpu} (tp={spec.tp}), "
             f"{pool}, max-seq-len {spec.max_seq_len:,}; step times: {cost_name}")
    out.print(comparison_table(table_rows(results), title))
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
        for part in s.get("instances") or [s]:  # a cluster's tiers are its instances'
            label = f"{s['allocator']} #{part['instance']}" if "instances" in s else s["allocator"]
            notes += tier_notes({**part, "allocator": label})
        if "instances" in s:
            notes.append(cluster_note(s))
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
