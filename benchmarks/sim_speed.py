"""How fast the simulator replays a trace: wall seconds, real-time factor, memory.

    python benchmarks/sim_speed.py                 # presets, peer configuration, 1x/4x/16x scaling
    python benchmarks/sim_speed.py --million       # also peak RSS at 1M requests
    python benchmarks/sim_speed.py --json          # one JSON object per measurement
    python benchmarks/sim_speed.py --peer --runs 7 # the peer configuration only, min/median of 7
    python benchmarks/sim_speed.py --hybrid --runs 3  # hybrid models beside their dense runs, in rounds
    python benchmarks/sim_speed.py --hybrid --models gemma-3-27b --managers jenga --runs 5

Each measurement runs in a fresh process so that its peak RSS is its own. The
real-time factor is simulated seconds per wall second of the engine run (trace
loading excluded, reported apart). With ``--runs N`` every measurement is taken N
times: ``wall_s`` is the median, ``wall_min_s`` the fastest (a shared machine's
noise only ever adds time).

The peer configuration (azure-conv, Llama-2-7B on an A100-80GB, vllm, max-seq-len
16,384, 256 sequences, 2,048 batched tokens) is dense: about 65,000 steps, of which
some 34,000 run one by one and the rest in about 8,000 stretches of four steps or so,
with a few sequences taking a block each step. It measures the per-step cost of
the engine, the paged allocator and the recorder rather than the stretch arithmetic.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import sys
import time
from typing import Any

PRESETS = ["ft-static", "orca-max", "orca-pow2", "orca-oracle", "vllm"]
# The configuration peer simulators are usually benchmarked in.
#: hybrid models measured in the peer configuration (``--hybrid``), each beside its dense run
HYBRID_MODELS = ["mistral-7b-v0.1", "gpt-oss-20b", "gemma-3-27b"]
HYBRID_MANAGERS = ["paged-uniform", "vllm-hybrid", "jenga", "static-partition"]
PEER = {"model": "llama-2-7b", "gpu": "a100-80gb", "max_seq_len": 16384, "max_num_seqs": 256,
        "max_num_batched_tokens": 2048}


def _tiled(trace: Any, times: int) -> Any:
    """The trace repeated ``times`` times back to back (a longer day of the same traffic)."""
    import numpy as np

    from fragsim.traces import Trace

    gap = float(np.mean(np.diff(trace.arrival_s))) if len(trace) > 1 else 1.0
    period = float(trace.arrival_s[-1]) + gap
    arrival = np.concatenate([trace.arrival_s + i * period for i in range(times)])
    return Trace(f"{trace.name}x{times}", trace.source, arrival, np.tile(trace.prompt_len, times),
                 np.tile(trace.output_len, times), has_timestamps=True)


def _measure(args: tuple[str, dict[str, Any], int, int | None], out: Any) -> None:
    allocator, options, times, num_requests = args
    from fragsim.simulate import RunSpec, load_workload, make_engine

    t0 = time.perf_counter()
    spec = RunSpec(trace="azure-conv", timeseries_resolution_s=10.0, **options)
    trace = load_workload(spec)
    if num_requests is not None:
        times = -(-num_requests // len(trace))
    if times > 1:
        trace = _tiled(trace, times)
    if num_requests is not None:
        from fragsim.traces import slice_trace

        trace = slice_trace(trace, num_requests=num_requests)
    load_s = time.perf_counter() - t0
    engine = make_engine(trace, allocator, spec)
    t0 = time.perf_counter()
    engine.run()
    wall = time.perf_counter() - t0
    sim = engine.rec.span_s
    out.put({
        "allocator": allocator, "model": spec.model, "config": "peer" if options else "default", "trace_x": times,
        "num_requests": len(trace), "wall_s": round(wall, 3), "load_s": round(load_s, 3),
        "sim_s": round(sim, 1), "real_time_factor": round(sim / wall, 1),
        "steps": engine.num_steps, "events": engine.num_events,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    })


def measure(allocator: str, options: dict[str, Any], times: int = 1,
            num_requests: int | None = None) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_measure, args=((allocator, options, times, num_requests), queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def measure_runs(item: tuple[str, dict[str, Any], int, int | None], runs: int) -> dict[str, Any]:
    """``measure(*item)`` ``runs`` times: the median run's row (the faster middle one of an
    even number), with the fastest wall beside it."""
    return _median_row([measure(*item) for _ in range(runs)])


def _median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The median run's row of ``rows`` (the faster middle one of an even number), with
    the fastest wall and the number of runs beside it when there are several."""
    ordered = sorted(rows, key=lambda r: r["wall_s"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    if len(rows) > 1:
        row["wall_min_s"], row["runs"] = ordered[0]["wall_s"], len(rows)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="JSON Lines instead of a table")
    parser.add_argument("--million", action="store_true", help="also run 1,000,000 requests (vllm)")
    parser.add_argument("--no-scaling", action="store_true", help="skip the 4x/16x runs")
    parser.add_argument("--peer", action="store_true", help="only the peer configuration")
    parser.add_argument("--hybrid", action="store_true",
                        help="only hybrid models in the peer configuration: each model's dense "
                             "run (vllm, every layer full) beside its hybrid managers")
    parser.add_argument("--models", type=_names, default=HYBRID_MODELS, metavar="M[,M...]",
                        help=f"with --hybrid: these models (default {','.join(HYBRID_MODELS)})")
    parser.add_argument("--managers", type=_names, default=HYBRID_MANAGERS, metavar="A[,A...]",
                        help=f"with --hybrid: these managers (default {','.join(HYBRID_MANAGERS)})")
    parser.add_argument("--runs", type=int, default=1, metavar="N",
                        help="take every measurement N times: median and min wall (default 1)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    if args.hybrid:
        unknown = sorted(set(args.managers) - set(HYBRID_MANAGERS))
        if unknown:
            parser.error(f"--managers: unknown {', '.join(unknown)} (choose from {', '.join(HYBRID_MANAGERS)})")
        from fragsim.catalog import get_model
        from fragsim.errors import FragsimError

        for model in args.models:
            try:
                get_model(model)
            except FragsimError as exc:
                parser.error(f"--models: {exc}")

    plan: list[tuple[str, dict[str, Any], int, int | None]] = []
    if args.hybrid:
        return _report_hybrid(args)
    if not args.peer:
        plan += [(a, {}, 1, None) for a in PRESETS]
    plan.append(("vllm", PEER, 1, None))
    if not args.no_scaling and not args.peer:
        plan += [("vllm", {}, 4, None), ("vllm", {}, 16, None)]
    if args.million:
        plan.append(("vllm", {}, 1, 1_000_000))
    return _report(plan, args)


def _names(text: str) -> list[str]:
    """A comma-separated list, spaces and empty items dropped."""
    return [name.strip() for name in text.split(",") if name.strip()]


def _print_row(row: dict[str, Any], args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps(row), flush=True)
        return
    fastest = f" (min {row['wall_min_s']:.2f})" if "wall_min_s" in row else ""
    print(f"{row['allocator']:>16} {row['config']:>7} x{row['trace_x']:<3} "
          f"{row['num_requests']:>9,} req  wall {row['wall_s']:>8.2f} s{fastest}  "
          f"sim {row['sim_s']:>10,.0f} s  "
          f"RTF {row['real_time_factor']:>8,.0f}  steps {row['steps']:>10,}  "
          f"events {row['events']:>9,}  RSS {row['peak_rss_mb']:>7,.0f} MB", flush=True)


def _report_hybrid(args: argparse.Namespace) -> int:
    """Each hybrid model's dense run and managers, measured in rounds (the dense run, then
    each manager; ``--runs`` rounds), so that every manager's run is paired with the dense
    run of its round: the ratio is the median of the pairs' ratios, which a shared
    machine's drift between rounds moves less than a ratio of medians; beside it, the
    ratio of the fastest runs (a shared machine's noise only ever adds time)."""
    import statistics

    for model in args.models:
        names = ("vllm", *args.managers)
        runs: dict[str, list[dict[str, Any]]] = {a: [] for a in names}
        for _ in range(args.runs):
            for a in names:
                runs[a].append(measure(a, {**PEER, "model": model}))
        fastest = {a: min(r["wall_s"] for r in runs[a]) for a in names}
        ratios = {a: [r["wall_s"] / d["wall_s"] for r, d in zip(runs[a], runs["vllm"], strict=True)]
                  for a in args.managers}
        for a in names:
            row = _median_row(runs[a])
            if a != "vllm":
                row["wall_vs_dense"] = round(statistics.median(ratios[a]), 3)
                row["wall_vs_dense_range"] = [round(min(ratios[a]), 3), round(max(ratios[a]), 3)]
                row["wall_vs_dense_of_minima"] = round(fastest[a] / fastest["vllm"], 3)
            _print_row(row, args)
        if not args.json:
            for a in args.managers:
                spread = (f" (pairs {min(ratios[a]):.2f}-{max(ratios[a]):.2f}; "
                          f"fastest runs {fastest[a] / fastest['vllm']:.2f}x)") if args.runs > 1 else ""
                print(f"{model} {a}: wall {statistics.median(ratios[a]):.2f}x of the same trace on the model "
                      f"as dense (vllm){spread}", flush=True)
    return 0


def _report(plan: list[tuple[str, dict[str, Any], int, int | None]], args: argparse.Namespace) -> int:
    rows = []
    for item in plan:
        row = measure_runs(item, args.runs)
        rows.append(row)
        _print_row(row, args)
    base = next((r for r in rows if r["allocator"] == "vllm" and r["trace_x"] == 1 and r["config"] == "default"), None)
    if base and not args.json:
        for r in rows:
            if r["trace_x"] > 1 and r["config"] == "default" and r["num_requests"] == base["num_requests"] * r["trace_x"]:
                print(f"scaling x{r['trace_x']}: wall {r['wall_s'] / base['wall_s']:.2f}x of 1x "
                      f"(linear would be {r['trace_x']}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
