#!/usr/bin/env python
"""Reference harness: vLLM 0.33.0's own lookup over KV cache groups, on given tier states.

Not part of fragsim or its tests: run it with the Python of a scratch virtualenv that
has the vLLM 0.33.0 wheel (see ``vllm_reference.py``). ``offload_groups_crosscheck.py``
writes its input and compares the answers.

Usage: VLLM_PYTHON benchmarks/offload_groups_reference.py INPUT.json  -> one JSON object.

Input: {"cases": [{"name", "chunk", "block", "groups": [{"kind", "window"?, "chunk"?}],
"states": ["H.P...", ...] (one string per group, one letter per chunk: H held, P being
written, . missing), "computed", "num_tokens"}]}.

Each case runs ``OffloadingConnectorScheduler._lookup_complete_chunks`` itself, on a
scheduler whose manager answers lookups from ``states`` (GPU prefix caching off, no
EAGLE groups, no load cap). Output: {"results": [{"name", "hit"}]}, ``hit`` the
tokens past the GPU hit (null: the request is deferred).
"""

import json
import os
import sys
import types

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as sched  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (  # noqa: E402
    get_sliding_window_size_in_chunks,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.base import LookupResult  # noqa: E402

ANSWER = {"H": LookupResult.HIT, "P": LookupResult.HIT_PENDING, ".": LookupResult.MISS}


def spec_of(group: dict, block: int):
    common = dict(block_size=block, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    if group["kind"] == "sliding":
        return SlidingWindowSpec(sliding_window=group["window"], **common)
    if group["kind"] == "chunked":
        return ChunkedLocalAttentionSpec(attention_chunk_size=group["chunk"], **common)
    return FullAttentionSpec(**common)


def run_case(case: dict) -> dict:
    chunk, block = case["chunk"], case["block"]
    configs = []
    for g, group in enumerate(case["groups"]):
        spec = spec_of(group, block)
        configs.append(sched.GroupOffloadConfig(
            group_idx=g, tokens_per_block=block, tokens_per_chunk=chunk, hashes_per_chunk=chunk // block,
            kv_event_group_spec=None, sliding_window_size_in_chunks=get_sliding_window_size_in_chunks(spec, chunk),
            kv_cache_spec=spec, manager_cls=None))
    full = tuple(i for i, c in enumerate(configs) if c.sliding_window_size_in_chunks is None)
    windows = tuple(sorted((i for i, c in enumerate(configs) if c.sliding_window_size_in_chunks is not None),
                           key=lambda i: configs[i].sliding_window_size_in_chunks, reverse=True))
    states = case["states"]

    stub = types.SimpleNamespace()
    stub.config = types.SimpleNamespace(kv_group_configs=tuple(configs))
    stub.manager = types.SimpleNamespace(lookup=lambda key, ctx: ANSWER[states[key[0]][key[1]]])
    stub._events_tracker = types.SimpleNamespace(record_lookup=lambda *a: None)
    stub._full_attention_groups, stub._sliding_window_groups = full, windows
    stub._lookup_groups = full + windows
    stub._mamba_align_size = None
    stub._chunks_being_loaded = None
    for name in ("_maximal_prefix_lookup", "_sliding_window_lookup"):
        setattr(stub, name, types.MethodType(getattr(sched.OffloadingConnectorScheduler, name), stub))

    num_keys = case["num_tokens"] // chunk
    req = types.SimpleNamespace(num_tokens=case["num_tokens"], request_id="r")
    group_states = tuple(sched.RequestGroupState(offload_keys=[(g, i) for i in range(num_keys)])
                         for g in range(len(configs)))
    req_status = types.SimpleNamespace(num_locally_computed_tokens=case["computed"], req=req,
                                       max_load_tokens=None, group_states=group_states, req_context=None)
    hit = sched.OffloadingConnectorScheduler._lookup_complete_chunks(stub, req_status)
    return {"name": case["name"], "hit": hit}


def main() -> None:
    with open(sys.argv[1]) as f:
        cases = json.load(f)["cases"]
    print(json.dumps({"results": [run_case(case) for case in cases]}))


if __name__ == "__main__":
    main()
