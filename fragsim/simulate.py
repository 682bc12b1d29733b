"""One simulation, as a library call: a workload, a model on a GPU, an allocator.

    >>> from fragsim.simulate import RunSpec, load_workload, simulate
    >>> spec = RunSpec(trace="azure-conv", num_requests=200)
    >>> result = simulate(load_workload(spec), "vllm", spec)
    >>> result.summary["token_states_frac"]            # doctest: +SKIP

``RunSpec`` holds every parameter of a run (it is what ``config.json`` stores);
``simulate`` builds the allocator, cost model and engine from it, runs, and
returns the summary row, the per-request table and the time series.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from fragsim import __version__
from fragsim.allocators import PRESETS, create
from fragsim.engine import Engine, EngineConfig
from fragsim.engine_views import prefix_cache_stats
from fragsim.errors import FragsimError
from fragsim.request_table import FINISHED, REFUSE_REASONS, STATUS_NAMES

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
    hybrid_chunked: bool = False          # keep vLLM's hybrid manager for chunked local attention
    batching: str = "continuous"
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

    @property
    def sharing(self) -> bool:
        """Blocks are shared: a paged allocator with fork runs it (fragsim.kv.sharing)."""
        return self.num_samples > 1 or self.beam_width > 1 or self.prefix_caching

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["time_window_s"] = list(self.time_window_s) if self.time_window_s else None
        return out


@dataclass
class RunResult:
    allocator: str
    summary: dict[str, Any]
    requests: pd.DataFrame
    timeseries: pd.DataFrame
    address_map: dict[str, Any] | None = field(default=None)


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
        return _with_system_prompt(
            make_workload(spec.trace, spec.num_requests or 1000, spec.rate, seed=spec.seed,
                          arrival=spec.arrival, cv=spec.cv), spec)
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
    return _with_system_prompt(trace, spec)


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


def is_hybrid_manager(name: str) -> bool:
    from fragsim.hybrid import MANAGERS

    return name in MANAGERS


def make_hybrid_manager(name: str, spec: RunSpec, model_gpu: tuple[Any, Any] | None = None) -> Any:
    from fragsim.hybrid import create_manager

    model, gpu = model_gpu or _model_gpu(spec)
    try:
        return create_manager(name, model, gpu, pool_bytes=pool_bytes(spec, (model, gpu)),
                              max_seq_len=spec.max_seq_len,
                              tp=spec.tp, block_size=spec.block_size, max_num_seqs=spec.max_num_seqs,
                              max_num_batched_tokens=spec.max_num_batched_tokens,
                              hybrid_chunked=spec.hybrid_chunked, track_ids=spec.address_map,
                              prefix_caching=spec.prefix_caching)
    except ValueError as exc:
        raise FragsimError(f"allocator {name!r}: {exc}") from None


def make_allocator(name: str, capacity: int, spec: RunSpec) -> Any:
    placement = PRESETS[name][0] if name in PRESETS else name
    options: dict[str, Any] = {"max_seq_len": spec.max_seq_len}
    if placement in ("paged", "paged-shared"):
        if name not in PRESETS or spec.block_size != 16:
            options["block_size"] = spec.block_size
        if spec.sharing:
            from fragsim.allocators import SharedPagedAllocator

            try:
                return SharedPagedAllocator(capacity, name=name, **options)
            except ValueError as exc:
                raise FragsimError(f"allocator {name!r}: {exc}") from None
    elif spec.sharing:
        raise FragsimError(
            f"allocator {name!r} ({placement}) cannot share blocks; parallel sampling, beam search "
            "and prefix caching need a paged one: --allocator vllm (or paged)")
    if placement == "vmm":
        model, _ = _model_gpu(spec)
        # One token of one layer's K (or V) buffer on one GPU: the unit pages are cut into.
        options["token_bytes"] = model.kv_heads_per_gpu(spec.tp) * model.head_dim * model.kv_dtype_bytes
        if name not in PRESETS or spec.page_kb != 2048:
            options["page_bytes"] = spec.page_kb * 1024
    if placement == "contiguous":
        options["fit"] = spec.fit
    if placement == "static":
        options["max_num_seqs"] = spec.max_num_seqs
    if spec.reserve is not None and placement not in ("paged", "vmm") and name not in PRESETS:
        options["reserve"] = spec.reserve
    try:
        return create(name, capacity, **options)
    except ValueError as exc:
        raise FragsimError(str(exc)) from None


def make_engine(trace: Any, allocator_name: str, spec: RunSpec,
                progress: Callable[[int], None] | None = None, check: bool = False,
                cost: Any = None, model_gpu: tuple[Any, Any] | None = None) -> Engine:
    """The engine a spec describes; ``cost`` (a cost model object) overrides
    ``spec.cost_model`` (the calibration fit tries many), ``model_gpu`` the spec's
    model and GPU (a model built in code, such as the validator's miniatures)."""
    from fragsim.costmodel import make_cost_model

    model, gpu = model_gpu or _model_gpu(spec)
    hybrid = is_hybrid_manager(allocator_name)
    allocator = make_hybrid_manager(allocator_name, spec, (model, gpu)) if hybrid \
        else make_allocator(allocator_name, pool_slots(spec), spec)
    try:
        if cost is None:
            cost = make_cost_model(spec.cost_model, model=model, gpu=gpu, tp=spec.tp,
                                   step_time=spec.step_time_s)
        kv_per_gpu = model.kv_bytes_per_token_per_gpu(spec.tp)
        resolution = spec.timeseries_resolution_s
        if resolution is None:
            span = float(trace.arrival_s[-1]) if len(trace) else 1.0
            resolution = max(span / 500.0, 0.1)
        config = EngineConfig(
            max_seq_len=spec.max_seq_len, max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=spec.max_num_batched_tokens, batching=spec.batching,
            preemption=spec.preemption,
            swap_space_slots=int(spec.swap_space_gb * 2**30 // kv_per_gpu),
            swap_bandwidth=gpu.pcie_bandwidth, kv_bytes_per_token=kv_per_gpu,
            queue_timeout_s=spec.queue_timeout_s, truncate_prompts=spec.truncate_prompts,
            exact_steps=spec.exact_steps, check=check, timeseries_resolution_s=resolution,
            address_map_interval_s=(resolution * 4 if spec.address_map else None),
            num_samples=spec.num_samples, beam_width=spec.beam_width,
            beam_theta=beam_theta(spec), prefix_caching=spec.prefix_caching, sharing_seed=spec.seed,
        )
    except ValueError as exc:
        raise FragsimError(str(exc)) from None
    kv: Any = allocator
    if hybrid:
        from fragsim.kv.hybrid import HybridKV
        from fragsim.prefix import PrefixKeys

        keys = PrefixKeys(trace, allocator.block_size) if spec.prefix_caching and \
            getattr(allocator, "prefix", None) is not None else None
        kv = HybridKV(allocator, resolution, keys)
    try:
        return Engine(trace, kv, cost, config, progress=progress)
    except ValueError as exc:
        raise FragsimError(str(exc)) from None


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def summarize(engine: Engine, allocator_name: str, wall_time_s: float,
              kv_bytes_per_token: int) -> tuple[dict[str, Any], pd.DataFrame]:
    """The summary row (the ``--json`` keys) and the per-request table of a finished run."""
    rec, reqs = engine.rec, engine.requests
    means, peaks = rec.means(), rec.peaks()
    cap = engine.capacity
    done = reqs.status == FINISHED
    arrival = reqs.arrival
    ttft = reqs.first_token - arrival
    e2e = reqs.finish - arrival
    out_len = reqs.output.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(out_len > 1, (reqs.finish - reqs.first_token) / (out_len - 1), np.nan)
    span = rec.span_s
    # Every sample or beam generates its tokens (the request returns the output length).
    out_tokens = int(reqs.output[done].sum()) * engine.cfg.width
    counters = rec.counters.to_dict()
    summary: dict[str, Any] = {
        "allocator": allocator_name,
        "num_requests": reqs.N,
        "num_finished": int(done.sum()),
        **counters,
        "capacity_slots": cap,
        "capacity_bytes": cap * kv_bytes_per_token,
        "kv_bytes_per_token": kv_bytes_per_token,
    }
    for q in ("token_states", "reservation", "internal_fragmentation", "free"):
        summary[f"mean_{q}_slots"] = means[q]
    for q in ("token_states", "reservation", "internal_fragmentation", "free"):
        summary[f"{q}_frac"] = means[q] / cap if cap else 0.0
    for q in ("token_states", "reservation", "internal_fragmentation"):
        summary[f"peak_{q}_slots"] = peaks[q]
    hybrid = engine.kv.unit == "bytes"
    kv_keys = engine.kv.summary()
    if hybrid:
        # A hybrid manager's pool is bytes, not slots: the byte split replaces the slot keys.
        summary.update({k: None for k in list(summary) if k.endswith("_slots")})
        summary.update(capacity_slots=None, capacity_bytes=cap, kv_bytes_per_token=None)
        summary.update(kv_keys)
    summary.update({
        "mean_external_fragmentation_ratio": means["external_fragmentation_ratio"],
        "peak_external_fragmentation_ratio": peaks["external_fragmentation_ratio"],
        "mean_largest_allocatable_slots": means["largest_allocatable"] if not hybrid else None,
        "mean_running": means["running"],
        "peak_running": peaks["running"],
        "mean_waiting": means["waiting"],
        "peak_waiting": peaks["waiting"],
        "throughput_tokens_per_s": out_tokens / span if span > 0 else 0.0,
        "throughput_total_tokens_per_s":
            (out_tokens + int(reqs.prompt[done].sum())) / span if span > 0 else 0.0,
        "throughput_requests_per_s": float(done.sum()) / span if span > 0 else 0.0,
        "mean_ttft_s": float(np.mean(ttft[done])) if done.any() else math.nan,
        "p50_ttft_s": _pct(ttft[done], 50),
        "p99_ttft_s": _pct(ttft[done], 99),
        "mean_tpot_s": float(np.nanmean(tpot[done])) if np.isfinite(tpot[done]).any() else math.nan,
        "mean_e2e_latency_s": float(np.mean(e2e[done])) if done.any() else math.nan,
        "p99_e2e_latency_s": _pct(e2e[done], 99),
        "mean_normalized_latency_s": float(np.mean(e2e[done] / out_len[done])) if done.any() else math.nan,
        "num_prefill_tokens": engine.num_prefill_tokens,
        **_sharing_summary(engine, means["free"], kv_keys),
        "sim_time_s": span,
        "num_steps": engine.num_steps,
        "num_events": engine.num_events,
        "wall_time_s": wall_time_s,
    })
    requests = pd.DataFrame({
        "request_id": np.arange(reqs.N),
        "arrival_s": arrival,
        "prompt_len": reqs.prompt,
        "output_len": reqs.output,
        "status": pd.Categorical.from_codes(reqs.status.astype(np.int64), STATUS_NAMES),
        "refused_reason": [REFUSE_REASONS[int(r)] for r in reqs.refused],
        "first_token_s": reqs.first_token,
        "finish_s": reqs.finish,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "e2e_latency_s": np.where(done, e2e, np.nan),
        "normalized_latency_s": np.where(done, e2e / out_len, np.nan),
        "num_preemptions": reqs.preemptions,
    })
    return summary, requests


def _sharing_summary(engine: Engine, mean_free: float, counts: dict[str, int]) -> dict[str, Any]:
    """Prefix-cache counts (vLLM's names, in tokens), blocks saved by sharing, vmm page tails.

    ``blocks_saved_frac`` is the vLLM paper's Figure-15 quantity: blocks sharing saves
    over the blocks the same sequences would hold without it, both time-averaged.
    """
    shared = engine.rec.mean_shared()
    physical = engine.capacity - mean_free
    token_bytes = counts.get("token_bytes", 0)
    out: dict[str, Any] = dict(prefix_cache_stats(engine))
    out.update({
        "num_prefix_cache_evictions": counts.get("num_prefix_cache_evictions", 0),
        "mean_shared_slots": shared,
        "blocks_saved_frac": shared / (physical + shared) if physical + shared > 0 else 0.0,
        # the beam model's next-token concentration (fragsim.beams), when beams ran
        "beam_theta": engine.cfg.beam_theta if engine.cfg.beam_width > 1 else None,
        "vmm_tokens_per_page": counts.get("vmm_tokens_per_page", 0),
        # Bytes of the pool no token can use: the page tails of every K and V buffer.
        "page_tail_bytes": counts.get("page_tail_bytes_per_buffer", 0)
        * (engine.cfg.kv_bytes_per_token // token_bytes if token_bytes else 0),
    })
    return out


def simulate(trace: Any, allocator_name: str, spec: RunSpec,
             progress: Callable[[int], None] | None = None, check: bool = False,
             cost: Any = None) -> RunResult:
    engine = make_engine(trace, allocator_name, spec, progress=progress, check=check, cost=cost)
    t0 = time.perf_counter()
    engine.run()
    wall = time.perf_counter() - t0
    model, _ = _model_gpu(spec)
    summary, requests = summarize(engine, allocator_name, wall, model.kv_bytes_per_token_per_gpu(spec.tp))
    series = pd.DataFrame(engine.rec.timeseries())
    if engine.kv.unit == "bytes":
        kinds = pd.DataFrame(engine.kv.timeseries())  # type: ignore[attr-defined]
        series = series.merge(kinds, on="time_s", how="left") if len(kinds) else series
    return RunResult(allocator_name, summary, requests, series, engine.address_sampler.address_map())


def run_config(spec: RunSpec, allocators: list[str]) -> dict[str, Any]:
    """What ``config.json`` records: every parameter, the seed and the version."""
    return {"fragsim_version": __version__, "allocators": allocators, **spec.to_dict()}
