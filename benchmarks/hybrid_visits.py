"""Where a hybrid run's manager work comes from: how often decoding sequences meet it.

    python benchmarks/hybrid_visits.py                       # the --hybrid models under vllm-hybrid
    python benchmarks/hybrid_visits.py --model gemma-3-27b --allocator jenga

Runs the peer configuration of ``sim_speed.py --hybrid`` (azure-conv, A100-80GB,
max-seq-len 16,384, 256 sequences, 2,048 batched tokens) and counts, over the
single steps' batched growth (``grow_many``), the sequences that meet the manager
and those among them that only free blocks (a sliding or chunked window passing a
block boundary, no block taken): the work a manager that freed window blocks lazily,
with the next take, would not do. Also counts stretches and their block moves.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from fragsim.simulate import RunSpec, load_workload, make_engine

MODELS = ["mistral-7b-v0.1", "gpt-oss-20b", "gemma-3-27b"]


def visits(model: str, allocator: str) -> dict[str, float]:
    spec = RunSpec(trace="azure-conv", model=model, gpu="a100-80gb", max_seq_len=16384,
                   max_num_seqs=256, max_num_batched_tokens=2048)
    engine = make_engine(load_workload(spec), allocator, spec)
    m = engine.kv.manager  # type: ignore[attr-defined]
    counts = {"grow_calls": 0, "visits": 0, "free_only": 0}
    grow_many = m.grow_many

    def counted(seqs, targets):  # type: ignore[no-untyped-def]
        per_shape = m.state.grow_moves(list(seqs), list(targets))[1]   # the moves, nothing changed
        frees = np.array([shape[4] for shape in per_shape]).sum(axis=0)
        takes = np.array([shape[5] for shape in per_shape]).sum(axis=0)
        counts["grow_calls"] += 1
        counts["visits"] += len(seqs)
        counts["free_only"] += int(((frees > 0) & (takes == 0)).sum())
        return grow_many(seqs, targets)

    m.grow_many = counted
    engine.run()
    return {**counts, "free_only_frac": counts["free_only"] / max(counts["visits"], 1),
            "visits_per_call": counts["visits"] / max(counts["grow_calls"], 1), "steps": engine.num_steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help=f"model (repeatable; default {', '.join(MODELS)})")
    parser.add_argument("--allocator", default="vllm-hybrid", help="hybrid manager (default vllm-hybrid)")
    args = parser.parse_args(argv)
    for model in args.model or MODELS:
        v = visits(model, args.allocator)
        print(f"{model:>18s} {args.allocator}: {v['grow_calls']:>7,} growth steps, {v['visits']:>9,} sequence "
              f"visits ({v['visits_per_call']:.1f} a step), {v['free_only_frac']:.0%} only free blocks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
