"""Prefix hit rate against cache capacity, beside the Mooncake paper's (held out).

    python benchmarks/hit_rate_published.py --traces-dir PATH/TO/shared/traces
    python benchmarks/hit_rate_published.py --traces-dir PATH/TO/shared/traces --json

The published curves: Qin et al., "Mooncake: Trading More Storage for Less
Computation", FAST 2025 (github.com/kvcache-ai/Mooncake, FAST25-release/
Mooncake-FAST25.pdf), Figure 9 (§5.3.1): the hit rate of one cache against its
capacity in tokens, replaying only the order of the requests of each trace, in
512-token blocks; Table 2 gives each trace's "cache ratio", the top of its curve.
The paper prints no curve values: the ones below were read from the figure's vector
drawing against its gridlines (about ±0.002); its printed labels at 3M tokens (the
hit rate as a share of the maximum) and Table 2's ratios are checked as printed.
The paper names no eviction policy and does not say whether a block found past a
miss counts.

fragsim's replay is ``fragsim trace hits`` (``fragsim.offload.replay``): the calls
vLLM 0.33's offloading connector makes on its CPU manager, request by request: a
lookup from the first chunk to the first miss, the hits loaded, the rest stored.
Nothing here is fitted to these curves. The conversation and synthetic traces are
the two of the paper's three that the public traces folder holds.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

#: FAST'25 Figure 9, read from the plot (tokens -> hit rate), and Table 2's cache ratio
FIGURE_9 = {
    "mooncake_conversation.jsonl": {
        1e4: 0.045, 1e5: 0.073, 1e6: 0.087, 2e6: 0.120, 4e6: 0.215, 5e6: 0.247, 8e6: 0.300,
        1e7: 0.326, 5e7: 0.398, 1e8: 0.401},
    "mooncake_synthetic.jsonl": {
        1e4: 0.000, 1e5: 0.012, 1e6: 0.146, 2e6: 0.235, 4e6: 0.381, 5e6: 0.435, 8e6: 0.545,
        1e7: 0.589, 5e7: 0.658, 1e8: 0.658},
}
TABLE_2_CACHE_RATIO = {"mooncake_conversation.jsonl": 0.40, "mooncake_synthetic.jsonl": 0.66}
#: Figure 9's printed labels: at 3M tokens, this share of the trace's maximum
LABEL_3M = {"mooncake_conversation.jsonl": 0.41, "mooncake_synthetic.jsonl": 0.46}


def compare(path: Path, policy: str) -> dict[str, object]:
    from fragsim.offload.replay import hit_rates
    from fragsim.traces import load_trace

    published = FIGURE_9[path.name]
    capacities = [*published, 3e6]
    rates = hit_rates(load_trace(str(path)), [int(c) for c in capacities], policy)
    ours = {float(r.capacity_tokens): r.hit_rate for r in rates}
    rows = [{"capacity_tokens": c, "paper": p, "fragsim": ours[c], "points": 100 * (ours[c] - p)}
            for c, p in published.items()]
    errors = [abs(r["points"]) for r in rows]
    return {"trace": path.name, "policy": policy, "requests": rates[0].requests, "rows": rows,
            "mean_abs_points": sum(errors) / len(errors), "max_abs_points": max(errors),
            "max_hit_rate": rates[0].max_hit_rate, "table_2_cache_ratio": TABLE_2_CACHE_RATIO[path.name],
            "share_of_max_at_3m": ours[3e6] / rates[0].max_hit_rate, "label_at_3m": LABEL_3M[path.name]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces-dir", default=os.environ.get("FRAGSIM_SHARED_TRACES"),
                   help="the public traces folder (default: $FRAGSIM_SHARED_TRACES)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    args = p.parse_args()
    if not args.traces_dir:
        p.error("give --traces-dir PATH/TO/shared/traces (or set FRAGSIM_SHARED_TRACES)")
    out = [compare(Path(args.traces_dir) / name, policy)
           for name in FIGURE_9 for policy in ("lru", "arc")]
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for c in out:
        print(f"{c['trace']} ({c['requests']:,} requests), {c['policy'].upper()}: hit rate against "
              "capacity, FAST'25 Fig. 9 (read from the plot) / fragsim")
        for r in c["rows"]:
            print(f"  {r['capacity_tokens']:>13,.0f} tokens  {r['paper']:6.1%}  {r['fragsim']:6.1%}"
                  f"  {r['points']:+5.1f} points")
        print(f"  mean |difference| {c['mean_abs_points']:.1f} points, worst {c['max_abs_points']:.1f}")
        print(f"  most any capacity gives: {c['max_hit_rate']:.1%} (Table 2's cache ratio "
              f"{c['table_2_cache_ratio']:.0%}); at 3M tokens {c['share_of_max_at_3m']:.0%} of it "
              f"(Fig. 9's label {c['label_at_3m']:.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
