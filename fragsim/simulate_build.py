"""A run built from its :class:`~fragsim.simulate_spec.RunSpec`: the allocator (a dense
placement or preset, :func:`make_allocator`, or a hybrid KV manager,
:func:`make_hybrid_manager`), the cost model and the engine (:func:`make_engine`).
Running it and reading the result are :mod:`fragsim.simulate`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fragsim.allocators import PRESETS, create
from fragsim.engine import Engine, EngineConfig
from fragsim.errors import FragsimError
from fragsim.simulate_spec import RunSpec, _model_gpu, beam_theta, pool_bytes, pool_slots


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


def make_offload(trace: Any, allocator_name: str, spec: RunSpec, model: Any, gpu: Any,
                 kv: Any = None) -> Any:
    """The CPU tier a spec asks for (:mod:`fragsim.offload.connector`) over the engine's KV
    (``kv``), or an error naming what it cannot run with."""
    from fragsim.allocators import PRESETS
    from fragsim.offload.connector import OffloadConnector
    from fragsim.offload.groups import FULL_GROUP, TierGroup
    from fragsim.offload.spec import DiskSpec, OffloadSpec

    placement = PRESETS[allocator_name][0] if allocator_name in PRESETS else allocator_name
    hybrid = is_hybrid_manager(allocator_name)
    rows: tuple[Any, ...] = getattr(getattr(kv, "manager", None), "rows", ()) if hybrid else ()
    state = [r.label for r in rows if r.is_state]
    why = None
    if hybrid and allocator_name != "vllm-hybrid":
        why = ("a tier follows vLLM 0.33's offloading connector, which runs over vLLM's own "
               "hybrid KV manager: use --allocator vllm-hybrid")
    elif state:
        why = (f"the state layers ({', '.join(state)}) are not modelled with a tier: vLLM 0.33 "
               "offloads Mamba states in its 'align' cache mode, with checkpoint blocks, which "
               "fragsim's prefix caching does not model either")
    elif not hybrid and placement not in ("paged", "paged-shared"):
        why = f"a tier moves whole blocks, and {allocator_name!r} ({placement}) is not paged: use vllm or paged"
    elif spec.num_samples > 1 or spec.beam_width > 1:
        why = "parallel sampling and beam search are not modelled with a tier"
    elif spec.batching != "continuous":
        why = "a tier needs continuous batching"
    elif spec.scheduler != "vllm-v1":
        why = f"a tier runs under today's scheduler (vllm-v1), not {spec.scheduler}"
    elif hybrid and (len({r.block_bytes for r in rows}) > 1 or rows[0].block_bytes % kv.manager.block_size):
        why = "the groups' blocks differ in size; vLLM's hybrid manager gives every group one page size"
    if why is not None:
        raise FragsimError(f"--kv-offloading-size with allocator {allocator_name!r}: {why}")
    assert spec.kv_offloading_size is not None
    disk = DiskSpec(spec.kv_offloading_disk_size, spec.kv_offloading_disk_read_gbps * 1e9,
                    spec.kv_offloading_disk_write_gbps * 1e9, spec.kv_offloading_disk_threads) \
        if spec.kv_offloading_disk_size is not None else None
    offload = OffloadSpec(spec.kv_offloading_size, spec.kv_offloading_policy,
                          spec.kv_offloading_block_size, spec.kv_offloading_store_threshold,
                          spec.kv_offloading_prompt_only, spec.kv_offloading_backend, disk)
    groups, per_token, block_tokens = FULL_GROUP, model.kv_bytes_per_token_per_gpu(spec.tp), spec.block_size
    placed_from: Callable[[int, int], int] | None = None
    if hybrid:
        # Every group's chunk is one page a block (vLLM's hybrid manager pads them equal),
        # so each takes one chunk slot of the tier and moves its page's bytes.
        manager = kv.manager
        groups = tuple(TierGroup(r.kind, r.window, r.chunk) for r in rows)
        block_tokens = manager.block_size
        per_token = rows[0].block_bytes // block_tokens

        def placed_from(req: int, g: int) -> int:
            return int(manager.first_block(req, g)) * block_tokens
    try:
        connector = OffloadConnector(trace, offload, block_tokens, per_token, spec.tp,
                                     gpu.pcie_bandwidth, _gpu_keys(kv), groups, placed_from)
    except ValueError as exc:
        raise FragsimError(str(exc)) from None
    for level in connector.levels:
        if level.num_chunks < 1:
            size = spec.kv_offloading_size if level.name == "cpu" else spec.kv_offloading_disk_size
            raise FragsimError(f"the {level.name} tier of {size:g} GiB holds no block of "
                               f"{connector.chunk_bytes:,} bytes ({connector.chunk} tokens of every GPU)")
    return connector


def _gpu_keys(kv: Any) -> Any:
    """The GPU prefix cache's keys, where a dense KV manager has one."""
    prefix = getattr(kv, "prefix", None)
    return getattr(prefix, "_keys", None)


def make_engine(trace: Any, allocator_name: str, spec: RunSpec,
                progress: Callable[[int], None] | None = None, check: bool = False,
                cost: Any = None, model_gpu: tuple[Any, Any] | None = None,
                prefix_keys: Any = None) -> Engine:
    """The engine a spec describes; ``cost`` (a cost model object) overrides
    ``spec.cost_model`` (the calibration fit tries many), ``model_gpu`` the spec's
    model and GPU (a model built in code, such as the validator's miniatures);
    ``prefix_keys`` the prefix keys (a cluster's instances share one)."""
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
            scheduler=spec.scheduler,
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
        engine = Engine(trace, kv, cost, config, progress=progress, prefix_keys=prefix_keys)
    except ValueError as exc:
        raise FragsimError(str(exc)) from None
    if spec.kv_offloading_size is not None:
        tier = make_offload(trace, allocator_name, spec, model, gpu, engine.kv)
        tier.watch(getattr(engine.kv, "alloc", None))
        engine.connector = tier
    return engine
