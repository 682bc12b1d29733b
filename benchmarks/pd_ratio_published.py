"""Prefill:decode ratios against the Mooncake paper's P/D ratio experiment (FAST'25,
Figure 15), held out: nothing in fragsim is fitted to it.

The paper splits a cluster of 16 nodes (eight A800-80GB GPUs each, a dummy LLaMA3-70B)
into P prefill and 16 − P decoding nodes, from 5P11D to 11P5D, replays its synthetic
workload, and counts a request effective when its TTFT is at most 10 s and its TBT at
most 100 ms. It reports, in its text:

- more prefill nodes lower the average TTFT and raise the average TBT, and the
  reverse (Figure 15b);
- the effective request capacity is highest near 1:1 (Figure 15a: 8P8D).

fragsim replays the same trace file (the public ``mooncake_synthetic.jsonl``, 3,993
requests over 17 minutes, at its own timestamps) on 16 instances of Llama-3.1-70B
(LLaMA3-70B's architecture) at tp 8 on A100-80GB presets, with prefix caching, at each
split, with the SLOs of the paper (``--slo-ttft 10 --slo-tpot 0.1``). The paper's TBT
is the mean of each request's slowest 10% of token gaps; fragsim's TPOT is the mean
gap, so it reads lower. Step times are the roofline model's. What is compared is the
direction of each trend and where the effective share peaks.

    python benchmarks/pd_ratio_published.py --traces-dir PATH/TO/shared/traces
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from routing_published import MOONCAKE_CLUSTER

from fragsim.simulate import RunSpec, load_workload, simulate

SPLITS = tuple(range(5, 12))        # prefill instances of 16: 5P11D .. 11P5D


def run(trace_path: Path, prefill: int, num_requests: int | None, load_scale: int) -> dict:
    spec = RunSpec(trace=str(trace_path), num_requests=num_requests, load_scale=load_scale,
                   prefill_instances=prefill, decode_instances=16 - prefill, router="least-loaded",
                   slo_ttft_s=10.0, slo_tpot_s=0.1, **MOONCAKE_CLUSTER)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    s = simulate(load_workload(spec), "vllm", spec).summary
    n = s["num_requests"]
    return {"split": f"{prefill}P{16 - prefill}D", "mean_ttft_s": s["mean_ttft_s"], "mean_tpot_s": s["mean_tpot_s"],
            "effective": s["goodput_rps"] * s["sim_time_s"] / n if n else 0.0, "goodput_rps": s["goodput_rps"],
            "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces-dir", type=Path, required=True, help="folder holding mooncake_synthetic.jsonl")
    ap.add_argument("--num-requests", type=int, default=None, help="the trace's first N requests (default: all)")
    ap.add_argument("--load-scale", type=int, default=1, help="K merged copies of the trace (default 1)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    trace = args.traces_dir / "mooncake_synthetic.jsonl"
    rows = []
    for p in SPLITS:
        rows.append(run(trace, p, args.num_requests, args.load_scale))
        print(f"  {rows[-1]['split']}: {rows[-1]['wall_s']} s", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'split':<7} {'mean TTFT':>10} {'mean TPOT':>10} {'effective':>10}")
    for r in rows:
        print(f"{r['split']:<7} {r['mean_ttft_s']:>9.2f}s {r['mean_tpot_s'] * 1e3:>8.1f}ms {r['effective']:>9.1%}")
    ttft = [r["mean_ttft_s"] for r in rows]
    tpot = [r["mean_tpot_s"] for r in rows]
    best = max(rows, key=lambda r: r["effective"])
    falls = all(a >= b for a, b in zip(ttft, ttft[1:], strict=False))
    rises = all(a <= b for a, b in zip(tpot, tpot[1:], strict=False))
    print(f"more prefill instances: TTFT {'falls' if falls else 'does not fall'} at every step, "
          f"TPOT {'rises' if rises else 'does not rise'} at every step (paper: both); "
          f"most effective: {best['split']} (paper: 8P8D)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
