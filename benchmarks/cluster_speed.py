"""How fast a cluster runs: 16 instances on azure-conv at ``--load-scale 16``, beside BLIS,
and how the cost grows with requests and instances.

    python benchmarks/cluster_speed.py                       # headline and both series (fragsim only)
    python benchmarks/cluster_speed.py --blis PATH/TO/blis   # BLIS on the headline too, side by side
    python benchmarks/cluster_speed.py --blis PATH/TO/blis --blis-all   # BLIS on every point
    python benchmarks/cluster_speed.py --quick               # a small check: load scale 1 and 4 only
    python benchmarks/cluster_speed.py --router least-loaded --runs 3 --json

The configuration is what ``fragsim run --instances N --load-scale K --allocator vllm
--cost-model blis-llama-3.1-8b-h100`` runs: the bundled Azure conversation trace merged K
times (K times its rate, 19,366 x K requests), Llama-3.1-8B on H100-80GBs at tp 1, the
model's whole context (max-seq-len 131,072), 256 sequences and 8,192 batched tokens a
step, 16-token blocks, each instance its own KV pool, behind a round-robin router.

The target: 16 instances at load scale 16 (309,856 requests) in under a tenth of BLIS's
wall time on the same configuration, in under 1 GB; and cost linear in requests and in
instances, shown by two series:

- requests x1, x4, x16: load scale 1, 4, 16 on 16 instances;
- instances 1, 4, 16 at a fixed load per instance: load scale equal to the instance count.

Every measurement is a fresh process (``wait4``'s rusage gives its own peak RSS and CPU
seconds): ``wall_s`` is that process's wall time, start-up and trace loading included, as
BLIS's is; ``sim_wall_s`` is fragsim's simulate() call alone. On a shared machine the CPU
seconds (user + system) move less than the wall. With ``--runs N`` each point is measured
N times (fragsim and BLIS alternating on a point) and the median wall is shown.

BLIS (``--blis PATH/TO/blis``, the binary of inference-sim, run from its own folder, where
its defaults.yaml, hardware_config.json and model_configs/ lie) replays the very requests
fragsim replays: the merged trace fragsim builds is written out in BLIS's trace format
(TraceV2: a header YAML and a data CSV, arrivals in microseconds), and BLIS runs it as

    blis replay --trace-header T.yaml --trace-data T.csv --model meta-llama/llama-3.1-8b-instruct
        --hardware H100 --tp 1 --latency-model trained-physics --block-size-in-tokens 16
        --total-kv-blocks B --max-model-len 131072 --max-num-seqs 256 --max-num-batched-tokens 8192
        --num-instances N --routing-policy round-robin --cache-signal-delay 0 --log error

with B fragsim's KV pool of one instance in blocks. BLIS's step times come from its own
fitted latency model for this model and GPU (fragsim's preset copies an earlier set of
BLIS's coefficients), so the two run close, not equal, schedules; both serve every
request with no preemption at this load.

``--cache-signal-delay 0`` has the router read the instances' prefix caches live. BLIS's
default (50,000 us, as llm-d) copies every instance's whole cached-block map at each
arrival once 50 ms have passed, whichever the router, though only the prefix scorers read
it: with 28,880 blocks an instance that copy is nearly all of BLIS's time (16 instances at
load scale 4: about 2,750 s of CPU against 23 s), while its results are the same either
way (every figure of its summary, checked on 3,000 requests at 16 instances). The default
measures BLIS at its fastest on these routers; ``--blis-cache-signal-delay 50000`` measures
it as it runs out of the box.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TRACE = "azure-conv"
MODEL, GPU, COST_MODEL = "llama-3.1-8b", "h100-80gb", "blis-llama-3.1-8b-h100"
#: BLIS's names for the same model and card
BLIS_MODEL, BLIS_GPU = "meta-llama/llama-3.1-8b-instruct", "H100"
ROUTERS = ("round-robin", "least-loaded")
#: (instances, load scale) of the headline
HEADLINE = (16, 16)
#: the requests series (load scales at 16 instances) and the instances series (load = instances)
FULL_LOADS, FULL_INSTANCES = (1, 4, 16), (1, 4, 16)
QUICK_LOADS, QUICK_INSTANCES = (1, 4), (1, 4)
TARGET_RATIO, TARGET_RSS_MB = 0.10, 1024.0


def run_args(instances: int, load_scale: int, router: str) -> list[str]:
    """``fragsim run``'s options for a point (less ``--allocator vllm``, which names the run)."""
    return ["--trace", TRACE, "--model", MODEL, "--gpu", GPU, "--cost-model", COST_MODEL,
            "--instances", str(instances), "--load-scale", str(load_scale), "--router", router]


def make_spec(instances: int, load_scale: int, router: str) -> Any:
    """The RunSpec ``fragsim run`` builds from :func:`run_args` (its own parser and builder)."""
    from fragsim.cli.run_options import add_system_options, add_workload_options, spec_from_args

    parser = argparse.ArgumentParser()
    add_workload_options(parser)
    add_system_options(parser)
    return spec_from_args(parser.parse_args(run_args(instances, load_scale, router)))


# --- the measured processes -------------------------------------------------------------------

def _child(point: dict[str, Any]) -> None:
    """In a fresh process: one fragsim run of ``point``; one JSON line on stdout."""
    t0 = time.perf_counter()
    from fragsim.simulate import load_workload, simulate

    spec = make_spec(point["instances"], point["load_scale"], point["router"])
    trace = load_workload(spec)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = simulate(trace, "vllm", spec)
    sim_wall = time.perf_counter() - t0
    s = result.summary
    print(json.dumps({"requests": len(trace), "finished": s["num_finished"], "preemptions": s["num_preemptions"],
                      "sim_wall_s": round(sim_wall, 3), "load_s": round(load_s, 3),
                      "sim_s": round(s["sim_time_s"], 1), "steps": s["num_steps"]}), flush=True)


def _timed_process(cmd: list[str], cwd: str | None = None) -> tuple[str, dict[str, Any]]:
    """Run ``cmd`` to its end: its stdout, and its wall, CPU seconds and peak RSS (``wait4``'s
    rusage: that process's own, start-up included)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        text, errors = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... exited {proc.returncode}:\n{errors[-2000:]}")
    return text, {"wall_s": round(wall, 2), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
                  "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}


def measure_fragsim(instances: int, load_scale: int, router: str) -> dict[str, Any]:
    point = {"instances": instances, "load_scale": load_scale, "router": router}
    out, usage = _timed_process([sys.executable, os.path.abspath(__file__), "--child", json.dumps(point)])
    return {"tool": "fragsim", **point, **json.loads(out.strip().splitlines()[-1]), **usage}


def write_blis_trace(load_scale: int, folder: Path) -> tuple[Path, Path, int]:
    """The trace fragsim replays at ``load_scale`` in BLIS's TraceV2 format: the header and
    data files and the number of requests."""
    from fragsim.simulate import load_workload

    trace = load_workload(make_spec(1, load_scale, "round-robin"))
    header, data = folder / f"azure_conv_x{load_scale}.yaml", folder / f"azure_conv_x{load_scale}.csv"
    header.write_text("trace_version: 2\ntime_unit: us\nmode: real\nwarm_up_requests: 0\n")
    cols = ["request_id", "client_id", "tenant_id", "slo_class", "session_id", "round_index", "prefix_group",
            "prefix_length", "streaming", "input_tokens", "output_tokens", "text_tokens", "image_tokens",
            "audio_tokens", "video_tokens", "reason_ratio", "model", "deadline_us", "server_input_tokens",
            "arrival_time_us", "send_time_us", "first_chunk_time_us", "last_chunk_time_us", "num_chunks",
            "status", "error_message", "finish_reason"]
    t0 = float(trace.arrival_s[0])
    with open(data, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for i, (a, p, o) in enumerate(zip(trace.arrival_s.tolist(), trace.prompt_len.tolist(),
                                          trace.output_len.tolist(), strict=True)):
            us = int(round((a - t0) * 1e6))
            w.writerow([i, "c0", "", "", "", 0, "", 0, "false", p, o, p, 0, 0, 0, 0, "", 0, p, us, us,
                        0, 0, 0, "ok", "", ""])
    return header, data, len(trace)


def blis_command(binary: str, header: Path, data: Path, instances: int, router: str, spec: Any,
                 latency_model: str, cache_signal_delay_us: int) -> list[str]:
    from fragsim.engine_config import EngineConfig
    from fragsim.simulate_spec import pool_slots

    tokens = EngineConfig(max_seq_len=spec.max_seq_len, max_num_seqs=spec.max_num_seqs,
                          max_num_batched_tokens=spec.max_num_batched_tokens).num_batched_tokens
    return [binary, "replay", "--trace-header", str(header), "--trace-data", str(data),
            "--model", BLIS_MODEL, "--hardware", BLIS_GPU, "--tp", str(spec.tp),
            "--latency-model", latency_model, "--block-size-in-tokens", str(spec.block_size),
            "--total-kv-blocks", str(pool_slots(spec) // spec.block_size),
            "--max-model-len", str(spec.max_seq_len), "--max-num-seqs", str(spec.max_num_seqs),
            "--max-num-batched-tokens", str(tokens),
            "--num-instances", str(instances), "--routing-policy", router,
            "--cache-signal-delay", str(cache_signal_delay_us), "--log", "error"]


def measure_blis(binary: str, traces: dict[int, tuple[Path, Path, int]], instances: int, load_scale: int,
                 router: str, latency_model: str, cache_signal_delay_us: int,
                 show_command: bool) -> dict[str, Any]:
    header, data, n = traces[load_scale]
    cmd = blis_command(binary, header, data, instances, router, make_spec(instances, load_scale, router),
                       latency_model, cache_signal_delay_us)
    if show_command:
        print("BLIS: (cd " + os.path.dirname(binary) + " && " + " ".join(cmd) + ")", file=sys.stderr, flush=True)
    text, usage = _timed_process(cmd, cwd=os.path.dirname(binary))
    metrics = _blis_metrics(text)
    return {"tool": "blis", "instances": instances, "load_scale": load_scale, "router": router, "requests": n,
            "finished": metrics.get("completed_requests"), "preemptions": metrics.get("preemption_count"),
            "sim_s": metrics.get("vllm_estimated_duration_s"), **usage}


def _blis_metrics(text: str) -> dict[str, Any]:
    """The cluster's aggregate metrics that BLIS prints (the JSON object whose
    instance_id is "cluster"), or {} when none is found."""
    decoder, i = json.JSONDecoder(), 0
    found: dict[str, Any] = {}
    while (i := text.find("{", i)) >= 0:
        try:
            obj, end = decoder.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        if isinstance(obj, dict) and obj.get("instance_id") == "cluster":
            found = obj
        i = end
    return found


# --- the report ---------------------------------------------------------------------------------

def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The median run's row (the faster middle one of an even number), with the fastest
    wall and the number of runs beside it when there are several."""
    ordered = sorted(rows, key=lambda r: r["wall_s"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    if len(rows) > 1:
        row["wall_min_s"], row["cpu_min_s"], row["runs"] = ordered[0]["wall_s"], min(r["cpu_s"] for r in rows), len(rows)
    return row


def per_1k(row: dict[str, Any]) -> float:
    return 1000 * row["wall_s"] / row["requests"]


HEADER = (f"{'tool':<8} {'inst':>4} {'load':>5} {'requests':>9} {'finished':>9} {'wall s':>8} {'cpu s':>8} "
          f"{'s/1k req':>8} {'peak RSS MB':>11}  {'fragsim sim() s':>15}")


def print_row(row: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps({**row, "wall_s_per_1k_requests": round(per_1k(row), 4)}), flush=True)
        return
    fastest = f" (min {row['wall_min_s']:.1f})" if "wall_min_s" in row else ""
    sim = f"{row['sim_wall_s']:>15.1f}" if "sim_wall_s" in row else f"{'':>15}"
    finished = "?" if row.get("finished") is None else f"{row['finished']:,}"
    print(f"{row['tool']:<8} {row['instances']:>4} {'x' + str(row['load_scale']):>5} {row['requests']:>9,} "
          f"{finished:>9} {row['wall_s']:>8.1f} {row['cpu_s']:>8.1f} {per_1k(row):>8.3f} "
          f"{row['peak_rss_mb']:>11,.0f}  {sim}{fastest}", flush=True)


def series_lines(rows: dict[tuple[str, int, int], dict[str, Any]], tool: str, loads: tuple[int, ...],
                 instances: tuple[int, ...]) -> list[str]:
    out = []
    top = max(instances)
    for name, points in (("requests", [(top, k) for k in loads]), ("instances", [(n, n) for n in instances])):
        have = [rows[(tool, n, k)] for n, k in points if (tool, n, k) in rows]
        if len(have) < 2:
            continue
        base = have[0]
        parts = []
        for r in have[1:]:
            x = r["requests"] / base["requests"] if name == "requests" else r["instances"] / base["instances"]
            parts.append(f"x{x:g}: wall {r['wall_s'] / base['wall_s']:.2f}x, cpu {r['cpu_s'] / base['cpu_s']:.2f}x, "
                         f"RSS {r['peak_rss_mb'] / base['peak_rss_mb']:.2f}x")
        what = (f"{name} (load scale {', '.join(str(r['load_scale']) for r in have)} on {top} instances)"
                if name == "requests" else
                f"{name} ({', '.join(str(r['instances']) for r in have)}, load scale = instances)")
        spread = [per_1k(r) for r in have]
        out.append(f"{tool} {what}: {'; '.join(parts)} of the first (linear: the same factor); "
                   f"s/1k req {min(spread):.3f}-{max(spread):.3f}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blis", metavar="PATH/TO/blis",
                        help="BLIS's binary: also run BLIS on the headline configuration, side by side")
    parser.add_argument("--blis-all", action="store_true",
                        help="with --blis: run BLIS on every point of the series too, not only the headline")
    parser.add_argument("--blis-latency-model", choices=("trained-physics", "roofline"), default="trained-physics",
                        help="BLIS's step-time model (default: trained-physics, its fitted one)")
    parser.add_argument("--blis-cache-signal-delay", type=int, default=0, metavar="US",
                        help="BLIS's --cache-signal-delay in microseconds (default 0: live cache reads, "
                             "its fastest; 50000 is BLIS's own default, far slower here)")
    parser.add_argument("--router", choices=ROUTERS, default="round-robin",
                        help="the router, in both simulators (default: round-robin)")
    parser.add_argument("--quick", action="store_true",
                        help="a small check: load scale 1 and 4, instances 1 and 4; the headline is "
                             "16 instances at load scale 4")
    parser.add_argument("--runs", type=int, default=1, metavar="N",
                        help="measure each point N times: median wall (default 1)")
    parser.add_argument("--json", action="store_true", help="one JSON object per measurement instead of a table")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    if args.blis_all and not args.blis:
        parser.error("--blis-all needs --blis PATH/TO/blis")
    if args.blis:
        args.blis = os.path.abspath(args.blis)
        if not os.access(args.blis, os.X_OK):
            parser.error(f"--blis: {args.blis} is not an executable file")

    loads, instances = (QUICK_LOADS, QUICK_INSTANCES) if args.quick else (FULL_LOADS, FULL_INSTANCES)
    headline = (HEADLINE[0], max(loads))
    points = [(HEADLINE[0], k) for k in loads] + [(n, n) for n in instances]
    points = sorted(set(points), key=lambda p: (p[0] * p[1], p[0]))   # cheapest first, the headline last
    blis_points = set(points) if args.blis_all else {headline} if args.blis else set()

    rows: dict[tuple[str, int, int], dict[str, Any]] = {}
    if not args.json:
        print(f"{TRACE}, {MODEL} on {GPU} (tp 1), cost model {COST_MODEL}, {args.router} router; "
              f"wall and CPU of each process, peak RSS its own", flush=True)
        print(HEADER, flush=True)
    with tempfile.TemporaryDirectory(prefix="cluster_speed_") as tmp:
        traces = {k: write_blis_trace(k, Path(tmp)) for k in sorted({k for _, k in blis_points})}
        shown = False
        for n, k in points:
            runs: dict[str, list[dict[str, Any]]] = {"fragsim": [], "blis": []}
            for _ in range(args.runs):
                runs["fragsim"].append(measure_fragsim(n, k, args.router))
                if (n, k) in blis_points:
                    runs["blis"].append(measure_blis(args.blis, traces, n, k, args.router,
                                                     args.blis_latency_model, args.blis_cache_signal_delay,
                                                     show_command=not shown))
                    shown = True
            for tool, measured in runs.items():
                if measured:
                    rows[(tool, n, k)] = median_row(measured)
                    print_row(rows[(tool, n, k)], args.json)
    if args.json:
        return 0
    for tool in ("fragsim", "blis"):
        for line in series_lines(rows, tool, loads, instances):
            print(line)
    f = rows[("fragsim", *headline)]
    print(f"fragsim {headline[0]} instances x{headline[1]}: {f['requests']:,} requests, wall {f['wall_s']:.1f} s "
          f"(simulate() {f['sim_wall_s']:.1f} s), peak RSS {f['peak_rss_mb']:,.0f} MB "
          f"(target < {TARGET_RSS_MB:,.0f} MB: {'met' if f['peak_rss_mb'] < TARGET_RSS_MB else 'NOT met'})")
    b = rows.get(("blis", *headline))
    if b is not None:
        ratio, cpu_ratio = f["wall_s"] / b["wall_s"], f["cpu_s"] / b["cpu_s"]
        print(f"BLIS    {headline[0]} instances x{headline[1]}: {b['requests']:,} requests "
              f"({b['finished'] if b['finished'] is not None else '?'} completed), wall {b['wall_s']:.1f} s, "
              f"peak RSS {b['peak_rss_mb']:,.0f} MB")
        print(f"fragsim / BLIS: wall {ratio:.3f}x (target < {TARGET_RATIO:g}x: "
              f"{'met' if ratio < TARGET_RATIO else 'NOT met'}), CPU {cpu_ratio:.3f}x, "
              f"peak RSS {f['peak_rss_mb'] / b['peak_rss_mb']:.3f}x")
        if args.runs > 1:
            print(f"  (medians of {args.runs} alternating runs; fastest runs: wall "
                  f"{f['wall_min_s'] / b['wall_min_s']:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
