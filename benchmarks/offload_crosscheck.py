"""fragsim's offload tier against vLLM 0.33.0's own CPUOffloadingManager, call for call.

Two kinds of case, each run for LRU and ARC:

- **request order**: a trace's requests in order, each making the calls of
  ``fragsim.offload.replay`` (arrive, look up until the first miss, load the hits,
  store the rest, finish). vLLM's manager gets the same calls; the hit chunks of
  every request (``fragsim trace hits``'s ``hit_blocks_per_request``) must agree.
- **interleaved**: many requests at once, in a seeded random order of their calls,
  with loads and stores left in flight across other requests' calls, some stores
  failing, and a store threshold of 2 as well as 1. Every lookup, every store's
  stored and evicted keys, must agree.

    python benchmarks/offload_crosscheck.py --vllm-python /path/to/vllm-venv/bin/python

Prints one line per case and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from fragsim.offload.replay import chunk_keys, replay
from fragsim.offload.tier import Lookup, RequestAccess, Tier
from fragsim.traces import load_trace

HERE = Path(__file__).resolve().parent
TRACES = ["mooncake_synthetic.jsonl", "mooncake_conversation.jsonl"]
CAPACITY_TOKENS = [300_000, 3_000_000, 30_000_000]


def request_order_case(name: str, keys: list[list[int]], num_chunks: int, policy: str,
                       store_threshold: int) -> tuple[dict, list[int]]:
    hits, _ = replay(keys, num_chunks, policy, store_threshold)
    ops: list[list] = []
    tier = Tier(num_chunks, policy, store_threshold=store_threshold)  # to know what was stored
    for r, (request, hit) in enumerate(zip(keys, hits, strict=True)):
        access = RequestAccess({k: i + 1 for i, k in enumerate(request)})
        ops += [["new", r, request], ["lookup", r, 0]]
        if hit:
            ops += [["load", r, request[:hit]], ["load_done", r, request[:hit]]]
            tier.prepare_load(request[:hit], access)
            tier.complete_load(request[:hit])
        if hit < len(request):
            ops.append(["store", r, request[hit:]])
            out = tier.prepare_store(request[hit:], access)
            if out is not None and out.stored:
                ops.append(["store_done", r, out.stored, True])
                tier.complete_store(out.stored)
        ops.append(["finish", r])
        tier.finish(access)
    case = {"name": name, "policy": policy, "num_chunks": num_chunks,
            "store_threshold": store_threshold, "ops": ops}
    return case, hits


def interleaved_case(name: str, seed: int, policy: str, store_threshold: int,
                     num_chunks: int = 40, num_requests: int = 400) -> tuple[dict, list]:
    """Requests sharing prefixes from a few families, their calls interleaved at random."""
    rng = random.Random(seed)
    families = [[rng.randrange(1, 10**6) for _ in range(30)] for _ in range(6)]
    tier = Tier(num_chunks, policy, store_threshold=store_threshold)
    ops: list[list] = []
    answers: list = []
    live: dict[int, dict] = {}
    next_request = 0

    def emit(op: list, answer: object = None) -> None:
        ops.append(op)
        answers.append(answer)

    while next_request < num_requests or live:
        if next_request < num_requests and (len(live) < 6 and rng.random() < 0.5 or not live):
            r, next_request = next_request, next_request + 1
            family = rng.choice(families)
            shared = rng.randrange(0, len(family))
            keys = family[:shared] + [10**7 + r * 100 + i for i in range(rng.randrange(0, 8))]
            access = RequestAccess({k: i + 1 for i, k in enumerate(keys)})
            live[r] = {"keys": keys, "access": access, "step": "lookup", "loading": [],
                       "writing": [], "start": 0}
            emit(["new", r, keys])
            continue
        r = rng.choice(list(live))
        req = live[r]
        keys, access = req["keys"], req["access"]
        if req["step"] == "lookup":
            hit, pending = 0, False
            for key in keys:
                result = tier.lookup(key)
                if result is Lookup.HIT:
                    hit += 1
                    continue
                pending = result is Lookup.PENDING
                break
            emit(["lookup", r, 0], [hit, pending])
            req["start"] = hit
            if hit:
                tier.prepare_load(keys[:hit], access)
                req["loading"] = keys[:hit]
                emit(["load", r, keys[:hit]])
            req["step"] = "store"
        elif req["loading"] and rng.random() < 0.5:
            tier.complete_load(req["loading"])
            emit(["load_done", r, req["loading"]])
            req["loading"] = []
        elif req["step"] == "store":
            rest = keys[req["start"]:]
            if rest:
                out = tier.prepare_store(rest, access)
                emit(["store", r, rest], None if out is None else [out.stored, out.evicted])
                if out is not None:
                    req["writing"] = out.stored
            req["step"] = "writing"
        elif req["writing"]:
            ok = rng.random() < 0.9
            tier.complete_store(req["writing"], success=ok)
            emit(["store_done", r, req["writing"], ok])
            req["writing"] = []
        elif not req["loading"]:
            tier.finish(access)
            emit(["finish", r])
            del live[r]
    case = {"name": name, "policy": policy, "num_chunks": num_chunks,
            "store_threshold": store_threshold, "ops": ops}
    return case, answers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True, metavar="PATH",
                        help="python of a virtualenv with vllm==0.33.0")
    parser.add_argument("--traces-dir", default=str(HERE.parent.parent / "shared" / "traces"),
                        help="folder of the Mooncake traces (default: %(default)s)")
    parser.add_argument("--seeds", type=int, default=6, help="interleaved cases per policy")
    args = parser.parse_args()

    cases: list[dict] = []
    expected: dict[str, tuple[str, object]] = {}
    for trace_name in TRACES:
        keys = chunk_keys(load_trace(str(Path(args.traces_dir) / trace_name)), 512)
        for policy in ("lru", "arc"):
            for capacity in CAPACITY_TOKENS:
                for threshold in (1, 2):
                    name = f"{trace_name} {policy} {capacity:,} tokens, threshold {threshold}"
                    case, hits = request_order_case(name, keys, capacity // 512, policy, threshold)
                    cases.append(case)
                    expected[name] = ("hits", hits)
    for policy in ("lru", "arc"):
        for seed in range(args.seeds):
            for threshold in (1, 2):
                name = f"interleaved {policy} seed {seed}, threshold {threshold}"
                case, answers = interleaved_case(name, seed, policy, threshold)
                cases.append(case)
                expected[name] = ("answers", answers)

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"cases": cases}, f)
    done = subprocess.run([args.vllm_python, str(HERE / "offload_reference.py"), f.name],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        return 1
    results = json.loads(done.stdout.strip().splitlines()[-1])["results"]
    bad = 0
    for case, result in zip(cases, results, strict=True):
        name = case["name"]
        kind, want = expected[name]
        if kind == "hits":
            got = [a[0] for op, a in zip(case["ops"], result["answers"], strict=False)
                   if op[0] == "lookup"]
        else:
            got = result["answers"]
        ok = "error" not in result and got == want
        if ok:
            detail = (f"{sum(got):,} hit chunks over {len(got):,} requests" if kind == "hits"
                      else f"{len(case['ops']):,} calls")
        else:
            bad += 1
            first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                         min(len(got), len(want)))
            detail = result.get("error", "") + f" first difference at #{first}"
        print(f"{'ok  ' if ok else 'DIFF'} {name}: {detail}")
    print(f"{len(cases) - bad} of {len(cases)} cases agree")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
