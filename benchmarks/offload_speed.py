"""How fast the offload tiers run: ``fragsim trace hits`` and a replay with a CPU tier.

    python benchmarks/offload_speed.py --traces-dir PATH/TO/shared/traces
    python benchmarks/offload_speed.py --traces-dir PATH/TO/shared/traces --runs 5 --json

1. **Hit rate by capacity** (``fragsim trace hits``): the Mooncake conversation trace
   replayed in request order at five capacities (1e6 … 1e8 tokens), LRU and ARC,
   512-token blocks. Target: under 10 s for the five capacities.
2. **A replay with a tier**: the first 1,000 requests of the same trace on
   Llama-3.1-8B / H100-80GB at 1 request/s with prefix caching, without a tier and
   with a 128 GiB CPU tier: what the tier's lookups, stores and single steps cost.

Each measurement runs ``--runs`` times in this process; ``wall_s`` is the median,
``wall_min_s`` the fastest (a shared machine's noise only ever adds time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

CAPACITIES = [1e6, 3e6, 1e7, 3e7, 1e8]


def timed(fn: Any, runs: int) -> tuple[float, float, Any]:
    walls, out = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls), min(walls), out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces-dir", default=os.environ.get("FRAGSIM_SHARED_TRACES", "../shared/traces"),
                   help="the public traces folder (default: $FRAGSIM_SHARED_TRACES or ../shared/traces)")
    p.add_argument("--runs", type=int, default=3, help="measurements of each (default 3)")
    p.add_argument("--json", action="store_true", help="one JSON object per measurement")
    args = p.parse_args()
    from fragsim.offload.replay import hit_rates
    from fragsim.simulate import RunSpec, load_workload, simulate
    from fragsim.traces import load_trace

    path = Path(args.traces_dir) / "mooncake_conversation.jsonl"
    if not path.exists():
        p.error(f"{path} not found: pass --traces-dir PATH/TO/shared/traces")
    trace = load_trace(str(path))
    rows: list[dict[str, Any]] = []
    for policy in ("lru", "arc"):
        med, low, out = timed(lambda policy=policy: hit_rates(trace, CAPACITIES, policy), args.runs)
        rows.append({"what": f"trace hits, {policy}, 5 capacities", "requests": len(trace), "wall_s": med,
                     "wall_min_s": low, "target_s": 10.0,
                     "hit_rates": [round(r.hit_rate, 4) for r in out]})
    base = dict(trace=str(path), num_requests=1000, rate=1.0, model="llama-3.1-8b", gpu="h100-80gb",
                max_seq_len=131072, max_num_batched_tokens=8192, prefix_caching=True)
    for size in (None, 128.0):
        spec = RunSpec(**base, kv_offloading_size=size)  # type: ignore[arg-type]
        workload = load_workload(spec)
        med, low, result = timed(lambda spec=spec, w=workload: simulate(w, "vllm", spec), args.runs)
        rows.append({"what": f"replay, {'no tier' if size is None else f'{size:g} GiB CPU tier'}",
                     "requests": 1000, "wall_s": med, "wall_min_s": low,
                     "num_steps": result.summary["num_steps"],
                     "external_prefix_cache_hits": result.summary["external_prefix_cache_hits"]})
    for row in rows:
        if args.json:
            print(json.dumps(row))
        else:
            extra = {k: v for k, v in row.items() if k not in ("what", "wall_s", "wall_min_s")}
            print(f"{row['what']:<34} median {row['wall_s']:6.2f} s  min {row['wall_min_s']:6.2f} s  {extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
