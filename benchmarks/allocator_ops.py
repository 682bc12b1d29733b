"""Allocate+free pairs per second for each allocator, at 50% and 90% occupancy.

The engine calls allocate/free once per admitted and finished request and
extend once per token, so the allocators must not be what limits a simulation.
For each allocator the pool is sized so that 1,000 live sequences of realistic
lengths (log-normal, median ~245 slots, clipped to 1..2048) fill the given
fraction of it after the allocator's rounding; then a timed loop frees a random
live sequence and allocates a new one of similar size (the freed size +- 16).
When the new size does not fit, the freed size is allocated instead (it always
fits where it just was); those are counted as ``fallbacks``, and timed too.
The schedule is drawn before the clock starts, so the loop is two calls a pair.

    python benchmarks/allocator_ops.py            # table
    python benchmarks/allocator_ops.py --json     # one JSON object per line

Each figure is the best of ``--repeat`` runs, in CPU time of this process; the
header prints what an empty Python call costs, a yardstick for the machine and
its load (27 ns on a quiet development machine, twice that when it is busy).

Targets on one core of the development machine: paged and static >= 1,000,000
pairs/s, buddy >= 200,000, contiguous >= 100,000.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import timeit
from itertools import count
from typing import Any

from fragsim.allocators import create

MAX_SEQ_LEN = 2048
NUM_SEQS = 1_000
JITTER = 16

#: label -> create() name and options
ALLOCATORS: dict[str, dict[str, Any]] = {
    "static": {"name": "static", "options": {}},
    "contiguous-first": {"name": "contiguous", "options": {"fit": "first"}},
    "contiguous-best": {"name": "contiguous", "options": {"fit": "best"}},
    "buddy": {"name": "buddy", "options": {}},
    "paged": {"name": "paged", "options": {"block_size": 16}},
}


def request_sizes(rng: random.Random, num: int) -> list[int]:
    """Prompt+output lengths shaped like a chat trace: log-normal, clipped to 1..2048."""
    return [min(MAX_SEQ_LEN, max(1, int(rng.lognormvariate(5.5, 0.9)))) for _ in range(num)]


def schedule(rng: random.Random, sizes: list[int], num_pairs: int) -> tuple[list[int], ...]:
    """The timed loop's operations, drawn before timing: pair ``k`` frees
    ``free_ids[k]`` and allocates sequence ``NUM_SEQS + k`` of ``new_sizes[k]``
    slots, or of ``old_sizes[k]`` (the freed size) if that does not fit."""
    live = list(range(len(sizes)))
    sizes = list(sizes)
    free_ids, new_sizes, old_sizes = [], [], []
    for k in range(num_pairs):
        i = rng.randrange(len(live))
        old = sizes[i]
        new = min(MAX_SEQ_LEN, max(1, old + rng.randint(-JITTER, JITTER)))
        free_ids.append(live[i])
        new_sizes.append(new)
        old_sizes.append(old)
        live[i] = len(sizes) + k
        sizes[i] = new
    return free_ids, new_sizes, old_sizes


def run_one(label: str, occupancy: float, num_pairs: int, seed: int) -> dict[str, Any]:
    spec = ALLOCATORS[label]
    rng = random.Random(seed)
    sizes = request_sizes(rng, NUM_SEQS)
    probe = create(spec["name"], 1 << 24, max_seq_len=MAX_SEQ_LEN, **spec["options"])
    owned = sum(probe.rounded(n) for n in sizes)
    allocator = create(
        spec["name"], int(owned / occupancy), max_seq_len=MAX_SEQ_LEN, **spec["options"]
    )
    for seq_id, n in enumerate(sizes):
        if allocator.allocate(seq_id, n) is None:
            raise RuntimeError(f"{label}: fill failed at sequence {seq_id} ({n} slots)")
    allocator.check()
    filled = 1 - allocator.num_free() / allocator.capacity

    free_ids, new_sizes, old_sizes = schedule(rng, sizes, num_pairs)
    fallbacks = 0
    fallen_back: dict[int, int] = {}  # seq_id -> the size it got instead of the planned one
    allocate = allocator.allocate
    free = allocator.free
    # CPU time of this process, not wall time: the development machine is shared,
    # and time spent descheduled says nothing about the allocator.
    start = time.process_time()
    for seq_id, free_id, new in zip(count(NUM_SEQS), free_ids, new_sizes):
        free(free_id)
        if allocate(seq_id, new) is None:
            fallbacks += 1
            old = old_sizes[seq_id - NUM_SEQS]
            old = fallen_back[seq_id] = fallen_back.get(free_id, old)
            if allocate(seq_id, old) is None:
                raise RuntimeError(f"{label}: the freed size {old} no longer fits")
    elapsed = time.process_time() - start
    allocator.check()
    free_slots = allocator.num_free()
    largest = allocator.largest_allocatable()
    return {
        "allocator": label,
        "target_occupancy": occupancy,
        "occupancy_start": round(filled, 4),
        "occupancy_end": round(1 - free_slots / allocator.capacity, 4),
        "capacity": allocator.capacity,
        "live": len(allocator.seq_ids()),
        "pairs": num_pairs,
        "cpu_seconds": round(elapsed, 4),
        "pairs_per_s": round(num_pairs / elapsed),
        "fallbacks": fallbacks,
        "ext_frag_end": round(1 - largest / free_slots, 4) if free_slots else 0.0,
    }


def python_call_ns() -> float:
    """The cost of an empty Python call here, to compare figures across machines and loads."""
    return min(timeit.repeat("f()", "def f(): pass", number=200_000, repeat=5)) / 200_000 * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pairs", type=int, default=200_000, help="timed free+allocate pairs (default 200000)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure; the best is kept")
    parser.add_argument("--json", action="store_true", help="one JSON object per result line")
    parser.add_argument("--only", choices=list(ALLOCATORS), action="append", help="run just these")
    args = parser.parse_args()
    labels = args.only or list(ALLOCATORS)
    call_ns = round(python_call_ns(), 1)
    if not args.json:
        print(f"CPU time, best of {args.repeat}; an empty Python call costs {call_ns} ns here")
        header = ("allocator", "occupancy", "capacity", "pairs/s", "fallbacks", "ext.frag")
        print(f"{header[0]:<18}" + "".join(f"{h:>11}" for h in header[1:]))
    for label in labels:
        for occupancy in (0.5, 0.9):
            runs = [run_one(label, occupancy, args.pairs, args.seed) for _ in range(args.repeat)]
            row = max(runs, key=lambda r: r["pairs_per_s"])
            row["py_call_ns"] = call_ns
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"{label:<18}{row['occupancy_start']:>11.1%}{row['capacity']:>11,}"
                    f"{row['pairs_per_s']:>11,}{row['fallbacks']:>11,}{row['ext_frag_end']:>11.1%}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
