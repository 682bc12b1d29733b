"""A model and a GPU as numbers: what every byte and every second of a run comes from.

A *slot* is the K and V of one token across all layers::

    kv_bytes_per_token = 2 (K and V) × num_layers × num_kv_heads × head_dim × dtype_bytes
    OPT-13B:             2 × 40 × 40 × 128 × 2 B = 819,200 B  (800 KiB)

A hybrid model's layers have kinds (:mod:`fragsim.layers`); ``kv_bytes_per_token`` is
then the naive every-layer-full figure. The presets are :mod:`fragsim.catalog`'s; a
``config.json`` is read by :mod:`fragsim.hfconfig`, which builds these classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fragsim.errors import FragsimError
from fragsim.layers import ATTENTION_KINDS, LayerSpec, check_layers, full
from fragsim.layers import kv_dtype_bytes as _kv_dtype_bytes
from fragsim.weights import WeightGroup

GiB = 1 << 30
MiB = 1 << 20

# Rows of logits a forward pass materializes at most: vLLM's default max_num_seqs.
DEFAULT_MAX_NUM_SEQS = 256


def _check_int(owner: object, name: str, low: int, high: int | None = None) -> None:
    value = getattr(owner, name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f'"{name}" must be an integer, got {value!r}')
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f'"{name}" must be {allowed}, got {value}')


def _check_positive(owner: object, name: str) -> None:
    value = getattr(owner, name)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ValueError(f'"{name}" must be a finite number > 0, got {value!r}')


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer, as far as memory and FLOPs are concerned.

    ``num_kv_heads < num_heads`` is grouped-query attention (MQA at 1): only the KV
    heads are cached, which is why Llama-2-70B stores 8/64 of what its width says.
    ``hidden_size`` need not equal ``num_heads × head_dim``. ``gated_mlp`` (SwiGLU:
    gate, up and down projections) matters only to the activation estimate.

    ``layers`` gives each layer's kind (:mod:`fragsim.layers`); empty means what
    every model was until 2024, ``num_layers`` full-attention layers of
    ``num_kv_heads × head_dim``. ``kv_cache_dtype`` is vLLM's ``--kv-cache-dtype``
    (``auto`` caches in the model's dtype, ``fp8`` in one byte).
    ``checkpoint_bytes`` is the weights' size when it is not ``num_params ×
    dtype_bytes`` (FP8 or MXFP4 checkpoints). ``architecture`` is the config's
    ``architectures[0]``, for the few choices vLLM makes by model class.
    ``weights`` lists the checkpoint's tensors as vLLM places them under tensor
    parallelism (:mod:`fragsim.weights`); empty, :func:`fragsim.weights.groups_of`
    derives a dense decoder's from the dimensions. ``num_experts``,
    ``experts_per_token`` and ``moe_intermediate_size`` describe a mixture-of-experts
    MLP (0: dense), which sizes the fused-MoE workspace of a forward pass.
    """

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_params: int
    dtype_bytes: int = 2
    max_position_embeddings: int = 2048
    source: str = ""
    gated_mlp: bool = True
    layers: tuple[LayerSpec, ...] = ()
    kv_cache_dtype: str = "auto"
    checkpoint_bytes: int | None = None
    architecture: str = ""
    weights: tuple[WeightGroup, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f'"name" must be a non-empty string, got {self.name!r}')
        for name in ("num_layers", "num_heads", "head_dim", "hidden_size",
                     "intermediate_size", "vocab_size", "num_params", "max_position_embeddings"):
            _check_int(self, name, 1)
        _check_int(self, "num_kv_heads", 1, self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f'"num_kv_heads" must divide "num_heads" ({self.num_heads}), got {self.num_kv_heads}'
            )
        if self.dtype_bytes not in (1, 2, 4) or isinstance(self.dtype_bytes, bool):
            raise ValueError(
                f'"dtype_bytes" must be 1 (fp8), 2 (fp16/bf16) or 4 (fp32), got {self.dtype_bytes!r}'
            )
        if not isinstance(self.gated_mlp, bool):
            raise ValueError(f'"gated_mlp" must be true or false, got {self.gated_mlp!r}')
        if not isinstance(self.layers, tuple):
            raise ValueError(f'"layers" must be a tuple of LayerSpec, got {type(self.layers).__name__}')
        if self.layers:
            check_layers(self.layers)
            if len(self.layers) != self.num_layers:
                raise ValueError(f'"layers" must have num_layers = {self.num_layers} entries, '
                                 f"got {len(self.layers)}")
        try:
            _kv_dtype_bytes(self.kv_cache_dtype, self.dtype_bytes)
        except FragsimError as exc:
            raise ValueError(str(exc).replace("kv_cache_dtype (--kv-cache-dtype)",
                                              '"kv_cache_dtype"')) from None
        if self.checkpoint_bytes is not None:
            _check_int(self, "checkpoint_bytes", 1)

    @property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """Every layer's kind; a dense model is ``num_layers`` full-attention layers."""
        return self.layers or (full(self.num_kv_heads, self.head_dim),) * self.num_layers

    @property
    def is_hybrid(self) -> bool:
        """Whether any layer differs from the dense picture: not full attention, or
        full attention of other dimensions."""
        dense = full(self.num_kv_heads, self.head_dim)
        return any(layer != dense for layer in self.layers)

    @property
    def kv_dtype_bytes(self) -> int:
        """Bytes of one cached K or V element."""
        return _kv_dtype_bytes(self.kv_cache_dtype, self.dtype_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one slot: K and V of one token in every layer.

        For a hybrid model this is the naive every-layer-full-attention figure;
        :func:`fragsim.vllm_plan.plan_vllm` gives the exact one per layer kind.
        """
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def num_attention_layers(self) -> int:
        return sum(1 for layer in self.layer_specs if layer.kind in ATTENTION_KINDS)

    @property
    def weight_bytes(self) -> int:
        if self.checkpoint_bytes is not None:
            return self.checkpoint_bytes
        return self.num_params * self.dtype_bytes

    def kv_heads_per_gpu(self, tp: int) -> int:
        """KV heads one GPU stores under tensor parallelism of degree ``tp``.

        Follows vLLM: the query heads must split evenly (``num_heads % tp == 0``).
        With ``tp <= num_kv_heads`` the KV heads split evenly too; with more GPUs
        than KV heads (Llama-2-70B at tp=16) every GPU keeps one whole KV head,
        replicated ``tp / num_kv_heads`` times, so ``tp`` must be a multiple of
        ``num_kv_heads``. Anything else is refused, as vLLM refuses it.
        """
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise FragsimError(f"tp (--tp) must be an integer >= 1, got {tp!r}")
        if self.num_heads % tp:
            raise FragsimError(
                f"tp (--tp) must divide {self.name}'s {self.num_heads} attention heads, got {tp}"
            )
        if tp <= self.num_kv_heads:
            if self.num_kv_heads % tp:
                raise FragsimError(
                    f"tp (--tp) must divide {self.name}'s {self.num_kv_heads} KV heads, got {tp}"
                )
            return self.num_kv_heads // tp
        if tp % self.num_kv_heads:
            raise FragsimError(
                f"tp (--tp) above {self.name}'s {self.num_kv_heads} KV heads must be a multiple "
                f"of it (each GPU then holds one replicated KV head), got {tp}"
            )
        return 1

    def kv_bytes_per_token_per_gpu(self, tp: int = 1) -> int:
        """One slot's bytes on one GPU: ``kv_bytes_per_token / tp`` when heads divide."""
        return 2 * self.num_layers * self.kv_heads_per_gpu(tp) * self.head_dim * self.kv_dtype_bytes

    def flops_per_token(self) -> float:
        """Dense matmul FLOPs to push one token through the model, ``2 × num_params``.

        One multiply-add (2 FLOPs) per weight. Attention over the context is extra
        (:meth:`attention_flops`). The embedding lookup is counted as if it were a
        matmul, an overestimate of 2-13% (largest for Llama-3's 128K vocabulary)
        that the cost model's efficiency factors absorb.
        """
        return 2.0 * self.num_params

    def attention_flops(self, context_len: int) -> float:
        """FLOPs of QK^T and PV for one new token attending to ``context_len`` tokens.

        Each is ``num_heads × head_dim × context_len`` multiply-adds per layer; all
        query heads count, GQA shares KV heads but not the arithmetic.
        """
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * context_len


@dataclass(frozen=True)
class GPUConfig:
    """One accelerator. ``memory_bytes`` is what ``nvidia-smi
    --query-gpu=memory.total`` reports, not the marketing figure: an A100-40GB
    reports 40960 MiB = 40 GiB, an H100-80GB only 81559 MiB. ``fragsim run`` sizes
    its pool by it.

    ``driver_total_bytes`` is the total CUDA itself reports (``cudaMemGetInfo``),
    which vLLM logs as ``total_gpu_memory`` and multiplies by
    ``gpu_memory_utilization``; it is a few hundred MiB below nvidia-smi's::

        H100-80GB   nvidia-smi 81,559 MiB (79.65 GiB)   vLLM total_gpu_memory 79.19 GiB

    ``None`` where no published log gives it; :attr:`startup_total_bytes` then
    falls back to ``memory_bytes``. It moves a little with the driver version (an
    H100 printed 79.22 GiB in late 2024), so a preset carries one cited log's figure.

    ``arch`` (``sm80``, ``sm90``, ``sm100``, ``gfx942``, …) picks the attention
    backends vLLM would run there, which set the default KV block size
    (:mod:`fragsim.vllm_plan`); empty means vLLM's plain default of 16 tokens.
    ``sms`` is the count of streaming multiprocessors (compute units), which sizes
    one buffer of vLLM's sampler (0: unknown, taken as an H100's 132)."""

    name: str
    memory_bytes: int
    hbm_bandwidth: float
    fp16_flops: float
    pcie_bandwidth: float
    source: str = ""
    arch: str = ""
    driver_total_bytes: int | None = None
    sms: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f'"name" must be a non-empty string, got {self.name!r}')
        _check_int(self, "memory_bytes", 1)
        if self.driver_total_bytes is not None:
            _check_int(self, "driver_total_bytes", 1, self.memory_bytes)
        for name in ("hbm_bandwidth", "fp16_flops", "pcie_bandwidth"):
            _check_positive(self, name)
        _check_int(self, "sms", 0)

    @property
    def startup_total_bytes(self) -> int:
        """The total vLLM starts its KV budget from: the driver's where known."""
        return self.memory_bytes if self.driver_total_bytes is None else self.driver_total_bytes


def activation_peak_bytes(
    model: ModelConfig,
    max_num_batched_tokens: int,
    *,
    tp: int = 1,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
) -> int:
    """Peak bytes of temporaries in one forward pass over ``T`` batched tokens.

    Stands in for vLLM's profiling run (a dummy batch of ``max_num_batched_tokens``
    tokens whose peak is subtracted from the KV budget). Layers run one after the
    other without autograd, so only one layer's temporaries are live; per token::

        2 × hidden_size                      residual stream + normalized input
      + max(attention, mlp) where
        attention = (num_heads + 2 × kv_heads) × head_dim / tp    fused QKV output
                  +  num_heads × head_dim / tp                   attention output
        mlp       = 3 × intermediate_size / tp  (gated: gate|up output + act(gate)·up)
                    2 × intermediate_size / tp  (plain: fc1 output + activation)

    times ``dtype_bytes`` and ``T``, plus fp32 logits for the sampled rows,
    ``min(T, max_num_seqs) × vocab_size × 4`` (gathered to full vocab on every GPU).
    Attention is assumed fused (FlashAttention/xformers), so no ``T × T`` score
    matrix; an eager HF model needs far more, which is why the seeds' 2-4 GB of
    activations are larger than this. CUDA context, cuBLAS workspaces and CUDA
    graphs are not counted (a few hundred MB); pass ``activation_bytes`` to
    :func:`fragsim.capacity.plan_capacity` to use a measured peak instead.
    """
    if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1:
        raise FragsimError(
            "max_num_batched_tokens (--max-num-batched-tokens) must be an integer >= 1, "
            f"got {max_num_batched_tokens!r}"
        )
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise FragsimError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
    kv_heads = model.kv_heads_per_gpu(tp)
    q_width = model.num_heads * model.head_dim // tp
    attention = q_width + 2 * kv_heads * model.head_dim + q_width
    mlp = (3 if model.gated_mlp else 2) * math.ceil(model.intermediate_size / tp)
    per_token = (2 * model.hidden_size + max(attention, mlp)) * model.dtype_bytes
    logits = min(max_num_batched_tokens, max_num_seqs) * model.vocab_size * 4
    return per_token * max_num_batched_tokens + logits
