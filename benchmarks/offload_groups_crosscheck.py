"""fragsim's lookup over a hybrid model's KV cache groups against vLLM 0.33.0's own.

Draws seeded random cases: one to four groups (full attention, sliding windows of
several sizes, a chunked-local layer), chunks of 16 to 64 tokens, a GPU hit, a prompt
length, and what the tiers hold of each group's chunks (held, being written or
missing, with runs of each). fragsim's ``fragsim.offload.groups.hit_tokens`` answers
each case; vLLM's ``OffloadingConnectorScheduler._lookup_complete_chunks`` answers it
too, run by ``offload_groups_reference.py`` in a Python with vLLM 0.33 installed (as
in docs/validation.md). The tokens past the GPU hit (or "deferred") must agree.

    python benchmarks/offload_groups_crosscheck.py --vllm-python /path/to/vllm-venv/bin/python

Prints a count per kind of answer and every difference; exits 1 on any.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from fragsim.offload.groups import HIT, MISS, PENDING, TierGroup, hit_tokens

HERE = Path(__file__).resolve().parent
LETTER = {"H": HIT, "P": PENDING, ".": MISS}


def states_for(rng: random.Random, n: int) -> str:
    """Runs of held, written and missing chunks (mostly held, so that hits happen)."""
    out = ""
    while len(out) < n:
        out += rng.choices("HP.", weights=(6, 1, 2))[0] * rng.randint(1, 6)
    return out[:n]


def make_case(rng: random.Random, i: int) -> dict:
    block = 16
    chunk = block * rng.choice((1, 2, 4))
    groups: list[dict] = []
    if rng.random() < 0.8:
        groups.append({"kind": "full"})
    for _ in range(rng.randint(0 if groups else 1, 3)):
        if rng.random() < 0.75:
            groups.append({"kind": "sliding", "window": rng.choice((32, 64, 100, 128, 200, 512))})
        else:
            groups.append({"kind": "chunked", "chunk": rng.choice((64, 256))})
    num_tokens = rng.randint(chunk, 40 * chunk)
    computed = block * rng.randint(0, (num_tokens - 1) // block)
    n = num_tokens // chunk
    return {"name": f"case{i}", "chunk": chunk, "block": block, "groups": groups,
            "states": [states_for(rng, n) for _ in groups], "computed": computed, "num_tokens": num_tokens}


def fragsim_hit(case: dict) -> int | None:
    groups = tuple(TierGroup(g["kind"], g.get("window"), g.get("chunk")) for g in case["groups"])
    windowed = any(not g.is_full for g in groups)
    chunk, states = case["chunk"], case["states"]
    limit = min(case["num_tokens"] - windowed, (case["num_tokens"] // chunk) * chunk)
    hit, _ = hit_tokens(groups, chunk, case["computed"], limit, lambda g, i: LETTER[states[g][i]])
    return hit


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", required=True, help="a Python with vLLM 0.33.0 installed")
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    cases = [make_case(rng, i) for i in range(args.cases)]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"cases": cases}, f)
    done = subprocess.run([args.vllm_python, str(HERE / "offload_groups_reference.py"), f.name],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return 2
    theirs = {r["name"]: r["hit"] for r in json.loads(done.stdout.strip().splitlines()[-1])["results"]}
    kinds: Counter[str] = Counter()
    differ = 0
    for case in cases:
        ours, vllm = fragsim_hit(case), theirs[case["name"]]
        kinds["deferred" if vllm is None else "no hit" if vllm == 0 else "hit"] += 1
        if ours != vllm:
            differ += 1
            print(f"{case['name']}: fragsim {ours}, vLLM {vllm}: {json.dumps(case)}")
    shown = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))
    print(f"{len(cases) - differ} of {len(cases)} cases agree ({shown}; seed {args.seed})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
