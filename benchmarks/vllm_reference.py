#!/usr/bin/env python
"""Reference harness: run vLLM 0.33.0's own KV-cache planning + manager code on CPU.

Not part of fragsim or its tests: it needs a scratch virtualenv with the vLLM 0.33.0
wheel (``pip install --no-deps vllm==0.33.0`` beside the CPU torch, then its listed
dependencies except torch*, flashinfer and the nvidia packages).
``benchmarks/vllm_crosscheck.py`` writes its inputs and compares the answers.

Usage: VLLM_PYTHON benchmarks/vllm_reference.py INPUT.json   -> prints one JSON object.

Planning path mirrored from vllm/v1/engine/core.py::_initialize_kv_caches:
  register_all_kvcache_specs -> get_global_kv_cache_groups -> get_kv_cache_configs
  -> generate_scheduler_kv_cache_config -> get_kv_cache_capacity
Manager path mirrored from vllm/v1/core/sched/scheduler.py (KVCacheManager ctor) and
engine/core.py (block hasher), then allocate_slots as the scheduler would call it.

Optional input keys beyond the brief: "replay_caching" (replay "ops" with prefix
caching, fragsim's keys as block hashes), "enable_prefix_caching" (default True, or False
when a mamba layer uses mode "none"), "kv_cache_layout" (default "LBNHC").
Extra output keys: "startup_error" (vLLM's ValueError text when get_kv_cache_configs
refuses, e.g. one max_model_len request does not fit; the numbers are then from the
builder called directly with available_memory // bytes_per_block blocks),
per-group "spec_class" and "max_blocks_per_request", "scheduler_block_size",
"hash_block_size", "kv_cache_tensors".
blocks_per_seq: one fresh KVCacheManager per L; prompt in one allocate_slots(L)
(admission gate on), then num_computed_tokens=L, in-flight 0, allocate_slots(1);
blocks_at_prompt: the same manager's blocks right after the prompt's allocation.
"""

import json
import logging
import os
import sys
import types

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402
from vllm.config import CacheConfig, ParallelConfig, SchedulerConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.utils.math_utils import cdiv  # noqa: E402
from vllm.v1.core import kv_cache_planning as P  # noqa: E402
from vllm.v1.core import kv_cache_utils as U  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import (  # noqa: E402
    register_all_kvcache_specs,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8": torch.uint8,  # STR_DTYPE_TO_TORCH_DTYPE["fp8"] == torch.uint8
    "uint8": torch.uint8,
}


def make_vllm_config(inp):
    """Minimal VllmConfig stand-in: real CacheConfig/SchedulerConfig/ParallelConfig,
    namespaces for the rest, VllmConfig properties given as plain values."""
    mml = inp["max_model_len"]
    cache_config = CacheConfig(block_size=inp["block_size"])
    cache_config.kv_cache_layout = inp.get("kv_cache_layout", "LBNHC")
    # Default on (vLLM default for generative/hybrid models). MambaModelConfig ties
    # mamba_cache_mode "none" to prefix caching off, so follow that if given.
    any_none = any(
        layer["kind"] == "mamba" and layer.get("mamba_cache_mode", "align") == "none"
        for layer in inp["layers"]
    )
    cache_config.enable_prefix_caching = inp.get("enable_prefix_caching", not any_none)
    cache_config.mamba_block_size = inp.get("mamba_block_size")
    modes = {layer.get("mamba_cache_mode", "align") for layer in inp["layers"] if layer["kind"] == "mamba"}
    if modes:
        cache_config.mamba_cache_mode = modes.pop()
    scheduler_config = SchedulerConfig(
        max_model_len=mml,
        is_encoder_decoder=False,
        max_num_batched_tokens=inp["max_num_batched_tokens"],
    )
    scheduler_config.disable_hybrid_kv_cache_manager = bool(
        inp.get("disable_hybrid_kv_cache_manager", False)
    )
    parallel_config = ParallelConfig()
    model_config = types.SimpleNamespace(
        max_model_len=mml,
        original_max_model_len=mml,
        supports_kv_cache_grouping=False,
        use_mla=any(layer["kind"] == "mla" for layer in inp["layers"]),
    )
    attention_config = types.SimpleNamespace(hisparse_config=None)
    return types.SimpleNamespace(
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        parallel_config=parallel_config,
        model_config=model_config,
        attention_config=attention_config,
        speculative_config=None,
        kv_transfer_config=None,
        diffusion_config=None,
        num_prefill_lookahead_tokens=0,
        num_lookahead_tokens=0,
        num_hash_lookahead_tokens=0,
        num_speculative_tokens=0,
        max_in_flight_tokens=inp["max_in_flight_tokens"],
    )


def build_specs(inp):
    bs = inp["block_size"]
    specs = {}
    for i, layer in enumerate(inp["layers"]):
        kind = layer["kind"]
        if kind == "mamba":
            name = f"model.layers.{i}.mixer"
            specs[name] = MambaSpec(
                block_size=inp["mamba_block_size"],
                shapes=tuple(tuple(s) for s in layer["shapes"]),
                dtypes=tuple(DTYPES[d] for d in layer["dtypes"]),
                page_size_padded=layer.get("page_size_padded"),
                mamba_cache_mode=layer.get("mamba_cache_mode", "align"),
                num_prefill_checkpoint_blocks=layer.get("num_prefill_checkpoint_blocks", 0),
            )
            continue
        name = f"model.layers.{i}.attn"
        common = dict(
            block_size=bs,
            num_kv_heads=layer["num_kv_heads"],
            head_size=layer["head_size"],
            dtype=DTYPES[layer.get("dtype", "bfloat16")],
        )
        if kind == "full":
            specs[name] = FullAttentionSpec(**common)
        elif kind == "sliding":
            specs[name] = SlidingWindowSpec(sliding_window=layer["window"], **common)
        elif kind == "chunked":
            specs[name] = ChunkedLocalAttentionSpec(attention_chunk_size=layer["chunk"], **common)
        elif kind == "mla":
            cds = "fp8" if layer.get("dtype") == "fp8" else "auto"
            specs[name] = MLAAttentionSpec(cache_dtype_str=cds, **common)
        else:
            raise ValueError(f"unknown layer kind {kind}")
    return specs


def kind_of(spec):
    k = get_kv_cache_spec_kind(spec)
    v = k.value
    if v == "unknown":
        return type(spec).__name__
    return v


def per_layer_page(spec):
    if isinstance(spec, UniformTypeKVCacheSpecs):
        pages = {s.page_size_bytes for s in spec.kv_cache_specs.values()}
        return pages.pop() if len(pages) == 1 else sorted(pages)
    return spec.page_size_bytes


def make_manager(kv_cache_config, vllm_config, hash_block_size, sched_block_size, caching, watermark):
    """A KVCacheManager as scheduler.py builds it."""
    return KVCacheManager(
        kv_cache_config=kv_cache_config,
        max_model_len=vllm_config.model_config.max_model_len,
        max_in_flight_tokens=vllm_config.max_in_flight_tokens,
        enable_caching=caching,
        use_eagle=False,
        num_hash_lookahead_tokens=0,
        num_prefill_lookahead=0,
        log_stats=False,
        enable_kv_cache_events=False,
        dcp_world_size=1,
        pcp_world_size=1,
        scheduler_block_size=sched_block_size,
        hash_block_size=hash_block_size,
        watermark=watermark,
        enable_mamba_shared_prefix_checkpoint=vllm_config.cache_config.enable_mamba_shared_prefix_checkpoint,
    )


def blocks_held(kv_cache_config, vllm_config, hash_block_size, sched_block_size, L):
    """Fresh KVCacheManager per L (as scheduler.py builds it), then:
    allocate_slots(req, L) for the prompt, set num_computed_tokens=L, allocate_slots(req, 1).
    The blocks each group holds after the prompt's allocation (the step that computes
    the whole prompt) and after the decode's."""
    cc = vllm_config.cache_config
    mgr = make_manager(kv_cache_config, vllm_config, hash_block_size, sched_block_size,
                       cc.enable_prefix_caching, vllm_config.scheduler_config.watermark)
    hasher = None
    if cc.enable_prefix_caching:
        hash_fn = get_hash_fn_by_name(cc.prefix_caching_hash_algo)
        U.init_none_hash(hash_fn)
        hasher = U.get_request_block_hasher(hash_block_size, hash_fn, 0)
    # distinct token ids per L so nothing hits a previous request's cache (fresh mgr anyway)
    req = Request(
        request_id=f"req-{L}",
        prompt_token_ids=[(7 * t + 3) % 30000 + 1 for t in range(L)],
        sampling_params=SamplingParams(max_tokens=1 << 20),
        pooling_params=None,
        block_hasher=hasher,
    )
    # Waiting-request path: prefix lookup (nothing cached), admission gate, prompt alloc.
    computed_blocks, num_computed, _ = mgr.get_computed_blocks(req)
    assert num_computed == 0
    out = mgr.allocate_slots(
        req,
        L,
        num_new_computed_tokens=0,
        new_computed_blocks=computed_blocks,
        full_sequence_must_fit=vllm_config.scheduler_config.scheduler_reserve_full_isl,
    )
    assert out is not None, f"prompt allocation failed for L={L}"
    at_prompt = _held_now(mgr, req)
    req.status = RequestStatus.RUNNING
    # Prefill finished and processed; one sampled token appended (what the engine does).
    req.num_computed_tokens = L
    req.num_in_flight_tokens = 0
    req.append_output_token_ids(11)
    out = mgr.allocate_slots(req, 1, num_lookahead_tokens=vllm_config.num_lookahead_tokens)
    assert out is not None, f"decode allocation failed for L={L}"
    return at_prompt, _held_now(mgr, req)


def _held_now(mgr, req):
    """The non-null blocks each group holds for ``req``."""
    return [sum(1 for b in m.req_to_blocks.get(req.request_id, []) if not b.is_null)
            for m in mgr.coordinator.single_type_managers]


def replay(kv_cache_config, vllm_config, hash_block_size, sched_block_size, ops, caching=False):
    """One KVCacheManager through a run's operations, as fragsim's hybrid engine made them:
    ["a", req, n, final]  a new request; allocate_slots(req, n) with nothing computed
    ["a", req, n, final, keys, max_len, prompt]  (caching) the same after get_computed_blocks
                          with the prompt blocks' keys as block hashes, at most max_len
                          tokens; the request's prompt is `prompt` tokens long
    ["e", req, q]         num_computed_tokens = q - 1; allocate_slots(req, 1)
    ["c", req, tokens]    (caching) cache_blocks(req, tokens): the end of the step that
                          computed them (allocate_slots then delays its own caching)
    ["f", req]            free(req)
    Per operation: [allocated?, free blocks, non-null blocks per group of req, tokens hit]."""
    mgr = make_manager(kv_cache_config, vllm_config, hash_block_size, sched_block_size, caching, 0.0)
    reqs = {}
    out = []
    for op in ops:
        kind, rid = op[0], op[1]
        ok = True
        hit = None
        if kind != "a" and rid not in reqs:
            ok = False  # vLLM did not admit it: a difference the caller shows
        elif kind == "a":
            n, final = op[2], op[3]
            req = Request(request_id=str(rid), prompt_token_ids=[(7 * t + 3) % 30000 + 1 for t in range(final)],
                          sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                          block_hasher=None)
            if caching:
                assert hash_block_size == sched_block_size, (hash_block_size, sched_block_size)
                req.num_prompt_tokens = op[6]  # the replay boundary's prompt (tokens are dummies)
                req.block_hashes = [int(k).to_bytes(8, "big", signed=True) for k in op[4]]
                blocks, hit, req.shared_prefix_boundary = mgr.get_computed_blocks(
                    req, max_cache_hit_length=op[5])
                ok = mgr.allocate_slots(req, n - hit, num_new_computed_tokens=hit,
                                        new_computed_blocks=blocks, delay_cache_blocks=True) is not None
            else:
                ok = mgr.allocate_slots(req, n) is not None
            if ok:
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = hit or 0
                reqs[rid] = req
        elif kind == "e":
            req = reqs[rid]
            req.num_computed_tokens = op[2] - 1
            req.num_in_flight_tokens = 0
            ok = mgr.allocate_slots(req, 1, delay_cache_blocks=caching) is not None
        elif kind == "c":
            mgr.coordinator.cache_blocks(reqs[rid], op[2])
        else:
            mgr.free(reqs.pop(rid))
        counts = []
        for m in mgr.coordinator.single_type_managers:
            blocks = m.req_to_blocks.get(str(rid), []) if rid in reqs else []
            counts.append(sum(1 for b in blocks if not b.is_null))
        out.append([ok, mgr.block_pool.get_num_free_blocks(), counts, hit])
    return out


def main():
    logging.disable(logging.WARNING)
    inp = json.load(open(sys.argv[1]))
    vllm_config = make_vllm_config(inp)
    register_all_kvcache_specs(vllm_config)
    result = plan_and_measure(vllm_config, build_specs(inp), inp["available_memory"],
                              inp.get("seq_lens", []) or [], inp.get("ops"),
                              bool(inp.get("replay_caching")))
    print(json.dumps(result))


def plan_and_measure(vllm_config, specs, available_memory, seq_lens, ops=None, replay_caching=False):
    """vLLM's planning over one worker's layer specs (the path of
    engine/core.py::_initialize_kv_caches), then the blocks each group holds at each
    of ``seq_lens`` and, with ``ops``, a replay: the result object main() prints."""
    kv_cache_specs = [specs]  # one worker (TP1, PP1)
    avail = [available_memory]

    groups = P.get_global_kv_cache_groups(vllm_config, kv_cache_specs)
    startup_error = None
    try:
        configs = P.get_kv_cache_configs(vllm_config, kv_cache_specs, avail, groups)
    except ValueError as e:
        # vLLM would refuse to start (e.g. one max_model_len request does not fit).
        # Report the error, and still show what the planner computes for this memory
        # by calling the builder directly (the same call get_kv_cache_configs makes
        # after its memory check).
        startup_error = str(e)
        from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder

        builder = get_kv_cache_config_builder(vllm_config)
        bpb = P._pool_bytes_per_block_from_builder(builder, vllm_config, groups)
        cfg = builder.get_kv_cache_config_from_groups(
            vllm_config, groups, avail[0] // bpb
        )
        configs = [cfg]
    worker_cfg = configs[0]
    worker_cfg.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    sched_cfg = U.generate_scheduler_kv_cache_config(configs)

    builder_bpb = P._pool_bytes_per_block(vllm_config, worker_cfg.kv_cache_groups)
    kv_tokens, max_conc = U.get_kv_cache_capacity(vllm_config, sched_cfg)
    max_conc_worker = U.get_max_concurrency_for_kv_cache_config(vllm_config, worker_cfg)

    sched_bs, hash_bs = U.resolve_kv_cache_block_sizes(sched_cfg, vllm_config)
    for c in (worker_cfg, sched_cfg):
        c.hash_block_size = hash_bs

    out_groups = []
    for g in worker_cfg.kv_cache_groups:
        s = g.kv_cache_spec
        out_groups.append(
            {
                "kind": kind_of(s),
                "spec_class": type(s).__name__
                + (
                    "[" + type(next(iter(s.kv_cache_specs.values()))).__name__ + "]"
                    if isinstance(s, UniformTypeKVCacheSpecs)
                    else ""
                ),
                "num_layers": len(g.layer_names),
                "layer_names": list(g.layer_names),
                "block_size": s.block_size,
                "page_size_bytes": per_layer_page(s),
                "sliding_window": get_kv_cache_spec_sliding_window(s),
                "max_blocks_per_request": cdiv(
                    s.max_memory_usage_bytes(vllm_config), s.page_size_bytes
                ),
            }
        )

    result = {
        "startup_error": startup_error,
        "groups": out_groups,
        "bytes_per_block": builder_bpb,
        "num_blocks": worker_cfg.num_blocks,
        "max_concurrency": max_conc,
        "kv_cache_tokens": kv_tokens,
        "scheduler_block_size": sched_bs,
        "hash_block_size": hash_bs,
        "kv_cache_tensors": [
            {
                "size": t.size,
                "num_layers": len(t.layers),
                "layer_stride": t.layer_stride,
                "block_stride": t.block_stride,
                "offset": t.offset,
            }
            for t in worker_cfg.kv_cache_tensors
        ],
        "blocks_per_seq": {},
        "blocks_at_prompt": {},
    }
    if abs(max_conc_worker - max_conc) > 1e-9:
        result["max_concurrency_worker_cfg"] = max_conc_worker
    for L in seq_lens:
        result["blocks_at_prompt"][str(L)], result["blocks_per_seq"][str(L)] = blocks_held(
            sched_cfg, vllm_config, hash_bs, sched_bs, L
        )
    if ops:
        result["replay"] = replay(sched_cfg, vllm_config, hash_bs, sched_bs, ops,
                                  caching=replay_caching)
    return result


if __name__ == "__main__":
    main()
