"""Models from a Hugging Face ``config.json``: the layer kinds, dimensions and dtype
that the KV cache depends on. The file is the user's; nothing is fetched.

``read_hf_config(path)`` takes a ``config.json`` or a directory that holds one and
returns a :class:`fragsim.configs.ModelConfig` with its :attr:`layers`. Covered
(``architectures[0]``)::

    dense      Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, OPT
               (a ``sliding_window`` on a model without ``layer_types`` makes every
               layer sliding, as vLLM does for Mistral v0.1)
    sliding    Gemma 2 / 3, gpt-oss: ``layer_types``, else the pattern fields
               (Gemma 2 alternates from a sliding layer 0; Gemma 3 has
               ``sliding_window_pattern`` − 1 sliding layers per full one)
    chunked    Llama 4: ``layer_types``, else ``no_rope_layers`` (RoPE layers are
               chunked, NoPE layers full) with ``attention_chunk_size``
    mla        DeepSeek V2 / V3: ``kv_lora_rank`` + ``qk_rope_head_dim`` per token
    linear     Qwen3-Next: Gated DeltaNet layers, full attention every
               ``full_attention_interval``-th layer (or ``layer_types``)
    mamba      Jamba (Mamba-1, ``attn_layer_period`` / ``attn_layer_offset``),
               Bamba (``attn_layer_indices``), Nemotron-H (``hybrid_override_pattern``:
               M mamba, * attention, - and E no cache), Falcon-H1 (attention and
               Mamba-2 side by side in every layer)

Multimodal wrappers are read through their ``text_config`` (a vision tower's
weights are not counted). ``num_params`` is estimated from the architecture
(embeddings, attention or MLA, dense or expert MLPs, Mamba and DeltaNet projections,
RMSNorms; biases and MLA's small norms left out): exact for Llama and Qwen3, and
``checkpoint_bytes`` follows ``quantization_config``: FP8 checkpoints keep one byte
a weight, MXFP4 experts (gpt-oss) 4.25 bits.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fragsim.errors import FragsimError
from fragsim.layers import LayerSpec, StateShape, chunked, full, mla, sliding, state_layer

_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4, "half": 2, "float": 4}


class _Config:
    """One config table, whose every missing or mistyped field names itself."""

    def __init__(self, raw: dict[str, Any], where: str, arch: str) -> None:
        self.raw, self.where, self.arch = raw, where, arch

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def integer(self, key: str, default: int | None = None, low: int = 1) -> int:
        value = self.raw.get(key)
        if value is None:
            if default is None:
                raise FragsimError(f"{self.where}: missing field {key!r} (needed for {self.arch})")
            return default
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise FragsimError(f"{self.where}: field {key!r} must be an integer >= {low}, "
                               f"got {value!r}")
        return value

    def seq(self, key: str, length: int | None = None) -> list[Any]:
        value = self.raw.get(key)
        if not isinstance(value, list):
            raise FragsimError(f"{self.where}: field {key!r} must be a list, got {value!r}")
        if length is not None and len(value) != length:
            raise FragsimError(f"{self.where}: field {key!r} must have num_hidden_layers = "
                               f"{length} entries, got {len(value)}")
        return value

    def text(self, key: str) -> str:
        value = self.raw.get(key)
        if not isinstance(value, str) or not value:
            raise FragsimError(f"{self.where}: field {key!r} must be a non-empty string, "
                               f"got {value!r}")
        return value


def _attention_dims(c: _Config) -> tuple[int, int, int]:
    heads = c.integer("num_attention_heads")
    kv_heads = c.integer("num_key_value_heads", heads)
    head_dim = c.integer("head_dim", 0, low=0) or c.integer("hidden_size") // heads
    return heads, kv_heads, head_dim


def _layer_types(c: _Config, n: int, allowed: dict[str, str]) -> list[str] | None:
    if not c.has("layer_types"):
        return None
    kinds = []
    for i, name in enumerate(c.seq("layer_types", n)):
        if name not in allowed:
            raise FragsimError(f"{c.where}: layer_types[{i}] is {name!r}; allowed for "
                               f"{c.arch}: {', '.join(allowed)}")
        kinds.append(allowed[name])
    return kinds


def _windowed(c: _Config, n: int, kv_heads: int, head_dim: int, kinds: list[str]) -> list[LayerSpec]:
    window = c.integer("sliding_window") if "sliding" in kinds else 0
    chunk = c.integer("attention_chunk_size") if "chunked" in kinds else 0
    out = []
    for kind in kinds:
        if kind == "sliding":
            out.append(sliding(kv_heads, head_dim, window))
        elif kind == "chunked":
            out.append(chunked(kv_heads, head_dim, chunk))
        else:
            out.append(full(kv_heads, head_dim))
    return out


_ATTN_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


def _dense_layers(c: _Config, n: int) -> list[LayerSpec]:
    _, kv_heads, head_dim = _attention_dims(c)
    kinds = _layer_types(c, n, _ATTN_TYPES)
    if kinds is None:
        # vLLM applies a model-wide sliding_window to every layer (Mistral v0.1);
        # Qwen2/3 set one but switch it off with use_sliding_window = false.
        on = c.has("sliding_window") and c.raw.get("use_sliding_window", True) is not False
        kinds = ["sliding" if on else "full"] * n
    return _windowed(c, n, kv_heads, head_dim, kinds)


def _gemma_layers(c: _Config, n: int) -> list[LayerSpec]:
    _, kv_heads, head_dim = _attention_dims(c)
    kinds = _layer_types(c, n, _ATTN_TYPES)
    if kinds is None:
        if c.arch.startswith("Gemma2"):
            kinds = ["sliding" if i % 2 == 0 else "full" for i in range(n)]
        else:
            period = c.integer("sliding_window_pattern")
            kinds = ["full" if (i + 1) % period == 0 else "sliding" for i in range(n)]
    return _windowed(c, n, kv_heads, head_dim, kinds)


def _llama4_layers(c: _Config, n: int) -> list[LayerSpec]:
    _, kv_heads, head_dim = _attention_dims(c)
    kinds = _layer_types(c, n, {"chunked_attention": "chunked", "full_attention": "full"})
    if kinds is None:
        rope = c.seq("no_rope_layers", n)
        on = c.has("attention_chunk_size")
        kinds = ["chunked" if flag and on else "full" for flag in rope]
    return _windowed(c, n, kv_heads, head_dim, kinds)


def _deepseek_layers(c: _Config, n: int) -> list[LayerSpec]:
    return [mla(c.integer("kv_lora_rank"), c.integer("qk_rope_head_dim"))] * n


def _qwen3_next_layers(c: _Config, n: int) -> list[LayerSpec]:
    _, kv_heads, head_dim = _attention_dims(c)
    kinds = _layer_types(c, n, {"full_attention": "full", "linear_attention": "linear"})
    if kinds is None:
        period = c.integer("full_attention_interval")
        kinds = ["full" if (i + 1) % period == 0 else "linear" for i in range(n)]
    state = StateShape("gdn", conv_kernel=c.integer("linear_conv_kernel_dim"),
                       num_heads=c.integer("linear_num_key_heads"),
                       head_dim=c.integer("linear_key_head_dim"),
                       num_v_heads=c.integer("linear_num_value_heads"),
                       v_head_dim=c.integer("linear_value_head_dim"))
    return [full(kv_heads, head_dim) if k == "full" else state_layer("linear", state) for k in kinds]


def _mamba2_state(c: _Config, prefix: str = "mamba_", ssm_dtype: str = "auto") -> StateShape:
    """Mamba-2 dims; Bamba and Falcon-H1 prefix them ``mamba_``, Nemotron-H does not."""
    if prefix:
        heads, head_dim = c.integer("mamba_n_heads"), c.integer("mamba_d_head")
        groups, state, kernel = c.integer("mamba_n_groups"), c.integer("mamba_d_state"), c.integer("mamba_d_conv")
        inner = c.integer("mamba_d_ssm", 0, low=0) or c.integer("mamba_expand") * c.integer("hidden_size")
    else:
        heads, head_dim = c.integer("mamba_num_heads"), c.integer("mamba_head_dim")
        groups, state, kernel = c.integer("n_groups"), c.integer("ssm_state_size"), c.integer("conv_kernel")
        inner = heads * head_dim
    return StateShape("mamba2", conv_kernel=kernel, intermediate_size=inner, state_size=state,
                      n_groups=groups, num_heads=heads, head_dim=head_dim, ssm_dtype=ssm_dtype)


def _mamba_hybrid_layers(c: _Config, n: int) -> list[LayerSpec]:
    _, kv_heads, head_dim = _attention_dims(c)
    attention = full(kv_heads, head_dim)
    if c.arch.startswith("Jamba"):
        period, offset = c.integer("attn_layer_period"), c.integer("attn_layer_offset", low=0)
        inner = c.integer("mamba_expand") * c.integer("hidden_size")
        m1 = StateShape("mamba1", conv_kernel=c.integer("mamba_d_conv"), intermediate_size=inner,
                        state_size=c.integer("mamba_d_state"))
        return [attention if i % period == offset else state_layer("mamba", m1) for i in range(n)]
    if c.arch.startswith("Bamba"):
        picked = c.seq("attn_layer_indices")
        bad = [i for i in picked if not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise FragsimError(f"{c.where}: attn_layer_indices must be layer numbers in "
                               f"[0, {n - 1}], got {bad[0]!r}")
        m2 = _mamba2_state(c)
        return [attention if i in picked else state_layer("mamba", m2) for i in range(n)]
    if c.arch.startswith("NemotronH"):
        pattern = c.text("hybrid_override_pattern")
        if len(pattern) != n or set(pattern) - set("M*-E"):
            raise FragsimError(f"{c.where}: hybrid_override_pattern must have num_hidden_layers = "
                               f"{n} characters of M, *, -, E, got {pattern!r}")
        dtype = c.raw.get("mamba_ssm_cache_dtype") or "float32"
        m2 = _mamba2_state(c, prefix="", ssm_dtype=dtype)
        return [state_layer("mamba", m2) if ch == "M" else attention
                for ch in pattern if ch in "M*"]
    # Falcon-H1: each decoder layer runs attention and a Mamba-2 mixer in parallel.
    m2 = _mamba2_state(c)
    return [layer for _ in range(n) for layer in (attention, state_layer("mamba", m2))]


# architectures[0] → layer builder; a prefix match covers the *ForCausalLM /
# *ForConditionalGeneration variants.
_FAMILIES = {
    "LlamaFor": _dense_layers, "MistralFor": _dense_layers, "MixtralFor": _dense_layers,
    "Qwen2For": _dense_layers, "Qwen3For": _dense_layers, "Qwen3MoeFor": _dense_layers,
    "OPTFor": _dense_layers,
    "Gemma2For": _gemma_layers, "Gemma3For": _gemma_layers, "GptOssFor": _gemma_layers,
    "Llama4For": _llama4_layers,
    "DeepseekV2For": _deepseek_layers, "DeepseekV3For": _deepseek_layers,
    "Qwen3NextFor": _qwen3_next_layers,
    "JambaFor": _mamba_hybrid_layers, "BambaFor": _mamba_hybrid_layers,
    "NemotronHFor": _mamba_hybrid_layers, "FalconH1For": _mamba_hybrid_layers,
}


def _family(arch: str) -> Any:
    for prefix, build in _FAMILIES.items():
        if arch.startswith(prefix):
            return build
    return None


def _load(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise FragsimError(f"cannot read model config {str(p)!r}: {exc.strerror}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FragsimError(f"{p}: not valid JSON (line {exc.lineno}, column {exc.colno}): "
                           f"{exc.msg}") from None
    if not isinstance(raw, dict):
        raise FragsimError(f"{p}: must hold a JSON object, got {type(raw).__name__}")
    return p, raw


def is_config_path(name: str) -> bool:
    """Whether ``--model`` names a file or folder rather than a preset."""
    return name.endswith(".json") or os.sep in name or "/" in name or Path(name).is_dir()


def read_hf_config(path: str | os.PathLike[str]) -> Any:
    """The :class:`~fragsim.catalog.ModelConfig` a ``config.json`` (or the folder
    holding one) describes."""
    p, raw = _load(path)
    name = str(raw.get("_name_or_path") or "").split("/")[-1] or p.parent.name or p.stem
    return model_from_hf(raw, str(p), name=name.lower(), source=str(p))


def model_from_hf(raw: dict[str, Any], where: str, *, name: str, source: str) -> Any:
    """A ModelConfig from the fields of a parsed ``config.json``; errors start with
    ``where``."""
    from fragsim.configs import ModelConfig

    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise FragsimError(f"{where}: missing field 'architectures' (a list naming the model class)")
    arch = archs[0]
    build = _family(arch)
    if build is None:
        known = ", ".join(sorted(k + "*" for k in _FAMILIES))
        raise FragsimError(f"{where}: unknown architecture {arch!r}; known: {known}")
    text = raw.get("text_config")
    table = {**raw, **text} if isinstance(text, dict) else raw
    c = _Config(table, where, arch)
    n = c.integer("num_hidden_layers")
    layers = tuple(build(c, n))
    heads, kv_heads, head_dim = _attention_dims(c)
    if arch.startswith("DeepseekV"):
        kv_heads, head_dim = heads, c.integer("v_head_dim")
    dtype_name = table.get("torch_dtype") or table.get("dtype") or "bfloat16"
    if dtype_name not in _DTYPES:
        raise FragsimError(f"{where}: field 'torch_dtype' must be one of {', '.join(_DTYPES)}, "
                           f"got {dtype_name!r}")
    # vLLM serves a float32 checkpoint in 16 bits unless told otherwise (Gemma 2).
    dtype_bytes = min(_DTYPES[dtype_name], 2)
    hidden = c.integer("hidden_size")
    inter = c.integer("ffn_dim") if arch.startswith("OPT") else c.integer(
        "intermediate_size", c.integer("moe_intermediate_size", 4 * hidden))
    params, weight_bytes = _estimate_weights(c, arch, layers, dtype_bytes)
    try:
        return ModelConfig(
            name=name or "config", num_layers=len(layers), num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim, hidden_size=hidden, intermediate_size=inter,
            vocab_size=c.integer("vocab_size"), num_params=params, dtype_bytes=dtype_bytes,
            max_position_embeddings=c.integer("max_position_embeddings", 2048),
            source=source, gated_mlp=not arch.startswith("OPT"), layers=layers,
            checkpoint_bytes=weight_bytes if weight_bytes != params * dtype_bytes else None,
            architecture=arch,
        )
    except ValueError as exc:
        raise FragsimError(f"{where}: {exc}") from None


def _estimate_weights(c: _Config, arch: str, layers: tuple[LayerSpec, ...],
                      dtype_bytes: int) -> tuple[int, int]:
    """(parameters, checkpoint bytes) from the architecture."""
    h = c.integer("hidden_size")
    vocab = c.integer("vocab_size")
    heads, kv_heads, head_dim = _attention_dims(c)
    tied = bool(c.raw.get("tie_word_embeddings", arch.startswith(("OPT", "Gemma"))))
    embed = vocab * h * (1 if tied else 2)
    if arch.startswith("OPT"):
        embed += (c.integer("max_position_embeddings", 2048) + 2) * h
    n = c.integer("num_hidden_layers")
    # Attention (or MLA) projections of one attention layer.
    if arch.startswith("DeepseekV"):
        rope, nope, v = c.integer("qk_rope_head_dim"), c.integer("qk_nope_head_dim"), c.integer("v_head_dim")
        q_lora = c.raw.get("q_lora_rank")
        q = (h * q_lora + q_lora * heads * (nope + rope)) if q_lora else h * heads * (nope + rope)
        attn = q + h * (c.integer("kv_lora_rank") + rope) + c.integer("kv_lora_rank") * heads * (nope + v)
        attn += heads * v * h
    else:
        q_width = heads * head_dim * (2 if arch.startswith("Qwen3Next") else 1)  # gated output
        attn = h * q_width + 2 * h * kv_heads * head_dim + heads * head_dim * h
    # MLPs: dense, or routed + shared experts.
    dense_inter = c.integer("ffn_dim") if arch.startswith("OPT") else c.integer(
        "intermediate_size", c.integer("moe_intermediate_size", 4 * h))
    per_mat = 2 if arch.startswith(("OPT", "NemotronH")) else 3   # plain or squared-ReLU MLP
    dense_mlp = per_mat * h * dense_inter
    experts = c.integer("num_local_experts", 0, low=0) or c.integer("n_routed_experts", 0, low=0) \
        or c.integer("num_experts", 0, low=0)
    expert_inter = c.integer("moe_intermediate_size", 0, low=0) or dense_inter
    shared = (c.integer("n_shared_experts", 0, low=0) * 3 * h * expert_inter
              + 3 * h * c.integer("shared_expert_intermediate_size", 0, low=0))
    if arch.startswith("Llama4"):
        expert_inter, shared = c.integer("intermediate_size"), 3 * h * c.integer("intermediate_size")
        dense_mlp = 3 * h * c.integer("intermediate_size_mlp", dense_inter)
    routed = experts * 3 * h * expert_inter + experts * h
    # Which layers carry experts.
    first_dense = c.integer("first_k_dense_replace", 0, low=0)
    if arch.startswith("Jamba"):
        period, offset = c.integer("expert_layer_period", 1), c.integer("expert_layer_offset", 0, low=0)
        moe_layers = sum(1 for i in range(n) if experts and i % period == offset)
    elif arch.startswith("NemotronH"):
        moe_layers = c.raw.get("hybrid_override_pattern", "").count("E") if experts else 0
    else:
        moe_layers = (n - first_dense) if experts else 0
    mlp_layers = n
    if arch.startswith("NemotronH"):
        mlp_layers = c.raw.get("hybrid_override_pattern", "").count("-")
    dense_layers = max(0, mlp_layers - moe_layers) if not arch.startswith("NemotronH") else mlp_layers
    # Two norms a decoder layer (Qwen3 adds per-head q/k norms) and a final one.
    norms = (2 * h + (2 * head_dim if arch.startswith("Qwen3For") else 0)) * n + h
    params = embed + norms + dense_layers * dense_mlp + moe_layers * (routed + shared)
    for layer in layers:
        if layer.kind in ("full", "sliding", "chunked", "mla"):
            params += attn
        elif layer.state is not None:
            params += _state_params(layer.state, h)
    expert_params = moe_layers * experts * 3 * h * expert_inter
    quant = c.raw.get("quantization_config") or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method == "fp8":
        weight_bytes = params
    elif method == "mxfp4":
        # 4-bit values plus one 8-bit scale per 32: 4.25 bits a weight.
        weight_bytes = (params - expert_params) * dtype_bytes + expert_params * 17 // 32
    else:
        weight_bytes = params * dtype_bytes
    return params, weight_bytes


def _state_params(s: StateShape, h: int) -> int:
    k = s.conv_kernel
    if s.variant == "mamba1":
        inner, dt_rank = s.intermediate_size, -(-h // 16)
        return (h * 2 * inner + inner * k + inner * (dt_rank + 2 * s.state_size)
                + dt_rank * inner + inner * s.state_size + inner + inner * h)
    if s.variant == "mamba2":
        inner, gs = s.intermediate_size, s.n_groups * s.state_size
        conv_dim = inner + 2 * gs
        return h * (2 * inner + 2 * gs + s.num_heads) + conv_dim * k + 3 * s.num_heads + inner * h
    key, value = s.num_heads * s.head_dim, s.num_v_heads * s.v_head_dim
    return (h * (2 * key + 2 * value) + h * 2 * s.num_v_heads + (2 * key + value) * k
            + 2 * s.num_v_heads + value * h)
