#!/usr/bin/env python
"""Reference harness: replay offload-tier calls on vLLM 0.33.0's own CPUOffloadingManager.

Not part of fragsim or its tests: run it with the Python of a scratch virtualenv that
has the vLLM 0.33.0 wheel (see ``vllm_reference.py``). ``offload_crosscheck.py`` writes
its input and compares the answers.

Usage: VLLM_PYTHON benchmarks/offload_reference.py INPUT.json  -> prints one JSON object.

Input: {"cases": [{"name", "policy", "num_chunks", "store_threshold", "ops": [...]}]}.
Each op is a list:

    ["new", r, [key, ...]]          a request arrives with its chunk keys in prompt order
    ["lookup", r, start]            lookups from chunk ``start`` until the first miss
    ["load", r, [key, ...]]         prepare_load
    ["load_done", r, [key, ...]]    complete_load
    ["store", r, [key, ...]]        prepare_store
    ["store_done", r, [key, ...], ok]   complete_store(success=ok)
    ["finish", r]                   on_request_finished

Output: {"results": [{"name", "answers": [...], "error"?}]}, one answer per op:
lookups give [hits, pending] (ready hits until the first miss or pending chunk, and
whether a pending chunk ended the run), stores give null on failure or
[stored keys, evicted keys], other ops give null.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

CHUNK_TOKENS = 512  # positions are chunk end tokens; any increasing numbers would do


def key_of(k: int):
    return make_offload_key(k.to_bytes(8, "big", signed=True), 0)


def int_of(key) -> int:
    return int.from_bytes(key[:-4], "big", signed=True)


def run_case(case: dict) -> dict:
    manager = CPUOffloadingManager(
        num_chunks=case["num_chunks"],
        cache_policy=case["policy"],
        store_threshold=case.get("store_threshold", 1),
    )
    contexts: dict[int, ReqContext] = {}
    keys_of: dict[int, list] = {}
    answers: list = []
    try:
        for op in case["ops"]:
            kind, r = op[0], op[1]
            if kind == "new":
                ctx = ReqContext(req_id=str(r))
                keys = [key_of(k) for k in op[2]]
                for i, key in enumerate(keys):
                    ctx.set_offload_key_position(key, (i + 1) * CHUNK_TOKENS)
                contexts[r], keys_of[r] = ctx, keys
                manager.on_new_request(ctx)
                answers.append(None)
            elif kind == "lookup":
                hits, pending = 0, False
                for key in keys_of[r][op[2]:]:
                    result = manager.lookup(key, contexts[r])
                    if result is LookupResult.HIT:
                        hits += 1
                        continue
                    pending = result is LookupResult.HIT_PENDING
                    break
                answers.append([hits, pending])
            elif kind == "load":
                manager.prepare_load([key_of(k) for k in op[2]], contexts[r])
                answers.append(None)
            elif kind == "load_done":
                manager.complete_load([key_of(k) for k in op[2]], contexts[r])
                answers.append(None)
            elif kind == "store":
                out = manager.prepare_store([key_of(k) for k in op[2]], contexts[r])
                answers.append(None if out is None else [
                    [int_of(k) for k in out.keys_to_store], [int_of(k) for k in out.evicted_keys]])
            elif kind == "store_done":
                manager.complete_store([key_of(k) for k in op[2]], contexts[r], success=op[3])
                answers.append(None)
            elif kind == "finish":
                manager.on_request_finished(contexts.pop(r))
                answers.append(None)
            else:
                raise ValueError(f"unknown op {kind!r}")
    except Exception as exc:  # report where vLLM refused the call sequence
        return {"name": case["name"], "answers": answers, "error": f"{type(exc).__name__}: {exc}"}
    return {"name": case["name"], "answers": answers}


def main() -> None:
    with open(sys.argv[1]) as f:
        brief = json.load(f)
    print(json.dumps({"results": [run_case(case) for case in brief["cases"]]}))


if __name__ == "__main__":
    main()
