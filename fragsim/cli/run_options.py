"""``fragsim run``'s options: the workload, the model, GPU and memory, the allocators,
the scheduler, block sharing and the cost model (:func:`add_workload_options`,
:func:`add_system_options`), the :class:`~fragsim.simulate.RunSpec` they make
(:func:`spec_from_args`) and the ``--allocator`` list checked (:func:`parse_allocators`,
which ``fragsim validate`` uses too). The command itself is :mod:`fragsim.cli.run`.
"""

from __future__ import annotations

import argparse
from typing import Any

from fragsim.cli.args import nonnegative_float, nonnegative_int, positive_float, positive_int
from fragsim.engine_config import SCHEDULERS


def _window(text: str) -> tuple[float, float]:
    try:
        start, end = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:END in seconds, got {text!r}") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"need 0 <= START < END, got {text}")
    return start, end


def add_workload_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--trace", default="azure-conv",
                   help="bundled trace (azure-conv, azure-code), workload (sharegpt-paper, "
                        "alpaca-paper) or a trace file path (default: %(default)s)")
    g.add_argument("--num-requests", type=positive_int, help="keep the first N requests")
    g.add_argument("--time-window", type=_window, metavar="START:END",
                   help="keep requests arriving in [START, END) seconds")
    g.add_argument("--rate", type=positive_float, help="re-time arrivals at this many requests/s")
    g.add_argument("--load-scale", type=positive_int, default=1, metavar="K",
                   help="merge K copies of the trace, each shifted by a small seeded offset and with "
                        "its own content hashes: K times the rate, the burstiness kept (default 1)")
    g.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson",
                   help="arrival process with --rate (default: %(default)s)")
    g.add_argument("--cv", type=positive_float, default=1.0,
                   help="coefficient of variation of gamma inter-arrivals (burstiness; default 1)")
    g.add_argument("--seed", type=int, default=0, help="seed for arrivals and workloads (default 0)")


def add_system_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model, GPU and memory")
    from fragsim.catalog import DEFAULT_GPU, DEFAULT_MODEL

    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="model preset, or a Hugging Face config.json (or its folder) "
                        "(default: %(default)s)")
    g.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                   help="KV cache element type: auto (the model's), fp16, bf16, fp32, fp8, "
                        "fp8_e4m3, fp8_e5m2 (default auto)")
    g.add_argument("--gpu", default=DEFAULT_GPU, help="GPU preset (default: %(default)s)")
    g.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree (default 1)")
    g.add_argument("--catalog", help="TOML file with custom models/GPUs")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory the engine may use (default 0.9)")
    g.add_argument("--kv-slots", type=positive_int, help="KV pool size in tokens (overrides the budget)")
    g.add_argument("--kv-cache-memory-bytes", type=positive_int, metavar="BYTES",
                   help="KV pool size in bytes on one GPU, as vLLM's option (overrides the budget; "
                        "dense allocators cut it into slots of every layer's KV)")
    g.add_argument("--hybrid-chunked", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM's hybrid KV cache manager for chunked local attention (Llama 4): on by "
                        "default, as in vLLM 0.33; --no-hybrid-chunked turns it off, as "
                        "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0 does")
    g = p.add_argument_group("allocator")
    g.add_argument("--allocator", default=None,
                   help=f"comma list of allocators/presets (default: {','.join(DENSE_DEFAULT)}; for "
                        f"a model with layers other than full attention, the hybrid KV managers "
                        f"{','.join(HYBRID_DEFAULT)}; with block sharing, those of the list that "
                        "can share blocks)")
    g.add_argument("--reserve", choices=("max", "pow2", "oracle"),
                   help="reservation policy for plain static/contiguous/buddy placements")
    g.add_argument("--block-size", type=positive_int, default=16, help="paged block size (default 16)")
    g.add_argument("--page-kb", type=int, choices=(64, 128, 256, 2048), default=2048,
                   help="vmm physical page in KiB (default 2048; vattention is 2048 unless given)")
    g.add_argument("--fit", choices=("first", "best"), default="first", help="contiguous placement fit")
    g = p.add_argument_group("scheduler")
    g.add_argument("--max-seq-len", type=positive_int,
                   help="longest prompt+output a request may have (default: the model's context, "
                        "as vLLM's max_model_len)")
    g.add_argument("--max-num-seqs", type=positive_int, default=256,
                   help="most sequences running at once (default 256)")
    g.add_argument("--max-num-batched-tokens", type=positive_int,
                   help="token budget per step (default max(max-seq-len, 2048), at most 8192; longer prompts are chunked; under --scheduler vllm-v0 or orca, whose prompts are never chunked, vLLM 0.1's 2,560 or max-seq-len if longer)")
    g.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                   help="iteration-level (Orca/vLLM) or request-level (HF/FasterTransformer) batching")
    g.add_argument("--scheduler", choices=SCHEDULERS, default="vllm-v1",
                   help="how a step is built: vllm-v1 (today's vLLM: chunked prompts share steps with "
                        "decodes), vllm-v0 (vLLM 0.1, the vLLM paper's: whole prompts in prompt-only "
                        "steps first, else decode-only steps; 2,560 batched tokens by default, or the context) or orca "
                        "(Orca's iteration-level batching: whole prompts beside decodes); default vllm-v1")
    g.add_argument("--preemption", choices=("recompute", "swap"), default="recompute")
    g.add_argument("--swap-space-gb", type=float, default=4.0, help="CPU swap pool in GiB (default 4)")
    g.add_argument("--queue-timeout", type=positive_float, metavar="S",
                   help="refuse requests that waited longer than S seconds (a 503)")
    g.add_argument("--truncate-prompts", action="store_true",
                   help="cut prompts that exceed max-seq-len instead of refusing them")
    g = p.add_argument_group("block sharing (paged allocators)")
    g.add_argument("--parallel-samples", type=positive_int, default=1, metavar="N",
                   help="decode N samples per prompt, sharing the prompt's blocks (default 1)")
    g.add_argument("--beam-width", type=positive_int, default=1, metavar="W",
                   help="beam search of width W: beams fork and are pruned every step (default 1)")
    g.add_argument("--beam-theta", type=positive_float, default=None, metavar="θ",
                   help="beam model: concentration of the next-token distributions; small = a "
                        "confident model whose beams persist, large = beams collapse onto the "
                        "best one (default: the workload's fitted value, alpaca-paper 0.2, "
                        "sharegpt-paper 0.03; 0.1 for other traces)")
    g.add_argument("--prefix-caching", action="store_true",
                   help="reuse cached prompt blocks across requests (vLLM automatic prefix caching)")
    g.add_argument("--system-prompt-len", type=int, default=0, metavar="S",
                   help="prepend one shared S-token system prompt to every request (default 0)")
    g = p.add_argument_group("offload tier (vLLM's OffloadingConnector, native backend)")
    g.add_argument("--kv-offloading-size", type=positive_float, default=None, metavar="GIB",
                   help="a CPU tier of GIB GiB below the GPU pool (all GPUs of the instance "
                        "together, as vLLM counts it): prompt blocks are stored eagerly over the "
                        "host link, and later requests load their hits from it (default: no tier)")
    g.add_argument("--kv-offloading-policy", choices=("lru", "arc"), default="lru",
                   help="the tier's eviction policy (default lru)")
    g.add_argument("--kv-offloading-block-size", type=positive_int, default=None, metavar="TOKENS",
                   help="tokens per tier block, a multiple of --block-size (default: --block-size)")
    g.add_argument("--kv-offloading-store-threshold", type=positive_int, default=1, metavar="N",
                   help="store a block only once it was offered N times (default 1: always)")
    g.add_argument("--kv-offloading-prompt-only", action=argparse.BooleanOptionalAction, default=True,
                   help="store prompt blocks only (default on); --no-kv-offloading-prompt-only also "
                        "stores the blocks generated tokens complete (native, lmcache)")
    g.add_argument("--kv-offloading-backend", choices=("native", "lmcache", "lazy"), default="native",
                   help="native: vLLM's eager stores of whole blocks; lmcache: LMCache-style 256-token "
                        "chunks under LRU, the partial last chunk stored too; lazy: a block is stored "
                        "when the GPU prefix cache evicts it (needs --prefix-caching) (default native)")
    g.add_argument("--kv-offloading-disk-size", type=positive_float, default=None, metavar="GIB",
                   help="a disk tier of GIB GiB below the CPU tier, written through (default: none)")
    g.add_argument("--kv-offloading-disk-read-gbps", type=positive_float, default=3.0, metavar="GB/S",
                   help="the disk's read bandwidth, all I/O threads together (default 3)")
    g.add_argument("--kv-offloading-disk-write-gbps", type=positive_float, default=2.0, metavar="GB/S",
                   help="the disk's write bandwidth (default 2)")
    g.add_argument("--kv-offloading-disk-threads", type=positive_int, default=4, metavar="N",
                   help="disk I/O threads: N jobs at once, each at 1/N of the bandwidth (default 4)")
    g = p.add_argument_group("cluster")
    g.add_argument("--instances", type=positive_int, default=None, metavar="N",
                   help="N copies of the deployment behind a router, each with its own KV pool "
                        "(default 1: one engine; with a prefill/decode split, P + D)")
    g.add_argument("--prefill-instances", type=nonnegative_int, default=0, metavar="P",
                   help="of the instances, P run prompts only and hand their KV to a decode "
                        "instance (needs --decode-instances; default 0: no split)")
    g.add_argument("--decode-instances", type=nonnegative_int, default=0, metavar="D",
                   help="of the instances, D generate the answers of prompts run on a prefill "
                        "instance; the rest serve requests whole (mixed)")
    g.add_argument("--kv-transfer-bandwidth", type=positive_float, default=25.0, metavar="GB_PER_S",
                   help="the prefill-to-decode link, per GPU (each its own NIC): GB/s (default 25)")
    g.add_argument("--kv-transfer-latency-ms", type=nonnegative_float, default=1.0, metavar="MS",
                   help="base latency of one KV transfer (default 1)")
    g.add_argument("--kv-transfer-layerwise", action="store_true",
                   help="push each layer's KV as the prefill computes it, so the transfer overlaps "
                        "the prefill; the decode instance reserves the KV first, before the prefill "
                        "runs (default: pulled once the prefill has ended)")
    g.add_argument("--pd-threshold", type=nonnegative_int, default=0, metavar="TOKENS",
                   help="a prompt with fewer uncached tokens (by the router's estimate) skips the "
                        "prefill pool and runs whole, on a mixed instance or its decode instance "
                        "(llm-d's decider; default 0: every prompt is split)")
    g.add_argument("--router", choices=("round-robin", "random", "least-loaded", "session", "prefix-aware"),
                   default="round-robin",
                   help="how requests are spread: round-robin; random (uniform, the same draw every "
                        "run); least-loaded (4 × waiting + running, "
                        "vLLM's data-parallel score); session (consistent hashing on the trace's "
                        "session ids); prefix-aware (llm-d style: the prompt's share "
                        "in the router's index of each instance's cache 2, queue 1, KV use 1; "
                        "needs --prefix-caching) (default round-robin)")
    g.add_argument("--router-weights", type=_weights, default=(2.0, 1.0, 1.0), metavar="P,Q,K",
                   help="prefix-aware: weights of the prefix share, queue depth and KV use "
                        "(default 2,1,1)")
    g.add_argument("--router-snapshot-ms", type=nonnegative_float, default=0.0, metavar="MS",
                   help="the router sees the instances' load as of snapshots taken every MS "
                        "milliseconds (default 0: live)")
    g.add_argument("--router-kv-events", type=nonnegative_float, default=None, metavar="MS",
                   help="prefix-aware: know each instance's GPU prefix cache from its KV events, "
                        "each arriving MS milliseconds late (default: the router's own index of "
                        "what it sent where, as llm-d's approximate scorer)")
    g.add_argument("--slo-ttft", type=positive_float, default=2.0, metavar="S",
                   help="goodput counts requests whose time to first token is at most S (default 2)")
    g.add_argument("--slo-tpot", type=positive_float, default=0.1, metavar="S",
                   help="... and whose time per output token is at most S (default 0.1)")
    g = p.add_argument_group("cost model")
    g.add_argument("--cost-model", default="auto", metavar="NAME|FILE",
                   help="step times: auto (a fitted preset for the model and GPU if one exists, "
                        "else roofline), roofline, fixed, a preset (vllm-paper, "
                        "vllm-paper-transient, blis-llama-3.1-8b-h100) or a TOML file from fragsim calibrate "
                        "(default: %(default)s)")
    g.add_argument("--step-time", type=positive_float, default=0.02,
                   help="seconds per step with --cost-model fixed (default 0.02)")


def spec_from_args(args: argparse.Namespace) -> Any:
    from fragsim.simulate import RunSpec

    max_seq_len = args.max_seq_len
    if max_seq_len is None:
        from fragsim.simulate import _model_gpu

        model, _ = _model_gpu(RunSpec(model=args.model, gpu=args.gpu, catalog=args.catalog,
                                     kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto")))
        max_seq_len = int(model.max_position_embeddings)
    return RunSpec(
        trace=args.trace, model=args.model, gpu=args.gpu, tp=args.tp, catalog=args.catalog,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        reserve=args.reserve, block_size=args.block_size, fit=args.fit,
        max_seq_len=max_seq_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_slots=args.kv_slots,
        kv_cache_memory_bytes=getattr(args, "kv_cache_memory_bytes", None),
        hybrid_chunked=getattr(args, "hybrid_chunked", True),
        batching=args.batching, scheduler=args.scheduler, preemption=args.preemption, swap_space_gb=args.swap_space_gb,
        queue_timeout_s=args.queue_timeout, truncate_prompts=args.truncate_prompts,
        cost_model=args.cost_model, step_time_s=args.step_time, rate=args.rate,
        arrival=args.arrival, cv=args.cv, num_requests=args.num_requests,
        time_window_s=args.time_window, seed=args.seed,
        exact_steps=getattr(args, "exact_steps", False),
        address_map=getattr(args, "plot", False),
        page_kb=getattr(args, "page_kb", 2048),
        num_samples=getattr(args, "parallel_samples", 1),
        beam_width=getattr(args, "beam_width", 1),
        beam_theta=getattr(args, "beam_theta", None),
        prefix_caching=getattr(args, "prefix_caching", False),
        system_prompt_len=getattr(args, "system_prompt_len", 0),
        load_scale=getattr(args, "load_scale", 1),
        instances=_instances(args),
        prefill_instances=getattr(args, "prefill_instances", 0),
        decode_instances=getattr(args, "decode_instances", 0),
        kv_transfer_bandwidth_gbps=getattr(args, "kv_transfer_bandwidth", 25.0),
        kv_transfer_latency_ms=getattr(args, "kv_transfer_latency_ms", 1.0),
        kv_transfer_layerwise=getattr(args, "kv_transfer_layerwise", False),
        pd_threshold=getattr(args, "pd_threshold", 0),
        router_weights=getattr(args, "router_weights", (2.0, 1.0, 1.0)),
        router_snapshot_ms=getattr(args, "router_snapshot_ms", 0.0),
        router_kv_events_ms=getattr(args, "router_kv_events", None),
        router=getattr(args, "router", "round-robin"),
        slo_ttft_s=getattr(args, "slo_ttft", 2.0),
        slo_tpot_s=getattr(args, "slo_tpot", 0.1),
        kv_offloading_size=getattr(args, "kv_offloading_size", None),
        kv_offloading_policy=getattr(args, "kv_offloading_policy", "lru"),
        kv_offloading_block_size=getattr(args, "kv_offloading_block_size", None),
        kv_offloading_store_threshold=getattr(args, "kv_offloading_store_threshold", 1),
        kv_offloading_prompt_only=getattr(args, "kv_offloading_prompt_only", True),
        kv_offloading_backend=getattr(args, "kv_offloading_backend", "native"),
        kv_offloading_disk_size=getattr(args, "kv_offloading_disk_size", None),
        kv_offloading_disk_read_gbps=getattr(args, "kv_offloading_disk_read_gbps", 3.0),
        kv_offloading_disk_write_gbps=getattr(args, "kv_offloading_disk_write_gbps", 2.0),
        kv_offloading_disk_threads=getattr(args, "kv_offloading_disk_threads", 4),
    )


#: the allocators a run compares when --allocator is not given: the vLLM paper's, and
#: for a model with other layer kinds the hybrid KV managers, vLLM's first
DENSE_DEFAULT = ("ft-static", "orca-max", "orca-pow2", "orca-oracle", "vllm")
HYBRID_DEFAULT = ("vllm-hybrid", "jenga", "static-partition", "paged-uniform")


def can_share(name: str, spec: Any) -> bool:
    """Whether allocator ``name`` runs ``spec``'s block sharing (samples, beams, prefix
    caching): the paged allocators; of the hybrid managers, vllm-hybrid with prefix
    caching (samples and beams are not modelled for them)."""
    from fragsim.allocators import PRESETS
    from fragsim.simulate import is_hybrid_manager

    if is_hybrid_manager(name):
        return name == "vllm-hybrid" and spec.num_samples == 1 and spec.beam_width == 1
    return (PRESETS[name][0] if name in PRESETS else name) in ("paged", "paged-shared")


def default_allocators(model: Any, spec: Any) -> tuple[list[str], str | None]:
    """The allocators a run compares when none are named, and a note saying which of
    the default list it left out (block sharing needs allocators that can share)."""
    names = list(HYBRID_DEFAULT if model.is_hybrid else DENSE_DEFAULT)
    if not spec.sharing:
        return names, None
    kept = [n for n in names if can_share(n, spec)]
    if not kept:   # samples or beams on a hybrid model: only the dense paged allocator shares
        kept = [n for n in DENSE_DEFAULT if can_share(n, spec)]
    left = [n for n in names if n not in kept]
    what = ", ".join(w for w, on in (("parallel sampling", spec.num_samples > 1),
                                     ("beam search", spec.beam_width > 1),
                                     ("prefix caching", spec.prefix_caching)) if on)
    return kept, f"{what} needs allocators that share blocks: running {', '.join(kept)}, " \
                 f"leaving out {', '.join(left)}"


def parse_allocators(text: str) -> list[str]:
    from fragsim.allocators import PLACEMENTS, PRESETS
    from fragsim.errors import FragsimError
    from fragsim.hybrid import MANAGERS

    names = [n.strip() for n in text.split(",") if n.strip()]
    known = list(PRESETS) + list(PLACEMENTS) + list(MANAGERS)
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise FragsimError(f"--allocator: unknown {', '.join(bad) or '(empty)'}; known: {', '.join(known)}")
    return names


def _instances(args: argparse.Namespace) -> int:
    """--instances, or P + D when only a prefill/decode split is given."""
    n = getattr(args, "instances", None)
    if n is not None:
        return int(n)
    split = getattr(args, "prefill_instances", 0) + getattr(args, "decode_instances", 0)
    return max(1, split)


def _weights(text: str) -> tuple[float, float, float]:
    parts = text.split(",")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected three numbers P,Q,K, got {text!r}") from None
    if len(values) != 3 or any(v < 0 for v in values) or not any(values):
        raise argparse.ArgumentTypeError(f"expected three numbers >= 0, not all 0, got {text!r}")
    return values  # type: ignore[return-value]
