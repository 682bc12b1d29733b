"""Capacity planning: how many KV slots a model leaves on a GPU, and what a static
max-length reservation costs. Pure arithmetic; the CLI prints it.

``fragsim capacity`` (:func:`plan_capacity`) budgets as vLLM does at start-up, term
by term (:mod:`fragsim.vllm_memory`)::

    kv_budget_bytes = ceil(total × gpu_memory_utilization) − weights per rank
                      − activation peak − non-torch − CUDA graphs (0.33)
    kv_slots        = kv_budget_bytes // kv_bytes_per_token_per_gpu
    num_blocks      = kv_slots // block_size

``fragsim run``'s pool (:func:`kv_budget_slots`, :func:`kv_budget_bytes`) keeps the
plain arithmetic it was written with, ``total × utilization − weight_bytes / tp −
activation estimate``, so that committed reference results stay as they were.

Under tensor parallelism every GPU holds ``1/tp`` of the weights and ``1/tp`` of each
token's KV heads, so a slot costs each GPU ``kv_bytes_per_token / tp`` and the pool
has the same number of slots on every GPU (see
:meth:`fragsim.catalog.ModelConfig.kv_heads_per_gpu` for heads that do not split).

``total`` is the driver's total where the GPU preset has one
(:attr:`fragsim.configs.GPUConfig.driver_total_bytes`, what vLLM logs as
``total_gpu_memory``), else nvidia-smi's ``memory_bytes``.

NOTE: only :func:`plan_capacity` (``fragsim capacity``) starts from the driver's
total; :func:`kv_budget_slots` and :func:`kv_budget_bytes`, which size ``fragsim
run``'s pool, keep nvidia-smi's figure so that the committed reference results
(``results/reference/``, several on an H100) stay as they were written.

Worked check, the vLLM paper's Table 1 (OPT-13B on one A100-40GB: 12 GB of KV,
15.7K slots). With the defaults here (utilization 0.9, 2048 batched tokens)::

    40 GiB × 0.9                    38,654,705,664 B
    − weights 12,853,473,280 × 2    25,706,946,560 B
    − activation estimate              261,193,728 B
    = KV budget                     12,686,565,376 B  (11.8 GiB)
    // 819,200 B per slot           15,486 slots      (1.4% under the paper's 15.7K)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from fragsim.catalog import GPUConfig, ModelConfig, activation_peak_bytes
from fragsim.errors import FragsimError

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_BLOCK_SIZE = 16
# The chunked-prefill token budget runs size their activation estimate by when not
# told (``fragsim capacity`` takes ``vllm serve``'s figure for the card instead:
# 2,048 on an A100, 8,192 on an H100, 16,384 from 160 GiB).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class CapacityReport:
    """Every figure of a plan; bytes are exact integers, per GPU unless named otherwise.

    ``kv_budget_bytes`` is negative when weights and activations alone overflow the
    usable memory (``kv_slots`` is then 0). The ``static_*`` figures describe a
    static allocator reserving ``batch × max_seq_len`` slots up front; those that
    need ``batch`` or ``avg_len`` are ``None`` without them.
    """

    model: str
    gpu: str
    tp: int
    gpu_memory_utilization: float
    block_size: int
    max_seq_len: int
    max_num_batched_tokens: int
    batch: int | None
    avg_len: float | None
    kv_bytes_per_token: int             # whole model, all GPUs
    kv_bytes_per_token_per_gpu: int
    num_kv_heads_per_gpu: int
    kv_bytes_per_seq: int               # one max_seq_len sequence, whole model
    gpu_memory_bytes: int               # the total the budget starts from (driver's where known)
    usable_memory_bytes: int            # vLLM's requested memory, ceil(memory × utilization)
    weight_bytes: int                   # whole model
    weight_bytes_per_gpu: int
    activation_bytes: int
    activation_estimated: bool          # False when given explicitly
    kv_budget_bytes: int
    kv_slots: int
    num_blocks: int
    max_concurrency: float              # kv_slots / max_seq_len
    static_max_batch: int               # max_seq_len sequences that fit the budget
    static_kv_bytes: int | None         # batch × max_seq_len × kv_bytes_per_token
    static_kv_bytes_per_gpu: int | None
    static_total_bytes_per_gpu: int | None   # weights + activations + static KV
    static_fits: bool | None
    static_formula: str | None
    static_utilization: float | None    # avg_len / max_seq_len
    static_used_bytes: int | None       # batch × avg_len × kv_bytes_per_token
    paged_concurrency_at_avg_len: int | None  # num_blocks // ceil(avg_len / block_size)
    notes: tuple[str, ...] = ()
    kv_cache_dtype: str = "auto"
    gpu_memory_from_driver: bool = False   # gpu_memory_bytes is the driver's total, not nvidia-smi's
    # vLLM's hybrid plan (fragsim.vllm_plan.plan_summary): groups, page, blocks.
    vllm: dict[str, Any] | None = None
    # vLLM's start-up profile (fragsim.vllm_memory): the release whose rules it
    # follows and the terms beside weights and activations.
    vllm_version: str = ""
    max_num_seqs: int = 0
    non_torch_bytes: int = 0
    cuda_graph_bytes: int = 0
    cuda_graph_subtracted: bool = False
    forward_peak_bytes: int = 0
    sampler_peak_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["notes"] = list(self.notes)
        out["paged_block_size"] = self.block_size
        out["activation_peak_bytes"] = self.activation_bytes
        out.update(out.pop("vllm") or {})
        return out


def _check_int_option(name: str, option: str, value: Any, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (
        high is not None and value > high
    ):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise FragsimError(f"{name} ({option}) must be an integer {allowed}, got {value!r}")


def _usable_bytes(total_bytes: int, gpu_memory_utilization: float) -> int:
    ok = isinstance(gpu_memory_utilization, (int, float)) and not isinstance(
        gpu_memory_utilization, bool
    )
    if not ok or not 0 < gpu_memory_utilization <= 1:
        raise FragsimError(
            "gpu_memory_utilization (--gpu-memory-utilization) must be in (0, 1], "
            f"got {gpu_memory_utilization!r}"
        )
    # Through the decimal text so that 0.9 means 9/10, not 0.9000000000000000222.
    return math.floor(total_bytes * Fraction(repr(float(gpu_memory_utilization))))


def _budget(model: ModelConfig, total_bytes: int, tp: int, gpu_memory_utilization: float,
            max_num_batched_tokens: int, activation_bytes: int | None) -> tuple[int, int, int, int]:
    """(usable, weights per GPU, activation, budget) bytes on one GPU of ``total_bytes``."""
    _check_int_option("tp", "--tp", tp, 1)
    model.kv_heads_per_gpu(tp)  # refuses head counts that do not split
    usable = _usable_bytes(total_bytes, gpu_memory_utilization)
    _check_int_option("max_num_batched_tokens", "--max-num-batched-tokens",
                      max_num_batched_tokens, 1)
    if activation_bytes is None:
        activation = activation_peak_bytes(model, max_num_batched_tokens, tp=tp)
    else:
        _check_int_option("activation_bytes", "--activation-bytes", activation_bytes, 0)
        activation = activation_bytes
    weights = -(-model.weight_bytes // tp)  # ceil: embeddings and norms do not split evenly
    return usable, weights, activation, usable - weights - activation


def context_note(model: ModelConfig, max_seq_len: int) -> str:
    """Longer than the model was trained for: the arithmetic holds, the model may not
    (vLLM refuses such a max_model_len unless told to allow it)."""
    return (f"max_seq_len {max_seq_len:,} exceeds {model.name}'s context of "
            f"{model.max_position_embeddings:,} tokens (simulated as asked)")


def kv_budget_bytes(
    model: ModelConfig,
    gpu: GPUConfig,
    *,
    tp: int = 1,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    max_num_batched_tokens: int | None = None,
) -> int:
    """Bytes of the KV pool one GPU holds: what :func:`kv_budget_slots` cuts into slots."""
    tokens = (DEFAULT_MAX_NUM_BATCHED_TOKENS if max_num_batched_tokens is None
              else max_num_batched_tokens)
    parts = _budget(model, gpu.memory_bytes, tp, gpu_memory_utilization, tokens, None)
    if parts[3] <= 0:
        raise _no_room(model, gpu, tp, *parts)
    return parts[3]


def _no_room(model: ModelConfig, gpu: GPUConfig, tp: int, usable: int, weights: int,
             activation: int, budget: int) -> FragsimError:
    return FragsimError(
        f"no room for the KV cache of {model.name} on {gpu.name} (tp={tp}): "
        f"{usable:,} B usable − {weights:,} B weights − {activation:,} B activations "
        f"= {budget:,} B; raise --tp or --gpu-memory-utilization, or pick a larger GPU"
    )


def kv_budget_slots(
    model: ModelConfig,
    gpu: GPUConfig,
    *,
    tp: int = 1,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    max_num_batched_tokens: int | None = None,
    activation_bytes: int | None = None,
) -> int:
    """Slots of the KV pool one GPU holds (the same on every GPU under ``tp``).

    Raises :class:`FragsimError` when not even one slot fits, since an engine with
    an empty pool can serve nothing.
    """
    tokens = (DEFAULT_MAX_NUM_BATCHED_TOKENS if max_num_batched_tokens is None
              else max_num_batched_tokens)
    parts = _budget(model, gpu.memory_bytes, tp, gpu_memory_utilization, tokens, activation_bytes)
    slots = max(0, parts[3]) // model.kv_bytes_per_token_per_gpu(tp)
    if slots < 1:
        raise _no_room(model, gpu, tp, *parts)
    return slots


def plan_capacity(
    model: ModelConfig,
    gpu: GPUConfig,
    *,
    tp: int = 1,
    gpu_memory_utilization: float | None = None,
    max_seq_len: int | None = None,
    batch: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_num_batched_tokens: int | None = None,
    activation_bytes: int | None = None,
    avg_len: float | None = None,
    kv_cache_memory_bytes: int | None = None,
    prefix_caching: bool = True,
    seq_len: int | None = None,
    async_scheduling: bool = True,
    hybrid_manager: bool | None = None,
    chunked_hybrid: bool = True,
    vllm_block_size: int | None = None,
    max_num_seqs: int | None = None,
    vllm_version: str | None = None,
    enforce_eager: bool = False,
) -> CapacityReport:
    """The KV budget and pool of ``model`` on ``gpu``, and what a static allocator of
    ``batch × max_seq_len`` would reserve.

    ``max_seq_len`` defaults to the model's ``max_position_embeddings``, as vLLM's
    ``max_model_len`` does; it may not exceed it. The seed documents' cases come
    out exactly (``static_kv_bytes``)::

        llama-2-13b, batch 32, 2048   53,687,091,200 B  (53.7 GB; the seed's first
                                      figure, 536,870,912,000 B "≈ 500 GB", is a 10×
                                      slip, its later "53.7 GB" is right)
        llama-2-7b,  batch 16, 1024    8,589,934,592 B  (8.6 GB)
        llama-2-7b,  batch 48, 1024   25,769,803,776 B  (25.8 GB)
        llama-2-13b, batch 8,  2048   13,421,772,800 B  (13.4 GB)
        avg_len 180 of 1024           static_utilization 0.17578125 (17.6%)

    Beside these, ``vllm`` holds vLLM's own plan for the model's layer kinds
    (:func:`fragsim.vllm_plan.plan_vllm`): groups, page size, ``num_gpu_blocks`` for
    ``kv_cache_memory_bytes`` (default: the budget above), concurrency and, with
    ``seq_len``, the blocks one sequence holds per group. ``max_num_batched_tokens``
    and ``max_num_seqs`` default to ``vllm serve``'s figures for the card.

    The budget is vLLM's start-up profile of release ``vllm_version`` (default the
    newest, :mod:`fragsim.vllm_memory`): weights per rank as loaded, the profiling
    run's activation peak (``activation_bytes`` replaces it when given), non-torch
    memory and, where the release subtracts it, the CUDA-graph estimate.
    ``gpu_memory_utilization`` defaults to the release's (0.9 in 0.19, 0.92 in 0.33).
    """
    from fragsim.vllm_memory import DEFAULT_RELEASE, check_release, startup_profile
    from fragsim.vllm_plan import (
        backend_block_size,
        default_max_num_batched_tokens,
        plan_summary,
        plan_vllm,
    )

    if max_seq_len is None:
        max_seq_len = model.max_position_embeddings
    _check_int_option("max_seq_len", "--max-seq-len", max_seq_len, 1)
    _check_int_option("block_size", "--block-size", block_size, 1)
    if batch is not None:
        _check_int_option("batch", "--batch", batch, 1)
    if avg_len is not None:
        ok = isinstance(avg_len, (int, float)) and not isinstance(avg_len, bool)
        if not ok or not 0 < avg_len <= max_seq_len:
            raise FragsimError(f"avg_len (--avg-len) must be in (0, {max_seq_len}], got {avg_len!r}")
    tokens = (default_max_num_batched_tokens(gpu) if max_num_batched_tokens is None
              else max_num_batched_tokens)
    total = gpu.startup_total_bytes
    if gpu_memory_utilization is None:
        gpu_memory_utilization = check_release(vllm_version or DEFAULT_RELEASE).gpu_memory_utilization
    _check_int_option("tp", "--tp", tp, 1)
    model.kv_heads_per_gpu(tp)  # refuses head counts that do not split
    _usable_bytes(total, gpu_memory_utilization)  # refuses a bad utilization by name
    _check_int_option("max_num_batched_tokens", "--max-num-batched-tokens", tokens, 1)
    if max_num_seqs is not None:
        _check_int_option("max_num_seqs", "--max-num-seqs", max_num_seqs, 1)
    if activation_bytes is not None:
        _check_int_option("activation_bytes", "--activation-bytes", activation_bytes, 0)
    profile = startup_profile(
        model, gpu, tp=tp, gpu_memory_utilization=gpu_memory_utilization,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=tokens,
        vllm_version=vllm_version or DEFAULT_RELEASE, enforce_eager=enforce_eager)
    usable, weights = profile.requested_bytes, profile.weight_bytes
    activation = profile.activation_peak_bytes if activation_bytes is None else activation_bytes
    budget = profile.kv_cache_memory_bytes + profile.activation_peak_bytes - activation
    if kv_cache_memory_bytes is not None:
        _check_int_option("kv_cache_memory_bytes", "--kv-cache-memory-bytes",
                          kv_cache_memory_bytes, 1)
    if seq_len is not None:
        _check_int_option("seq_len", "--seq-len", seq_len, 1, max_seq_len)
    release = check_release(profile.vllm_version)
    plan = plan_vllm(
        model, gpu, max(0, budget) if kv_cache_memory_bytes is None else kv_cache_memory_bytes,
        tp=tp, max_model_len=max_seq_len, prefix_caching=prefix_caching,
        max_num_batched_tokens=tokens,
        async_scheduling=async_scheduling and release.counts_async_step,
        block_size=vllm_block_size, hybrid_manager=hybrid_manager,
        chunked_hybrid=chunked_hybrid)
    naive_block = vllm_block_size or backend_block_size(model, gpu)
    vllm = plan_summary(plan, model, tp, seq_len, naive_block)
    if release.tokens_from_blocks and plan.groups:
        smallest = min(g.page.block_size for g in plan.groups)
        vllm["kv_cache_tokens"] = plan.num_gpu_blocks // len(plan.groups) * smallest
    per_gpu = model.kv_bytes_per_token_per_gpu(tp)
    kv_heads = model.kv_heads_per_gpu(tp)
    kv_slots = max(0, budget) // per_gpu
    num_blocks = kv_slots // block_size
    notes: list[str] = []
    if budget <= 0:
        notes.append(
            f"weights, activations and the rest of vLLM's profile need {usable - budget:,} B "
            f"of the {usable:,} B requested: no KV cache fits; raise --tp or "
            "--gpu-memory-utilization"
        )
    if max_seq_len > model.max_position_embeddings:
        notes.append(context_note(model, max_seq_len))
    if kv_heads * tp > model.num_kv_heads:
        notes.append(f"tp={tp} exceeds the {model.num_kv_heads} KV heads: each GPU keeps "
                     "one replicated KV head")

    static = static_gpu = static_total = static_fits = formula = used = None
    if batch is not None:
        static = batch * max_seq_len * model.kv_bytes_per_token
        static_gpu = batch * max_seq_len * per_gpu
        static_total = weights + activation + static_gpu
        static_fits = static_gpu <= budget
        formula = (f"2 × {model.num_layers} layers × {batch} batch × {max_seq_len} tokens × "
                   f"{model.num_kv_heads} kv heads × {model.head_dim} head_dim × "
                   f"{model.dtype_bytes} B = {static:,} B")
        if not static_fits:
            notes.append(f"the static reservation needs {static_gpu:,} B per GPU but the KV "
                         f"budget is {budget:,} B: at most {kv_slots // max_seq_len} "
                         f"sequences of {max_seq_len} tokens fit")
    utilization = paged_at_avg = None
    if avg_len is not None:
        utilization = avg_len / max_seq_len
        paged_at_avg = num_blocks // math.ceil(avg_len / block_size)
        if batch is not None:
            used = round(batch * avg_len * model.kv_bytes_per_token)

    return CapacityReport(
        model=model.name, gpu=gpu.name, tp=tp,
        gpu_memory_utilization=float(gpu_memory_utilization), block_size=block_size,
        max_seq_len=max_seq_len, max_num_batched_tokens=tokens, batch=batch, avg_len=avg_len,
        kv_bytes_per_token=model.kv_bytes_per_token, kv_bytes_per_token_per_gpu=per_gpu,
        num_kv_heads_per_gpu=kv_heads, kv_bytes_per_seq=max_seq_len * model.kv_bytes_per_token,
        gpu_memory_bytes=total, usable_memory_bytes=usable,
        weight_bytes=model.weight_bytes, weight_bytes_per_gpu=weights,
        activation_bytes=activation, activation_estimated=activation_bytes is None,
        kv_budget_bytes=budget, kv_slots=kv_slots, num_blocks=num_blocks,
        max_concurrency=kv_slots / max_seq_len, static_max_batch=kv_slots // max_seq_len,
        static_kv_bytes=static, static_kv_bytes_per_gpu=static_gpu,
        static_total_bytes_per_gpu=static_total, static_fits=static_fits,
        static_formula=formula, static_utilization=utilization, static_used_bytes=used,
        paged_concurrency_at_avg_len=paged_at_avg, notes=tuple(notes),
        kv_cache_dtype=model.kv_cache_dtype, vllm=vllm,
        gpu_memory_from_driver=gpu.driver_total_bytes is not None,
        vllm_version=profile.vllm_version, max_num_seqs=profile.max_num_seqs,
        non_torch_bytes=profile.non_torch_bytes, cuda_graph_bytes=profile.cuda_graph_bytes,
        cuda_graph_subtracted=profile.cuda_graph_subtracted,
        forward_peak_bytes=profile.forward_peak_bytes,
        sampler_peak_bytes=profile.sampler_peak_bytes,
    )
