"""vLLM's start-up memory profile, term by term: what it subtracts before the KV cache.

At start-up vLLM loads the weights, runs one dummy forward pass of the batched-token
budget and one dummy sampling step, and then gives the KV cache what is left of the
requested memory (``vllm/v1/worker/gpu_worker.py``, ``determine_available_memory``)::

    available = total × gpu_memory_utilization
                − weights − torch activation peak − non-torch increase
                − CUDA-graph estimate        (0.33; 0.19 only with an opt-in variable)

Each term here is worked out from the model, the card and the settings:

weights
    :func:`fragsim.weights.weight_bytes_per_rank`: every tensor in the format its
    checkpoint declares, sharded or replicated as vLLM's layers place it, with the
    rotary cos/sin cache and, for gpt-oss's MXFP4 experts, the padding vLLM's MoE
    kernels lay them out with.
torch activation peak
    The larger of two moments of the profiling run (``profile_run``):

    * the forward pass over ``T = max_num_batched_tokens`` tokens. One layer's
      temporaries are live at a time: four hidden-sized tensors (the residual, the
      normalized input, the layer's output and its input) and the larger of the
      attention projections or the MLP's (a gated MLP's gate|up output and its
      activation, ``3 × intermediate / tp``; a fused-MoE layer's three intermediate
      caches, ``top_k × (2N + N + hidden)`` with ``N = moe_intermediate / tp``, and
      its fp32 router logits);
    * the dummy sampling step over ``min(max_num_seqs, T)`` rows
      (``_dummy_sampler_run``), while the forward's hidden states (``T × hidden``)
      are still held: the logits in the model dtype (over the vocabulary padded to
      64), then in 0.19 their fp32 copy, the fp32 probabilities and the fp32
      exponential noise of ``random_sample`` (``2 + 4 + 4 + 4`` bytes a logit for a
      bf16 model); in 0.33 one fp32 copy and the persistent int32 penalty counts
      (``2 + 4 + 4``); the top-k/top-p kernel's per-program buffer (``min(pow2(rows),
      SMs) × vocab`` fp32) and two ``rows × hidden`` inputs.

    Both sit on PyTorch's cuBLAS workspace (32 MiB on Hopper).
non-torch increase
    What the driver reports beyond PyTorch's allocator during the profile: cuBLAS
    and kernel images on one GPU; under tensor parallelism also the communicators'
    buffers (NCCL and the custom all-reduce), allocated on first use in the
    profile. These are measured figures of published start-up logs, not derived:
    see :data:`NON_TORCH`.
CUDA-graph memory
    One graph per capture size (1, 2, 4, then every 8 to 256 and every 16 to the
    largest, ``min(2 × max_num_seqs, 512)``), each holding its kernels' nodes: about
    half a MiB per layer per capture size in the published logs
    (:data:`GRAPH_BYTES_PER_LAYER`). vLLM 0.33 estimates it before the KV cache is
    sized and subtracts it (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`` defaults
    to 1); 0.19 captures after sizing and subtracts nothing (the variable
    defaults to 0).

What is not modelled: the multimodal encoder's profiling pass (a vision tower's
activations and its encoder cache), speculative decoding's rejection sampler,
pipeline parallelism, and CPU offload of weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from fragsim.configs import GiB, GPUConfig, MiB, ModelConfig
from fragsim.errors import FragsimError
from fragsim.weights import groups_of, weight_bytes_per_rank


@dataclass(frozen=True)
class Release:
    """The profile rules of one vLLM release line, with where each comes from."""

    name: str
    subtracts_cuda_graphs: bool      # VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS default
    sampler_fp32_tensors: int        # fp32 row × vocab tensors of the dummy sampling step
    counts_async_step: bool          # a request's most blocks count the async step in flight
    tokens_from_blocks: bool         # "GPU KV cache size" = blocks // groups × block size
    gpu_memory_utilization: float    # CacheConfig's default
    source: str


#: release line → its rules; the default is the newest
RELEASES: dict[str, Release] = {
    "0.19": Release(
        "0.19", subtracts_cuda_graphs=False, sampler_fp32_tensors=3, counts_async_step=False,
        tokens_from_blocks=True, gpu_memory_utilization=0.9,
        source="vLLM 0.19.1: config/cache.py gpu_memory_utilization default 0.9 (a 0.19 "
               "start-up at 0.90 does not list it among its non-default args); "
               "v1/worker/gpu_worker.py determine_available_memory (graph "
               "estimate applied only with VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1, "
               "envs.py default 0); v1/sample/sampler.py forward (fp32 copy), "
               "ops/topk_topp_sampler.py forward_native and random_sample (fp32 "
               "probabilities and exponential noise); v1/kv_cache_interface.py max_memory_usage_bytes "
               "(one max_num_batched_tokens in flight); v1/core/kv_cache_utils.py "
               "(GPU KV cache size = num_blocks // groups × smallest block size)"),
    "0.33": Release(
        "0.33", subtracts_cuda_graphs=True, sampler_fp32_tensors=2, counts_async_step=True,
        tokens_from_blocks=False, gpu_memory_utilization=0.92,
        source="vLLM 0.33.0: config/cache.py CacheConfig.gpu_memory_utilization default 0.92 "
               "(0.27.1 and 0.31.0 start-ups print 0.92 unasked); envs.py VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS default 1, "
               "so determine_available_memory subtracts profile_cudagraph_memory(); "
               "Model Runner V2's sampler warm-up (v1/worker/gpu/sample/sampler.py): one fp32 "
               "copy of the logits, FlashInfer top-k/top-p (its own temporaries not "
               "counted), and the persistent int32 output_bin_counts of penalties.py "
               "(max_num_seqs × vocab), which the profile counts as consumed; "
               "kv_cache_utils.py get_kv_cache_capacity (tokens = concurrency × "
               "max_model_len)"),
}
DEFAULT_RELEASE = "0.33"

#: PyTorch's cuBLAS workspace on the caching allocator: 4,096 KiB × 8 (sm90 default)
CUBLAS_WORKSPACE = 32 * MiB
#: non-torch increase during the profile, (one GPU, added per tensor-parallel group),
#: as the 0.19 H100 start-up logs of benchmarks/capacity_logs print it: 0.24–0.27 GiB
#: at tp 1 over 26 models, 2.06–2.11 GiB at tp 2 and 2.13–2.21 GiB at tp 4
NON_TORCH = (round(0.25 * GiB), round(1.82 * GiB), round(0.04 * GiB))
#: CUDA-graph pool per decoder layer per capture size (both the piecewise and the
#: full graph), vLLM 0.19's own estimates in the same logs: 0.40–0.61 MiB
GRAPH_BYTES_PER_LAYER = MiB // 2


def check_release(name: str) -> Release:
    """The rules of release line ``name`` (``0.19``, ``0.19.1`` and ``v0.33`` all work)."""
    key = str(name).strip().lstrip("v")
    key = ".".join(key.split(".")[:2])
    if key not in RELEASES:
        raise FragsimError(f"vllm_version (--vllm-version) must be one of "
                           f"{', '.join(RELEASES)}, got {name!r}")
    return RELEASES[key]


def default_max_num_seqs(gpu: GPUConfig) -> int:
    """``vllm serve``'s max_num_seqs on ``gpu``: 1,024 from 70 GiB except A100s, else
    256 (``EngineArgs.get_batch_defaults``, the same rule as the token budget)."""
    if gpu.memory_bytes >= 70 * GiB and gpu.arch != "sm80":
        return 1024
    return 256


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's default CUDA-graph capture sizes: 1, 2, 4, every 8 below 256, every 16
    from 256, up to ``min(2 × max_num_seqs, 512)``."""
    largest = min(2 * max_num_seqs, 512)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, largest + 1, 16)]
    return [s for s in sizes if s <= largest]


def forward_peak_bytes(model: ModelConfig, tokens: int, tp: int) -> int:
    """Temporaries of the dummy forward pass over ``tokens`` (see the module docstring)."""
    b = model.dtype_bytes
    q = model.num_heads * model.head_dim // tp
    kv = model.kv_heads_per_gpu(tp) * model.head_dim
    widths = [q + 2 * kv + q] if model.num_attention_layers else []
    if model.num_experts:
        n = math.ceil(model.moe_intermediate_size / tp)
        k = model.experts_per_token
        widths.append(k * (3 * n + model.hidden_size) + model.num_experts * 4 // b)
    if any(g.name == "mlp" and g.params for g in groups_of(model)):   # dense MLP layers
        widths.append((3 if model.gated_mlp else 2) * math.ceil(model.intermediate_size / tp))
    return tokens * (4 * model.hidden_size + max(widths)) * b


def sampler_peak_bytes(model: ModelConfig, gpu: GPUConfig, tokens: int, max_num_seqs: int,
                       release: Release) -> int:
    """The dummy sampling step and what the forward pass still holds (module docstring)."""
    b = model.dtype_bytes
    rows, vocab = min(max_num_seqs, tokens), model.vocab_size
    padded = -(-vocab // 64) * 64        # the model-dtype logits are a view of the padded rows
    # the fp32 copy of fp32 logits is the same tensor
    fp32 = release.sampler_fp32_tensors - (1 if b == 4 else 0)
    logits = rows * (padded * b + vocab * 4 * fp32)
    programs = min(1 << (rows - 1).bit_length(), gpu.sms or 132)
    topk_buffer = programs * vocab * 4
    held = (tokens + 2 * rows) * model.hidden_size * b
    return logits + topk_buffer + held


def non_torch_bytes(tp: int) -> int:
    """The non-torch increase of the profile on one GPU (:data:`NON_TORCH`)."""
    one, group, per_rank = NON_TORCH
    return one if tp == 1 else one + group + per_rank * (tp - 2) // 2


def cuda_graph_bytes(model: ModelConfig, max_num_seqs: int, enforce_eager: bool = False) -> int:
    """The CUDA-graph pool of every capture size (0 with ``enforce_eager``)."""
    if enforce_eager:
        return 0
    return len(capture_sizes(max_num_seqs)) * model.num_layers * GRAPH_BYTES_PER_LAYER


@dataclass(frozen=True)
class StartupProfile:
    """vLLM's start-up memory on one GPU, term by term (bytes)."""

    vllm_version: str
    total_bytes: int
    requested_bytes: int
    weight_bytes: int
    activation_peak_bytes: int
    forward_peak_bytes: int
    sampler_peak_bytes: int
    non_torch_bytes: int
    cuda_graph_bytes: int
    cuda_graph_subtracted: bool
    kv_cache_memory_bytes: int
    max_num_seqs: int
    max_num_batched_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def startup_profile(model: ModelConfig, gpu: GPUConfig, *, tp: int = 1,
                    gpu_memory_utilization: float | None = None, max_num_seqs: int | None = None,
                    max_num_batched_tokens: int, vllm_version: str = DEFAULT_RELEASE,
                    enforce_eager: bool = False, requested_bytes: int | None = None
                    ) -> StartupProfile:
    """Every term of vLLM's start-up memory for ``model`` on ``gpu`` (module docstring).

    ``requested_bytes`` is ``ceil(total × gpu_memory_utilization)`` unless given; the
    utilization defaults to the release's (0.9 in 0.19, 0.92 in 0.33)."""
    release = check_release(vllm_version)
    if gpu_memory_utilization is None:
        gpu_memory_utilization = release.gpu_memory_utilization
    seqs = default_max_num_seqs(gpu) if max_num_seqs is None else max_num_seqs
    if not isinstance(seqs, int) or isinstance(seqs, bool) or seqs < 1:
        raise FragsimError(f"max_num_seqs (--max-num-seqs) must be an integer >= 1, got {seqs!r}")
    total = gpu.startup_total_bytes
    if requested_bytes is None:
        requested_bytes = math.ceil(total * Fraction(repr(float(gpu_memory_utilization))))
    weights = weight_bytes_per_rank(model, tp)
    forward = forward_peak_bytes(model, max_num_batched_tokens, tp)
    sampler = sampler_peak_bytes(model, gpu, max_num_batched_tokens, seqs, release)
    activation = max(forward, sampler) + CUBLAS_WORKSPACE
    non_torch = non_torch_bytes(tp)
    graphs = cuda_graph_bytes(model, seqs, enforce_eager)
    subtracted = release.subtracts_cuda_graphs and not enforce_eager
    available = requested_bytes - weights - activation - non_torch - (graphs if subtracted else 0)
    return StartupProfile(
        vllm_version=release.name, total_bytes=total, requested_bytes=requested_bytes,
        weight_bytes=weights, activation_peak_bytes=activation, forward_peak_bytes=forward,
        sampler_peak_bytes=sampler, non_torch_bytes=non_torch, cuda_graph_bytes=graphs,
        cuda_graph_subtracted=subtracted, kv_cache_memory_bytes=available,
        max_num_seqs=seqs, max_num_batched_tokens=max_num_batched_tokens)



def nearest_release(version: str) -> str:
    """The modelled release line whose rules a logged version follows: before 0.21
    (when CUDA-graph profiling became the default) 0.19's, from it 0.33's."""
    parts = str(version).strip().lstrip("v").split(".")
    try:
        major, minor = int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return DEFAULT_RELEASE
    return "0.19" if (major, minor) < (0, 21) else "0.33"


def format_gib(n: float) -> str:
    """A byte count as vLLM prints it: ``round(n / GiB, 2)`` (so 1.0, not 1.00)."""
    return f"{round(n / GiB, 2)}"


def predicted_log(report: Any, plan: dict[str, Any]) -> list[str]:
    """The start-up lines vLLM of ``report.vllm_version`` would print (INFO, and the
    profiling summary it logs at DEBUG), with its rounding; times left as ``…``."""
    r = report
    non_kv = r.weight_bytes_per_gpu + r.activation_bytes + r.non_torch_bytes
    lines = [f"Model loading took {format_gib(r.weight_bytes_per_gpu)} GiB memory and … seconds"]
    if r.vllm_version == "0.33":
        if r.cuda_graph_bytes:
            lines.append(f"Estimated CUDA graph memory: {r.cuda_graph_bytes / GiB:.2f} GiB total")
        lines.append(
            f"(DEBUG) Memory profiling takes … seconds. Total non KV cache memory: "
            f"{format_gib(non_kv)}GiB; torch peak memory increase: {format_gib(r.activation_bytes)}GiB; "
            f"total consumed (from mem_get_info): {format_gib(non_kv)}GiB; "
            f"weights memory: {format_gib(r.weight_bytes_per_gpu)}GiB.")
    else:
        lines.append(
            f"(DEBUG) Memory profiling takes … seconds. Total non KV cache memory: "
            f"{format_gib(non_kv)}GiB; torch peak memory increase: {format_gib(r.activation_bytes)}GiB; "
            f"non-torch forward increase memory: {format_gib(r.non_torch_bytes)}GiB; "
            f"weights memory: {format_gib(r.weight_bytes_per_gpu)}GiB.")
    lines.append(f"Available KV cache memory: {format_gib(r.kv_budget_bytes)} GiB")
    size = f"GPU KV cache size: {plan['kv_cache_tokens']:,} tokens"
    concurrency = (f"Maximum concurrency for {r.max_seq_len:,} tokens per request: "
                   f"{plan['max_concurrency']:.2f}x")
    if r.vllm_version == "0.33":
        lines.append(f"{size}, {concurrency}")
    else:
        lines += [size, concurrency]
    if r.cuda_graph_bytes:
        lines.append(f"Graph capturing finished in … secs, took {r.cuda_graph_bytes / GiB:.2f} GiB")
    return lines


def _difference(ours: float, theirs: float | None, gib: bool = True) -> tuple[str, str, str]:
    """(fragsim, log, difference) cells: GiB to two places, counts as they are."""
    def show(x: float, sign: str = "") -> str:
        if gib:
            return f"{x:{sign}.2f} GiB"
        return f"{x:{sign},}" if float(x).is_integer() else f"{x:{sign},.2f}"
    if theirs is None:
        return show(ours), "-", ""
    delta = ours - theirs
    pct = f" ({100 * delta / theirs:+.1f}%)" if theirs else ""
    return show(ours), show(theirs), show(delta, "+") + pct


def compare_with_log(report: Any, plan: dict[str, Any], logged: Any, model: ModelConfig,
                     gpu: GPUConfig, plan_kwargs: dict[str, Any]
                     ) -> tuple[list[tuple[str, str, str, str]], list[str]]:
    """Term-by-term rows (term, fragsim, log, difference) of ``report`` against a read
    log, and the check of vLLM's block arithmetic from the log's own available memory."""
    r = report
    terms = [
        ("GPU total memory", r.gpu_memory_bytes / GiB, logged.total_gib),
        ("requested (total × utilization)", r.usable_memory_bytes / GiB, logged.requested_gib),
        ("weights per GPU", r.weight_bytes_per_gpu / GiB, logged.weights_gib),
        ("torch activation peak", r.activation_bytes / GiB, logged.activation_gib),
        ("non-torch memory", r.non_torch_bytes / GiB, logged.non_torch_gib),
        ("CUDA graphs", r.cuda_graph_bytes / GiB,
         logged.cuda_graph_estimate_gib if r.cuda_graph_subtracted and
         logged.cuda_graph_estimate_gib is not None else logged.cuda_graph_gib),
        ("available KV cache memory", r.kv_budget_bytes / GiB, logged.kv_cache_gib),
    ]
    rows = [(name, *_difference(ours, theirs)) for name, ours, theirs in terms]
    rows.append(("GPU KV cache size (tokens)",
                 *_difference(plan["kv_cache_tokens"], logged.kv_cache_tokens, gib=False)))
    rows.append(("maximum concurrency",
                 *_difference(plan["max_concurrency"], logged.concurrency, gib=False)))
    checks: list[str] = []
    if logged.kv_cache_gib is not None and logged.kv_cache_tokens is not None:
        from fragsim.capacity import plan_capacity

        low = math.ceil((logged.kv_cache_gib - 0.005) * GiB)
        high = math.floor((logged.kv_cache_gib + 0.005) * GiB)
        if low > 0:
            span = [plan_capacity(model, gpu, kv_cache_memory_bytes=b, **plan_kwargs).vllm
                    for b in (low, high)]
            assert span[0] is not None and span[1] is not None
            lo, hi = span[0]["kv_cache_tokens"], span[1]["kv_cache_tokens"]
            ok = lo <= logged.kv_cache_tokens <= hi
            checks.append(
                f"from the logged {logged.kv_cache_gib} GiB (± its rounding) vLLM's block "
                f"arithmetic gives {lo:,}–{hi:,} tokens; the log says "
                f"{logged.kv_cache_tokens:,}: {'consistent' if ok else 'NOT consistent'}")
    return rows, checks
