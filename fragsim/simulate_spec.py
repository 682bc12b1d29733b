"""What a run is, and what it names: :class:`RunSpec` (every parameter of a run, what
``config.json`` stores), the workload it replays (:func:`load_workload`), its model
and GPU (:func:`_model_gpu`), the size of its KV pool in slots or bytes
(:func:`pool_slots`, :func:`pool_bytes`) and the beam model's θ (:func:`beam_theta`).
Building the run from it is :mod:`fragsim.simulate_build`'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fragsim.errors import FragsimError

DEFAULT_ALLOCATORS = ("ft-static", "orca-max", "orca-pow2", "orca-oracle", "vllm")
#: beam model's θ for traces with no fitted value (likeliest token's probability 0.94 on average)
DEFAULT_BEAM_THETA = 0.1


@dataclass(frozen=True)
class RunSpec:
    """Everything a run depends on. Defaults: the vLLM paper's OPT-13B on one A100-40GB."""

    trace: str = "azure-conv"
    model: str = "opt-13b"
    gpu: str = "a100-40gb"
    tp: int = 1
    catalog: str | None = None
    kv_cache_dtype: str = "auto"          # vLLM's --kv-cache-dtype; auto: the model's dtype
    reserve: str | None = None            # override the allocator's reservation policy
    block_size: int = 16
    page_kb: int = 2048                   # vmm physical page (KiB)
    fit: str = "first"                    # contiguous placement
    max_seq_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_slots: int | None = None           # override the pool size
    kv_cache_memory_bytes: int | None = None  # vLLM's --kv-cache-memory-bytes: the pool in bytes
    hybrid_chunked: bool = True           # vLLM's hybrid manager for chunked local attention (0.33: on)
    batching: str = "continuous"
    scheduler: str = "vllm-v1"            # how a continuous-batching step is built (fragsim.engine)
    preemption: str = "recompute"
    swap_space_gb: float = 4.0
    queue_timeout_s: float | None = None
    truncate_prompts: bool = False
    cost_model: str = "roofline"
    step_time_s: float = 0.02
    rate: float | None = None             # re-time arrivals at this many requests/s
    arrival: str = "poisson"
    cv: float = 1.0
    num_requests: int | None = None
    time_window_s: tuple[float, float] | None = None
    seed: int = 0
    exact_steps: bool = False
    timeseries_resolution_s: float | None = None  # None: about 500 points over the trace
    address_map: bool = False
    num_samples: int = 1                  # parallel sampling: sequences per prompt
    beam_width: int = 1                   # beam search width
    beam_theta: float | None = None       # beam model's next-token concentration θ; None: the
                                          # workload's fitted value, else DEFAULT_BEAM_THETA
    prefix_caching: bool = False
    system_prompt_len: int = 0            # tokens of one system prompt before every prompt
    load_scale: int = 1                   # merge this many seeded copies of the trace (K x its rate)
    # A cluster (fragsim.cluster): this many copies of the deployment behind a router
    instances: int = 1
    router: str = "round-robin"           # round-robin, least-loaded or prefix-aware
    slo_ttft_s: float = 2.0               # goodput: a request meets both SLOs
    slo_tpot_s: float = 0.1
    # Prefill/decode disaggregation (fragsim.cluster.disagg): of the instances, this many
    # prefill and this many decode (the rest mixed), and the link between them
    prefill_instances: int = 0
    decode_instances: int = 0
    kv_transfer_bandwidth_gbps: float = 25.0  # GB/s per GPU (each its own NIC)
    kv_transfer_latency_ms: float = 1.0       # base latency of one transfer
    kv_transfer_layerwise: bool = False       # push each layer's KV as the prefill computes it
    pd_threshold: int = 0                 # prompts with fewer uncached tokens skip the prefill pool
    # What the router sees (fragsim.cluster.view) and how prefix-aware weighs it
    router_weights: tuple[float, float, float] = (2.0, 1.0, 1.0)  # prefix share, queue, KV use
    router_snapshot_ms: float = 0.0       # load through snapshots this often (0: live)
    router_kv_events_ms: float | None = None  # prefix-aware: the caches through KV events this late
    # A CPU tier below the GPU pool (vLLM's --kv-offloading-*; fragsim.offload.connector):
    kv_offloading_size: float | None = None   # GiB of host memory, every GPU together; None: no tier
    kv_offloading_policy: str = "lru"         # lru or arc
    kv_offloading_block_size: int | None = None  # tokens per tier block; None: the GPU block size
    kv_offloading_store_threshold: int = 1    # store a block once it was offered this many times
    kv_offloading_prompt_only: bool = True    # store prompt blocks only
    kv_offloading_backend: str = "native"     # native, lmcache (256-token chunks) or lazy
    kv_offloading_disk_size: float | None = None  # GiB of disk below the CPU tier; None: none
    kv_offloading_disk_read_gbps: float = 3.0     # GB/s, all I/O threads together
    kv_offloading_disk_write_gbps: float = 2.0
    kv_offloading_disk_threads: int = 4

    @property
    def sharing(self) -> bool:
        """Blocks are shared: a paged allocator with fork runs it (fragsim.kv.sharing)."""
        return self.num_samples > 1 or self.beam_width > 1 or self.prefix_caching

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["time_window_s"] = list(self.time_window_s) if self.time_window_s else None
        return out


def beam_theta(spec: RunSpec) -> float:
    """The beam model's θ for a run: the spec's, else its synthetic workload's fitted one."""
    from fragsim.traces import WORKLOADS

    if spec.beam_theta is not None:
        return spec.beam_theta
    workload = WORKLOADS.get(spec.trace)
    theta = workload.beam_theta if workload is not None else None
    return DEFAULT_BEAM_THETA if theta is None else theta


def load_workload(spec: RunSpec) -> Any:
    """The trace a spec names, sliced and re-timed as it asks."""
    from fragsim.traces import WORKLOADS, assign_arrivals, load_trace, make_workload, slice_trace

    if spec.trace in WORKLOADS:
        if spec.rate is None:
            raise FragsimError(f"workload {spec.trace!r} needs --rate (requests/s) for its arrivals")
        return _with_system_prompt(_scaled(
            make_workload(spec.trace, spec.num_requests or 1000, spec.rate, seed=spec.seed,
                          arrival=spec.arrival, cv=spec.cv), spec), spec)
    trace = load_trace(spec.trace)
    if spec.time_window_s is not None:
        start, end = spec.time_window_s
        trace = slice_trace(trace, start_s=start, end_s=end)
    if spec.num_requests is not None:
        trace = slice_trace(trace, num_requests=spec.num_requests)
    if spec.rate is not None:
        trace = assign_arrivals(trace, spec.rate, arrival=spec.arrival, cv=spec.cv, seed=spec.seed)
    elif not trace.has_timestamps:
        raise FragsimError(
            f"{trace.name} has lengths but no arrival times; give --rate (requests/s) "
            "and optionally --arrival poisson|gamma --cv X")
    return _with_system_prompt(_scaled(trace, spec), spec)


def _scaled(trace: Any, spec: RunSpec) -> Any:
    from fragsim.traces import scale_load

    return scale_load(trace, spec.load_scale, seed=spec.seed)


def _with_system_prompt(trace: Any, spec: RunSpec) -> Any:
    if not spec.system_prompt_len:
        return trace
    from fragsim.prefix import with_system_prompt

    try:
        return with_system_prompt(trace, spec.system_prompt_len)
    except ValueError as exc:
        raise FragsimError(f"--system-prompt-len: {exc}") from None


def _model_gpu(spec: RunSpec) -> tuple[Any, Any]:
    from fragsim.catalog import get_gpu, get_model, with_kv_cache_dtype

    model = with_kv_cache_dtype(get_model(spec.model, catalog=spec.catalog), spec.kv_cache_dtype)
    return model, get_gpu(spec.gpu, catalog=spec.catalog)


def pool_slots(spec: RunSpec) -> int:
    """KV pool size: ``--kv-slots``, ``--kv-cache-memory-bytes`` over the bytes of one
    slot, or the budget vLLM would compute."""
    if spec.kv_slots is not None:
        if spec.kv_slots < 1:
            raise FragsimError(f"--kv-slots must be >= 1, got {spec.kv_slots}")
        return spec.kv_slots
    if spec.kv_cache_memory_bytes is not None:
        model, _ = _model_gpu(spec)
        slots = pool_bytes(spec) // model.kv_bytes_per_token_per_gpu(spec.tp)
        if slots < 1:
            raise FragsimError(f"--kv-cache-memory-bytes {spec.kv_cache_memory_bytes:,} holds no "
                               f"slot of {model.kv_bytes_per_token_per_gpu(spec.tp):,} bytes")
        return slots
    from fragsim.capacity import kv_budget_slots

    model, gpu = _model_gpu(spec)
    return kv_budget_slots(model, gpu, tp=spec.tp, gpu_memory_utilization=spec.gpu_memory_utilization,
                           max_num_batched_tokens=spec.max_num_batched_tokens)


def pool_bytes(spec: RunSpec, model_gpu: tuple[Any, Any] | None = None) -> int:
    """KV pool bytes on one GPU: ``--kv-cache-memory-bytes``, ``--kv-slots`` slots of the
    model's all-full-attention bytes, or the budget vLLM would compute
    (``model_gpu``: the spec's model and GPU when the caller has them)."""
    if spec.kv_cache_memory_bytes is not None:
        if spec.kv_cache_memory_bytes < 1:
            raise FragsimError(f"--kv-cache-memory-bytes must be >= 1, got {spec.kv_cache_memory_bytes}")
        return spec.kv_cache_memory_bytes
    model, gpu = model_gpu or _model_gpu(spec)
    if spec.kv_slots is not None:
        return pool_slots(spec) * model.kv_bytes_per_token_per_gpu(spec.tp)
    from fragsim.capacity import kv_budget_bytes

    return kv_budget_bytes(model, gpu, tp=spec.tp, gpu_memory_utilization=spec.gpu_memory_utilization,
                           max_num_batched_tokens=spec.max_num_batched_tokens)
