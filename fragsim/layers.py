"""Layer kinds: what one layer of a model keeps in memory for a sequence.

A model is a sequence of layers, and since 2024 they are no longer alike::

    kind      keeps, per sequence                              examples
    full      K and V of every token                           Llama, Qwen3, OPT
    sliding   K and V of the last ``window`` tokens            Mistral v0.1, Gemma 2/3, gpt-oss
    chunked   K and V of the tokens of the current chunk       Llama 4 (8,192-token chunks)
    mla       one latent of kv_lora_rank + rope dims a token   DeepSeek V2/V3 (whole on every rank)
    mamba     a fixed conv + SSM state                         Jamba, Bamba, Nemotron-H, Falcon-H1
    linear    a fixed conv + recurrent state                   Qwen3-Next (Gated DeltaNet)
    shared    nothing: reads another layer's KV                cross-layer KV sharing

Bytes per token of one attention layer on one GPU::

    full / sliding / chunked   2 (K and V) × kv_heads_per_gpu × head_dim × kv_dtype_bytes
    mla                        (kv_lora_rank + qk_rope_head_dim) × kv_dtype_bytes

A state layer holds the same bytes whatever the sequence length: the product of
each state tensor's shape times its dtype's bytes, summed (:meth:`StateShape.tensors`).

Pure arithmetic: no torch, no time. The vLLM planner (:mod:`fragsim.vllm_plan`)
turns these figures into one block pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fragsim.errors import FragsimError

ATTENTION_KINDS = ("full", "sliding", "chunked", "mla")
STATE_KINDS = ("mamba", "linear")
KINDS = (*ATTENTION_KINDS, *STATE_KINDS, "shared")

# vLLM's --kv-cache-dtype names (and the short ones people type) → bytes per element;
# "auto" is the model's own dtype.
KV_CACHE_DTYPES: dict[str, int | None] = {
    "auto": None,
    "float16": 2, "fp16": 2, "half": 2,
    "bfloat16": 2, "bf16": 2,
    "float32": 4, "fp32": 4,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1,
}

# Mamba state dtypes (vLLM's --mamba-cache-dtype / --mamba-ssm-cache-dtype).
STATE_DTYPES: dict[str, int | None] = {"auto": None, "float32": 4, "float16": 2, "bfloat16": 2}


def kv_dtype_bytes(kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    """Bytes of one cached element: ``auto`` keeps the model's dtype."""
    key = kv_cache_dtype.strip().lower() if isinstance(kv_cache_dtype, str) else kv_cache_dtype
    if key not in KV_CACHE_DTYPES:
        raise FragsimError(
            f"kv_cache_dtype (--kv-cache-dtype) must be one of {', '.join(KV_CACHE_DTYPES)}, "
            f"got {kv_cache_dtype!r}"
        )
    size = KV_CACHE_DTYPES[key]
    return model_dtype_bytes if size is None else size


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise FragsimError(f"tp (--tp) must divide the {n} {what}, got {tp}")
    return n // tp


@dataclass(frozen=True)
class StateShape:
    """The recurrent state of one Mamba or linear-attention layer, per sequence.

    ``variant`` picks the shapes, as vLLM's state-shape calculator computes them
    on one tensor-parallel rank:

    ``mamba1`` (Jamba)::

        conv  (intermediate / tp, conv_kernel − 1)
        ssm   (intermediate / tp, state_size)

    ``mamba2`` (Bamba, Nemotron-H, Falcon-H1); groups that do not split are
    replicated up to ``tp``::

        conv  (conv_kernel − 1, (intermediate + 2 × groups × state_size) / tp)
        ssm   (num_heads / tp, head_dim, state_size)

    ``gdn`` (Gated DeltaNet, Qwen3-Next), with key/value heads ``num_heads`` /
    ``num_v_heads`` and dims ``head_dim`` / ``v_head_dim``::

        conv  (conv_kernel − 1, (2 × num_heads × head_dim + num_v_heads × v_head_dim) / tp)
        ssm   (num_v_heads / tp, head_dim, v_head_dim)

    ``conv_dtype`` and ``ssm_dtype`` are ``auto`` (the model's dtype) or a
    :data:`STATE_DTYPES` name; Nemotron-H keeps its SSM state in float32.
    """

    variant: str
    conv_kernel: int
    intermediate_size: int = 0
    state_size: int = 0
    n_groups: int = 1
    num_heads: int = 0
    head_dim: int = 0
    num_v_heads: int = 0
    v_head_dim: int = 0
    conv_dtype: str = "auto"
    ssm_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.variant not in ("mamba1", "mamba2", "gdn"):
            raise ValueError(f'"variant" must be mamba1, mamba2 or gdn, got {self.variant!r}')
        need = {"mamba1": ("conv_kernel", "intermediate_size", "state_size"),
                "mamba2": ("conv_kernel", "intermediate_size", "state_size", "n_groups",
                           "num_heads", "head_dim"),
                "gdn": ("conv_kernel", "num_heads", "head_dim", "num_v_heads", "v_head_dim")}
        for name in need[self.variant]:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f'"{name}" must be an integer >= 1 for a {self.variant} state, '
                                 f"got {value!r}")
        for name in ("conv_dtype", "ssm_dtype"):
            if getattr(self, name) not in STATE_DTYPES:
                raise ValueError(f'"{name}" must be one of {", ".join(STATE_DTYPES)}, '
                                 f"got {getattr(self, name)!r}")

    def shapes(self, tp: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv shape, ssm shape) on one of ``tp`` ranks."""
        k = self.conv_kernel - 1
        if self.variant == "mamba1":
            inner = _divide(self.intermediate_size, tp, "mamba intermediate channels")
            return (inner, k), (inner, self.state_size)
        if self.variant == "mamba2":
            groups = self.n_groups if self.n_groups % tp == 0 else tp
            conv_dim = self.intermediate_size + 2 * groups * self.state_size
            return ((k, _divide(conv_dim, tp, "mamba conv channels")),
                    (_divide(self.num_heads, tp, "mamba heads"), self.head_dim, self.state_size))
        conv_dim = 2 * self.num_heads * self.head_dim + self.num_v_heads * self.v_head_dim
        return ((k, _divide(conv_dim, tp, "linear-attention conv channels")),
                (_divide(self.num_v_heads, tp, "linear-attention value heads"),
                 self.head_dim, self.v_head_dim))

    def tensors(self, model_dtype_bytes: int, tp: int = 1) -> tuple[tuple[tuple[int, ...], int], ...]:
        """Each state tensor's shape and bytes per element, conv first."""
        conv_bytes = STATE_DTYPES[self.conv_dtype] or model_dtype_bytes
        # vLLM: an "auto" SSM dtype follows the conv (mamba cache) dtype.
        ssm_bytes = STATE_DTYPES[self.ssm_dtype] or conv_bytes
        conv, ssm = self.shapes(tp)
        return (conv, conv_bytes), (ssm, ssm_bytes)

    def nbytes(self, model_dtype_bytes: int, tp: int = 1) -> int:
        """Bytes of the whole state of one sequence on one rank."""
        return sum(math.prod(shape) * size for shape, size in self.tensors(model_dtype_bytes, tp))


@dataclass(frozen=True)
class LayerSpec:
    """One layer's memory. Only the fields of its kind are set:

    - ``full``, ``sliding`` (``window`` tokens), ``chunked`` (``chunk`` tokens):
      ``num_kv_heads`` and ``head_dim``;
    - ``mla``: ``kv_lora_rank`` and ``qk_rope_head_dim``;
    - ``mamba`` / ``linear``: ``state``;
    - ``shared``: ``target``, the index of the layer whose KV it reads.
    """

    kind: str
    num_kv_heads: int = 0
    head_dim: int = 0
    window: int | None = None
    chunk: int | None = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    state: StateShape | None = None
    target: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f'"kind" must be one of {", ".join(KINDS)}, got {self.kind!r}')
        positive = {"full": ("num_kv_heads", "head_dim"),
                    "sliding": ("num_kv_heads", "head_dim", "window"),
                    "chunked": ("num_kv_heads", "head_dim", "chunk"),
                    "mla": ("kv_lora_rank", "qk_rope_head_dim")}.get(self.kind, ())
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f'"{name}" must be an integer >= 1 for a {self.kind} layer, '
                                 f"got {value!r}")
        if self.kind in STATE_KINDS and not isinstance(self.state, StateShape):
            raise ValueError(f'a {self.kind} layer needs "state" (a StateShape)')
        if self.kind == "shared" and (not isinstance(self.target, int) or self.target < 0):
            raise ValueError(f'a shared layer needs "target" >= 0, got {self.target!r}')

    @property
    def has_token_kv(self) -> bool:
        return self.kind in ATTENTION_KINDS

    def kv_heads_per_gpu(self, tp: int) -> int:
        """KV heads of this layer on one rank: split when they divide, else one
        replicated head per rank (vLLM's ``max(1, heads // tp)``); MLA's latent is
        whole on every rank."""
        if self.kind == "mla":
            return 1
        return max(1, self.num_kv_heads // tp)

    def head_size(self) -> int:
        """Elements per head per token: head_dim, or the MLA latent's width."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.kind == "mla" else self.head_dim

    def bytes_per_token(self, kv_bytes: int, tp: int = 1) -> int:
        """KV bytes one token costs this layer on one rank (0 for state and shared)."""
        if self.kind == "mla":
            return self.head_size() * kv_bytes
        if self.kind in ("full", "sliding", "chunked"):
            return 2 * self.kv_heads_per_gpu(tp) * self.head_dim * kv_bytes
        return 0

    def state_bytes(self, model_dtype_bytes: int, tp: int = 1) -> int:
        """Bytes of this layer's fixed per-sequence state on one rank."""
        return self.state.nbytes(model_dtype_bytes, tp) if self.state is not None else 0

    def label(self) -> str:
        if self.kind == "sliding":
            return f"sliding {self.window}"
        if self.kind == "chunked":
            return f"chunked {self.chunk}"
        if self.kind in STATE_KINDS and self.state is not None:
            return f"{self.kind} ({self.state.variant})"
        return self.kind


def count_labels(layers: tuple[LayerSpec, ...]) -> dict[str, int]:
    """Layers per label (``sliding 128``, ``full``, ...), in order of first appearance."""
    counts: dict[str, int] = {}
    for layer in layers:
        counts[layer.label()] = counts.get(layer.label(), 0) + 1
    return counts


def full(num_kv_heads: int, head_dim: int) -> LayerSpec:
    return LayerSpec("full", num_kv_heads=num_kv_heads, head_dim=head_dim)


def sliding(num_kv_heads: int, head_dim: int, window: int) -> LayerSpec:
    return LayerSpec("sliding", num_kv_heads=num_kv_heads, head_dim=head_dim, window=window)


def chunked(num_kv_heads: int, head_dim: int, chunk: int) -> LayerSpec:
    return LayerSpec("chunked", num_kv_heads=num_kv_heads, head_dim=head_dim, chunk=chunk)


def mla(kv_lora_rank: int, qk_rope_head_dim: int) -> LayerSpec:
    return LayerSpec("mla", kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim)


def state_layer(kind: str, state: StateShape) -> LayerSpec:
    return LayerSpec(kind, state=state)


def check_layers(layers: tuple[LayerSpec, ...]) -> None:
    """A shared layer must read an earlier layer that holds KV of its own."""
    for i, layer in enumerate(layers):
        if not isinstance(layer, LayerSpec):
            raise ValueError(f'"layers"[{i}] must be a LayerSpec, got {type(layer).__name__}')
        if layer.kind == "shared":
            t = layer.target
            if t is None or t >= i or not layers[t].has_token_kv:
                raise ValueError(f'"layers"[{i}]: a shared layer must name an earlier attention '
                                 f"layer as its target, got {t!r}")
