"""Do routers move the same metrics the same way in fragsim's cluster mode and in BLIS?

    python benchmarks/cluster_routing_blis.py --blis PATH/TO/blis --trace PATH/TO/mooncake_conversation.jsonl
    python benchmarks/cluster_routing_blis.py --blis PATH/TO/blis --trace T.jsonl --num-requests 2000 --rate 4
    python benchmarks/cluster_routing_blis.py --blis PATH/TO/blis --trace T.jsonl --json

Both simulators serve the same requests on N instances (default 4) behind each router, and
the effect of a router is its change against round-robin in each simulator: does a
prefix-aware router raise the prefix-cache hit rate and lower TTFT in both, does
least-loaded lower TTFT and load imbalance in both? The script prints, per simulator and
router, the requests served, the prefix-cache hit rate, mean and p99 TTFT, mean E2E
latency and the load imbalance; then, per effect and metric, the change in each simulator
and whether the signs agree.

The workload. ``--trace`` is a trace with content hashes (Mooncake JSONL with
``hash_ids``, one per 512 prompt tokens, or fragsim's plain CSV with ``block_hashes``); its
first ``--num-requests`` requests (default 3,000) are taken, with their own arrival times or,
with ``--rate R``, re-timed as ``fragsim run --rate R`` does (Poisson, ``--seed``).
Arrivals are rounded to whole microseconds, prompt and output lengths kept, and both
simulators get exactly these.

The shared prefixes. BLIS's trace format (TraceV2: a header YAML and a data CSV) says
what a prompt shares with one column pair, ``prefix_group`` and ``prefix_length``: the
requests of a group share their first ``prefix_length`` tokens, and the rest of every
prompt is its own. That is a flat structure, not the tree of a trace's hash chains (a
conversation's turns share ever longer prefixes, and every prompt of Mooncake's
conversation trace starts with the same block). So the tree is flattened, and both
simulators replay the flattened version:

- a request's shared prefix is the longest run of leading hashes it has in common with at
  least one other request of the window; requests with the same run form a group;
- a group's prefix is that run in whole 512-token blocks, cut (in whole blocks) so that
  every member computes at least one prompt token of its own; a group cut to nothing, and
  a request sharing nothing, has no group;
- BLIS gets ``prefix_group``/``prefix_length`` and ``input_tokens`` = the rest of the
  prompt (it prepends the group's random prefix tokens to the request's own random ones);
  fragsim gets hashes built the same way: the group's blocks are ids of the group alone,
  every other block an id of its own (fragsim's plain CSV, one hash per 512 tokens).

So two requests share exactly the same prompt blocks in both simulators. What the
flattening loses is sharing between groups (a group's prefix that is the start of
another's); the header line gives the share of prompt tokens an unbounded cache could hit
in the original tree and in the flat version.

The deployment, in both: Llama-3.1-8B on H100s at tp 1, 16-token blocks, fragsim's KV pool
of one instance as BLIS's ``--total-kv-blocks``, 131,072 tokens a sequence, 256 sequences
and 8,192 batched tokens a step, prefix caching on. fragsim runs ``fragsim run --allocator
vllm --prefix-caching --cost-model blis-llama-3.1-8b-h100 --max-num-batched-tokens 8192
--instances N --router R``; BLIS runs ``blis replay`` with its ``trained-physics`` step-time
model (fragsim's preset copies an earlier set of BLIS's coefficients), as
``benchmarks/cluster_speed.py`` does, with ``--snapshot-refresh-interval 0`` and
``--cache-signal-delay 0`` (the router reads load and caches live, as fragsim's default).

The routers, side by side (fragsim | BLIS):

- round-robin | round-robin;
- least-loaded, vLLM's ``4 x waiting + running`` | least-loaded, ``queue + batch + in flight``;
- the same fragsim run | ``weighted`` with the ``vllm-dp`` scorer alone (``4 x queue + batch``,
  fragsim's formula);
- prefix-aware, the router's own index of what it sent where | ``weighted``,
  ``prefix-affinity:2,queue-depth:1,kv-utilization:1`` (BLIS's router-side index, an LRU of
  10,000 blocks an instance; fragsim's is sized to the instance's GPU blocks);
- prefix-aware with ``--router-kv-events 0`` (the instances' caches, live) | ``weighted``,
  ``precise-prefix-cache:2,queue-depth:1,kv-utilization:1`` (BLIS's default profile).

Both prefix routers weigh prefix, queue and KV use 2:1:1, but fragsim scores the raw share
of the prompt found (0 to 1) and queue depth as waiting + running, where BLIS min-max
normalises the matched blocks and counts the waiting queue only.

The metrics. TTFT and E2E come from each simulator's per-request results (fragsim's
request table, BLIS's ``--metrics-path`` JSON), p99 by the same interpolation for both;
load imbalance is the busiest instance's requests over the mean, and token imbalance its
prompt and output tokens over the mean (round-robin is even in requests by construction,
not in tokens), both from each request's instance. The hit rates differ in kind: fragsim
counts prompt tokens found in the cache over prompt tokens looked up; BLIS counts cached
blocks a request claimed over those plus every block it allocated, its decode blocks
included, per instance, and averages the instances unweighted. The table gives fragsim's
own rate and, for both, BLIS's definition (for fragsim computed from its per-instance hits
and each request's prompt and output blocks, ``ceil((prompt + output) / 16)``, so within a
block a request of BLIS's count).

Arrival ties. Mooncake's timestamps come in ticks of about 3 s, so its requests arrive in
bursts of up to ~20 at one instant. fragsim's routers count a request routed to an instance
as waiting there at once; BLIS's ``vllm-dp`` and ``queue-depth`` scorers read the instance's
waiting queue, which a request joins only once the instance handles it, so a burst piles
onto one instance (its ``least-loaded`` adds the requests in flight and does not). ``--rate``
gives every request an arrival of its own, and separates that effect from the routers'.

A change counts as 0 within a tolerance (TOL in the effects table: an absolute one for the
hit rates and the imbalance, 2% of round-robin's value for the latencies).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_speed import _timed_process, blis_command  # noqa: E402

COST_MODEL = "blis-llama-3.1-8b-h100"
HASH_BLOCK = 512   # tokens per content hash (Mooncake's hash_ids)
BLIS_COLUMNS = ["request_id", "client_id", "tenant_id", "slo_class", "session_id", "round_index", "prefix_group",
                "prefix_length", "streaming", "input_tokens", "output_tokens", "text_tokens", "image_tokens",
                "audio_tokens", "video_tokens", "reason_ratio", "model", "deadline_us", "server_input_tokens",
                "arrival_time_us", "send_time_us", "first_chunk_time_us", "last_chunk_time_us", "num_chunks",
                "status", "error_message", "finish_reason"]


@dataclass(frozen=True)
class Router:
    """One row of the comparison: a router in fragsim and its counterpart in BLIS."""

    label: str
    fragsim: tuple[str, ...]   # fragsim run's router options
    blis: tuple[str, ...]      # blis replay's routing policy, then any further options

    @property
    def blis_policy(self) -> str:
        return self.blis[0]


ROUTERS = (
    Router("round-robin", ("--router", "round-robin"), ("round-robin",)),
    Router("least-loaded", ("--router", "least-loaded"), ("least-loaded",)),
    Router("least-loaded, vLLM DP score", ("--router", "least-loaded"),
           ("weighted", "--routing-scorers", "vllm-dp:1")),
    Router("prefix-aware, router's index", ("--router", "prefix-aware"),
           ("weighted", "--routing-scorers", "prefix-affinity:2,queue-depth:1,kv-utilization:1")),
    Router("prefix-aware, live cache", ("--router", "prefix-aware", "--router-kv-events", "0"),
           ("weighted", "--routing-scorers", "precise-prefix-cache:2,queue-depth:1,kv-utilization:1")),
)
BASELINE = ROUTERS[0].label

#: (key, title, format, tolerance kind, tolerance) of the compared metrics
METRICS = (
    ("hit_rate_blis_def", "hit rate, BLIS def", "{:.4f}", "abs", 0.002),
    ("mean_ttft_s", "mean TTFT s", "{:.3f}", "rel", 0.02),
    ("p99_ttft_s", "p99 TTFT s", "{:.3f}", "rel", 0.02),
    ("mean_e2e_s", "mean E2E s", "{:.2f}", "rel", 0.02),
    ("load_imbalance", "load imbalance", "{:.3f}", "abs", 0.01),
    ("token_imbalance", "token imbalance", "{:.3f}", "abs", 0.01),
)


# --- the workload -------------------------------------------------------------------------------

@dataclass
class Workload:
    arrival_us: list[int]
    prompt: list[int]
    output: list[int]
    group: list[int]            # -1: no shared prefix
    prefix_len: dict[int, int]  # group -> shared prefix tokens (whole 512-token blocks)
    tree_share: float           # prompt tokens an unbounded cache could hit, original hashes
    flat_share: float           # ... and flattened
    source: str


def _ideal_share(hashes: list[tuple[int, ...]], prompt: list[int]) -> float:
    """Prompt tokens in leading hash blocks some earlier request had (an unbounded cache,
    one instance), over all prompt tokens; a prompt's last token is always computed."""
    seen: set[tuple[int, ...]] = set()
    hit = 0
    for h, p in zip(hashes, prompt, strict=True):
        run = 0
        while run < len(h) and h[: run + 1] in seen:
            run += 1
        hit += min(run * HASH_BLOCK, p - 1)
        seen.update(h[: i + 1] for i in range(len(h)))
    return hit / sum(prompt)


def build_workload(path: str, num_requests: int, rate: float | None, seed: int) -> Workload:
    from fragsim.traces import assign_arrivals, load_trace, slice_trace

    trace = slice_trace(load_trace(path), num_requests=num_requests)
    if trace.block_hashes is None or trace.block_hash_size != HASH_BLOCK:
        raise SystemExit(f"{path}: needs content hashes, one per {HASH_BLOCK} prompt tokens "
                         "(Mooncake's hash_ids or a plain CSV's block_hashes)")
    hashes = [tuple(h) for h in trace.block_hashes]
    if rate is not None:
        trace = assign_arrivals(trace, rate, arrival="poisson", seed=seed)
    prompt, output = trace.prompt_len.tolist(), trace.output_len.tolist()
    arrival_us = np.rint((trace.arrival_s - trace.arrival_s[0]) * 1e6).astype(np.int64).tolist()

    # a request's shared run: its longest run of leading hashes another request has too
    counts: Counter[tuple[int, ...]] = Counter()
    for h in hashes:
        counts.update(h[: i + 1] for i in range(len(h)))
    runs = []
    for h in hashes:
        run = 0
        while run < len(h) and counts[h[: run + 1]] >= 2:
            run += 1
        runs.append(h[:run])
    ids: dict[tuple[int, ...], int] = {}
    raw = [ids.setdefault(r, len(ids)) if r else -1 for r in runs]
    # a group's prefix: whole blocks, at least one prompt token of each member left to compute
    blocks = {g: len(r) for r, g in ids.items()}
    for g, p in zip(raw, prompt, strict=True):
        if g >= 0:
            blocks[g] = min(blocks[g], (p - 1) // HASH_BLOCK)
    group = [g if g >= 0 and blocks[g] > 0 else -1 for g in raw]
    prefix_len = {g: b * HASH_BLOCK for g, b in blocks.items() if b > 0}
    flat_hashes = flat_block_hashes(group, prefix_len, prompt)
    return Workload(arrival_us, prompt, output, group, prefix_len, _ideal_share(hashes, prompt),
                    _ideal_share(flat_hashes, prompt), f"{trace.name}, first {len(prompt):,} requests"
                    + (f", Poisson arrivals at {rate:g}/s (seed {seed})" if rate is not None else ", own arrivals"))


def flat_block_hashes(group: list[int], prefix_len: dict[int, int], prompt: list[int]) -> list[tuple[int, ...]]:
    """Each request's hashes, one per 512 tokens: its group's blocks (ids of the group
    alone), then ids of its own."""
    out = []
    fresh = 0
    group_base = {g: i * (1 << 20) + (1 << 40) for i, g in enumerate(sorted(prefix_len))}
    for g, p in zip(group, prompt, strict=True):
        shared = prefix_len[g] // HASH_BLOCK if g >= 0 else 0
        own = math.ceil(p / HASH_BLOCK) - shared
        out.append(tuple(group_base[g] + j for j in range(shared)) + tuple(range(fresh, fresh + own)))
        fresh += own
    return out


def write_fragsim_trace(w: Workload, path: Path) -> None:
    """fragsim's plain CSV: arrivals in seconds (whole microseconds), lengths, hashes."""
    from fragsim.traces import Trace, save_trace

    save_trace(Trace(name=path.stem, source=str(path), arrival_s=np.asarray(w.arrival_us) / 1e6,
                     prompt_len=np.asarray(w.prompt), output_len=np.asarray(w.output),
                     block_hashes=flat_block_hashes(w.group, w.prefix_len, w.prompt),
                     block_hash_size=HASH_BLOCK), path)


def write_blis_trace(w: Workload, header: Path, data: Path) -> None:
    """BLIS's TraceV2: a group's requests share their first prefix_length tokens, and
    input_tokens is the rest of the prompt."""
    header.write_text("trace_version: 2\ntime_unit: us\nmode: real\nwarm_up_requests: 0\n")
    with open(data, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(BLIS_COLUMNS)
        for i, (us, p, o, g) in enumerate(zip(w.arrival_us, w.prompt, w.output, w.group, strict=True)):
            shared = w.prefix_len[g] if g >= 0 else 0
            own = p - shared
            out.writerow([i, "c0", "", "", "", 0, f"g{g}" if g >= 0 else "", shared, "false", own, o, own,
                          0, 0, 0, 0, "", 0, 0, us, us, 0, 0, 0, "ok", "", ""])


# --- the runs -----------------------------------------------------------------------------------

def fragsim_args(trace: Path, instances: int, router: Router) -> list[str]:
    """``fragsim run``'s options (less ``--allocator vllm --json --no-save``)."""
    return ["--trace", str(trace), "--instances", str(instances), "--prefix-caching", "--cost-model", COST_MODEL,
            "--max-num-batched-tokens", "8192", *router.fragsim]


def make_spec(args: list[str]) -> Any:
    """The RunSpec ``fragsim run`` builds from ``args`` (its own parser and builder)."""
    from fragsim.cli.run_options import add_system_options, add_workload_options, spec_from_args

    parser = argparse.ArgumentParser()
    add_workload_options(parser)
    add_system_options(parser)
    return spec_from_args(parser.parse_args(args))


def _tail(values: np.ndarray) -> dict[str, float]:
    return {"mean": float(values.mean()), "p99": float(np.percentile(values, 99))}


def _imbalance(instance_of_request: list[int], instances: int, weights: Any = None) -> float:
    """The busiest instance's requests (or, with ``weights``, tokens) over the mean."""
    counts = np.bincount(np.asarray(instance_of_request, dtype=np.int64), weights=weights, minlength=instances)
    return float(counts.max() / counts.mean())


def run_fragsim(trace: Path, instances: int, router: Router, block: int) -> dict[str, Any]:
    from fragsim.simulate import load_workload, simulate

    spec = make_spec(fragsim_args(trace, instances, router))
    result = simulate(load_workload(spec), "vllm", spec)
    s, req = result.summary, result.requests
    done = req[req["status"] == "finished"] if "status" in req else req
    ttft, e2e = _tail(done["ttft_s"].to_numpy(float)), _tail(done["e2e_latency_s"].to_numpy(float))
    # BLIS's hit rate: per instance, blocks found / (found + allocated), decode blocks included
    req_blocks = -(-(req["prompt_len"].to_numpy(np.int64) + req["output_len"].to_numpy(np.int64)) // block)
    per_blocks = np.bincount(req["instance"].to_numpy(np.int64), weights=req_blocks, minlength=instances)
    rates = [(inst["prefix_cache_hits"] / block) / per_blocks[i] if per_blocks[i] else 0.0
             for i, inst in enumerate(s["instances"])]
    return {"simulator": "fragsim", "router": router.label, "requests": len(req), "finished": int(s["num_finished"]),
            "preemptions": int(s["num_preemptions"]), "hit_rate_own": float(s["prefix_cache_hit_rate"]),
            "hit_rate_blis_def": float(np.mean(rates)), "mean_ttft_s": ttft["mean"], "p99_ttft_s": ttft["p99"],
            "mean_e2e_s": e2e["mean"], "load_imbalance": _imbalance(req["instance"].tolist(), instances),
            "token_imbalance": _imbalance(req["instance"].tolist(), instances,
                                          req["prompt_len"].to_numpy(float) + req["output_len"].to_numpy(float)),
            "load_imbalance_fragsim": float(s["load_imbalance"])}


def run_blis(binary: str, header: Path, data: Path, instances: int, router: Router, spec: Any,
             folder: Path) -> dict[str, Any]:
    metrics_path = folder / "blis_metrics.json"
    cmd = blis_command(binary, header, data, instances, router.blis_policy, spec, "trained-physics", 0)
    cmd += [*router.blis[1:], "--snapshot-refresh-interval", "0", "--metrics-path", str(metrics_path)]
    _timed_process(cmd, cwd=os.path.dirname(binary))
    m = json.loads(metrics_path.read_text())
    reqs = m.get("requests") or []
    ttft = _tail(np.array([r["ttft_ms"] for r in reqs], dtype=float) / 1e3)
    e2e = _tail(np.array([r["e2e_ms"] for r in reqs], dtype=float) / 1e3)
    where = [int(str(r["handled_by"]).rsplit("_", 1)[-1]) for r in reqs]
    tokens = [float(r["num_prefill_tokens"]) + float(r["num_decode_tokens"]) for r in reqs]
    return {"simulator": "BLIS", "router": router.label, "requests": int(m["injected_requests"]),
            "finished": int(m["completed_requests"]), "preemptions": int(m["preemption_count"]),
            "hit_rate_own": float(m["cache_hit_rate"]), "hit_rate_blis_def": float(m["cache_hit_rate"]),
            "mean_ttft_s": ttft["mean"], "p99_ttft_s": ttft["p99"], "mean_e2e_s": e2e["mean"],
            "load_imbalance": _imbalance(where, instances), "token_imbalance": _imbalance(where, instances, tokens),
            "blis_ttft_mean_s": m["ttft_mean_ms"] / 1e3, "blis_ttft_p99_s": m["ttft_p99_ms"] / 1e3}


# --- the report ---------------------------------------------------------------------------------

def _sign(delta: float, base: float, kind: str, tol: float) -> int:
    limit = tol if kind == "abs" else tol * abs(base)
    return 0 if abs(delta) <= limit else (1 if delta > 0 else -1)


def effects(rows: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for router in ROUTERS[1:]:
        for key, title, _, kind, tol in METRICS:
            item: dict[str, Any] = {"effect": f"{router.label} vs {BASELINE}", "metric": key, "title": title,
                                    "tolerance": f"{tol:g}" if kind == "abs" else f"{tol:.0%} of base"}
            signs = []
            for sim in ("fragsim", "BLIS"):
                base, new = rows[(sim, BASELINE)][key], rows[(sim, router.label)][key]
                delta = new - base
                sign = _sign(delta, base, kind, tol)
                signs.append(sign)
                item[sim] = {"base": base, "value": new, "delta": delta,
                             "relative": delta / base if base else None, "sign": sign}
            a, b = signs
            item["signs"] = "agree" if a == b else "DISAGREE" if a * b < 0 else "one ~0"
            out.append(item)
    return out


def _change(d: dict[str, Any], fmt: str) -> str:
    sign = {1: "+", -1: "-", 0: "0"}[d["sign"]]
    rel = f" ({d['relative']:+.0%})" if d["relative"] is not None and abs(d["relative"]) < 100 else ""
    return f"{sign} {(fmt.format(d['delta']) if d['delta'] < 0 else '+' + fmt.format(d['delta']))}{rel}"


def print_report(w: Workload, instances: int, rows: dict[tuple[str, str], dict[str, Any]],
                 found: list[dict[str, Any]], blis_note: str) -> None:
    grouped = sum(g >= 0 for g in w.group)
    print(f"{w.source}; {instances} instances; Llama-3.1-8B on H100 (tp 1), 16-token blocks, "
          f"8,192 batched tokens a step")
    print(f"shared prefixes, flattened: {len(w.prefix_len):,} groups holding {grouped:,} requests; prompt tokens "
          f"an unbounded cache could hit: {w.flat_share:.1%} flat (both simulators) vs {w.tree_share:.1%} "
          f"in the original hash tree")
    print(blis_note)
    for router in ROUTERS:
        print(f"  {router.label:<29} fragsim {' '.join(router.fragsim):<43} | BLIS --routing-policy "
              f"{' '.join(router.blis)}")
    print()
    head = (f"{'simulator':<8} {'router':<29} {'served':>7} {'preempt':>7} {'hit own':>8} "
            + " ".join(f"{t:>{max(len(t), 8)}}" for _, t, *_ in METRICS))
    print(head)
    print("-" * len(head))
    for sim in ("fragsim", "BLIS"):
        for router in ROUTERS:
            r = rows[(sim, router.label)]
            cells = " ".join(f"{f.format(r[k]):>{max(len(t), 8)}}" for k, t, f, *_ in METRICS)
            print(f"{sim:<8} {router.label:<29} {r['finished']:>7,} {r['preemptions']:>7,} "
                  f"{r['hit_rate_own']:>8.4f} {cells}")
    print("hit own: fragsim's prompt tokens found / looked up; BLIS's own rate is its BLIS-def column")
    print()
    print("effects (router vs round-robin): change in each simulator; sign + / - / 0 (within TOL)")
    head = f"{'router':<29} {'metric':<19} {'fragsim':>18} {'BLIS':>18}  {'signs':<9} TOL"
    print(head)
    print("-" * len(head))
    formats = {k: f for k, _, f, *_ in METRICS}
    for item in found:
        fmt = formats[item["metric"]]
        print(f"{item['effect'].split(' vs ')[0]:<29} {item['title']:<19} {_change(item['fragsim'], fmt):>18} "
              f"{_change(item['BLIS'], fmt):>18}  {item['signs']:<9} {item['tolerance']}")
    tally = Counter(item["signs"] for item in found)
    print(f"signs: {tally.get('agree', 0)} agree, {tally.get('DISAGREE', 0)} disagree, "
          f"{tally.get('one ~0', 0)} with one side within tolerance (of {len(found)})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blis", required=True, metavar="PATH/TO/blis",
                        help="BLIS's binary (run from its own folder, where defaults.yaml, "
                             "hardware_config.json and model_configs/ lie)")
    parser.add_argument("--trace", required=True, metavar="PATH",
                        help="a trace with content hashes, e.g. Mooncake's conversation trace (JSONL with hash_ids)")
    parser.add_argument("--num-requests", type=int, default=3000, metavar="N",
                        help="the trace's first N requests (default 3000)")
    parser.add_argument("--rate", type=float, default=None, metavar="R",
                        help="re-time arrivals as a Poisson process at R requests/s, as fragsim run "
                             "--rate does (default: the trace's own arrivals)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --rate arrivals (default 0)")
    parser.add_argument("--instances", type=int, default=4, metavar="N", help="instances (default 4)")
    parser.add_argument("--keep", metavar="DIR",
                        help="write the two traces (fragsim's CSV, BLIS's YAML + CSV) to DIR and keep them")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per run, then one per effect and metric, instead of tables")
    args = parser.parse_args(argv)
    binary = os.path.abspath(args.blis)
    if not os.access(binary, os.X_OK) or os.path.isdir(binary):
        parser.error(f"--blis: {args.blis} is not an executable file")
    if args.num_requests < 1 or args.instances < 2:
        parser.error("--num-requests must be >= 1 and --instances >= 2")

    w = build_workload(args.trace, args.num_requests, args.rate, args.seed)
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="cluster_routing_") as tmp:
        folder = Path(args.keep) if args.keep else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        trace, header, data = folder / "workload.csv", folder / "workload.yaml", folder / "workload_blis.csv"
        write_fragsim_trace(w, trace)
        write_blis_trace(w, header, data)
        spec = make_spec(fragsim_args(trace, args.instances, ROUTERS[0]))
        done: dict[tuple[str, ...], dict[str, Any]] = {}
        for router in ROUTERS:
            if router.fragsim not in done:
                done[router.fragsim] = run_fragsim(trace, args.instances, router, spec.block_size)
            rows[("fragsim", router.label)] = {**done[router.fragsim], "router": router.label}
            rows[("BLIS", router.label)] = run_blis(binary, header, data, args.instances, router, spec, folder)
            if not args.json:
                print(f"  ran {router.label}", file=sys.stderr, flush=True)
        blis_cmd = blis_command("blis", header.relative_to(folder), data.relative_to(folder), args.instances,
                                "ROUTER", spec, "trained-physics", 0)
    found = effects(rows)
    if args.json:
        for row in rows.values():
            print(json.dumps(row))
        for item in found:
            print(json.dumps(item))
        return 0
    blis_note = ("fragsim run --trace workload.csv --allocator vllm --json --no-save "
                 + " ".join(fragsim_args(Path("workload.csv"), args.instances, ROUTERS[0])[2:-2]) + " ROUTER-OPTIONS\n"
                 + " ".join(str(c) for c in blis_cmd).replace("--routing-policy ROUTER", "--routing-policy ROUTER-OPTIONS")
                 + " --snapshot-refresh-interval 0\nrouters (ROUTER-OPTIONS):")
    print_report(w, args.instances, rows, found, blis_note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
