"""A model's weights from its ``config.json``: the parameter count, the checkpoint's
bytes and the tensor groups vLLM loads (:mod:`fragsim.weights`), read by
:func:`fragsim.hfconfig.model_from_hf`.

Parameters are estimated from the architecture: embeddings (tied or not), attention
or MLA projections, dense or expert MLPs, Mamba and Gated DeltaNet projections and
RMSNorms; biases and MLA's small norms are left out. Beside them vLLM loads a
rotary cos/sin cache and, for a multimodal file, a vision tower, which are extra
groups outside ``num_params``.
"""

from __future__ import annotations

from typing import Any

from fragsim.hfconfig import _attention_dims, _Config
from fragsim.layers import LayerSpec, StateShape
from fragsim.weights import WeightGroup, format_of, params_of, quantize, rotary_group, vision_group


def estimate_weights(c: _Config, arch: str, layers: tuple[LayerSpec, ...],
                      dtype_bytes: int) -> tuple[int, int, tuple[WeightGroup, ...]]:
    """(parameters, checkpoint bytes, weight groups) from the architecture; the
    groups (:mod:`fragsim.weights`) say how vLLM places each under tensor parallelism."""
    h = c.integer("hidden_size")
    vocab = c.integer("vocab_size")
    heads, kv_heads, head_dim = _attention_dims(c)
    tied = bool(c.raw.get("tie_word_embeddings", arch.startswith(("OPT", "Gemma"))))
    groups = [WeightGroup("embed_tokens", vocab * h, "vocab", rows=vocab)]
    if not tied:
        groups.append(WeightGroup("lm_head", vocab * h, "vocab", rows=vocab))
    if arch.startswith("OPT"):
        groups.append(WeightGroup("positions", (c.integer("max_position_embeddings", 2048) + 2) * h,
                                  "replicate"))
    n = c.integer("num_hidden_layers")
    attention_layers = sum(1 for layer in layers if layer.kind in ("full", "sliding", "chunked", "mla"))
    # Attention (or MLA) projections of one attention layer: (sharded, K/V, replicated).
    if arch.startswith("DeepseekV"):
        rope, nope, v = c.integer("qk_rope_head_dim"), c.integer("qk_nope_head_dim"), c.integer("v_head_dim")
        lora = c.integer("kv_lora_rank")
        q_lora = c.raw.get("q_lora_rank")
        q_down = h * q_lora if q_lora else 0
        q_up = (q_lora if q_lora else h) * heads * (nope + rope)
        attn = (q_up + lora * heads * (nope + v) + heads * v * h, 0, q_down + h * (lora + rope))
    else:
        q_width = heads * head_dim * (2 if arch.startswith("Qwen3Next") else 1)  # gated output
        attn = (h * q_width + heads * head_dim * h, 2 * h * kv_heads * head_dim, 0)
    groups += [WeightGroup("attention", attention_layers * attn[0], "shard"),
               WeightGroup("attention.kv", attention_layers * attn[1], "kv"),
               WeightGroup("attention.down", attention_layers * attn[2], "replicate")]
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
    # Which layers carry experts.
    first_dense = c.integer("first_k_dense_replace", 0, low=0)
    if arch.startswith("Jamba"):
        period, offset = c.integer("expert_layer_period", 1), c.integer("expert_layer_offset", 0, low=0)
        moe_layers = sum(1 for i in range(n) if experts and i % period == offset)
    elif arch.startswith("NemotronH"):
        moe_layers = list(c.raw.get("layer_types") or ()).count("moe") if experts else 0
    else:
        moe_layers = (n - first_dense) if experts else 0
    mlp_layers = n
    if arch.startswith("NemotronH"):
        mlp_layers = list(c.raw.get("layer_types") or ()).count("mlp")
    dense_layers = max(0, mlp_layers - moe_layers) if not arch.startswith("NemotronH") else mlp_layers
    # Two norms a decoder layer (Qwen3 adds per-head q/k norms) and a final one.
    norms = (2 * h + (2 * head_dim if arch.startswith("Qwen3For") else 0)) * n + h
    groups += [WeightGroup("norms", norms, "replicate"),
               WeightGroup("mlp", dense_layers * dense_mlp, "shard"),
               WeightGroup("experts", moe_layers * experts * 3 * h * expert_inter, "shard"),
               WeightGroup("router", moe_layers * experts * h, "replicate"),
               WeightGroup("shared_experts", moe_layers * shared, "shard")]
    mixers = sum(_state_params(layer.state, h) for layer in layers if layer.state is not None)
    groups.append(WeightGroup("mixer", mixers, "shard"))
    groups = [g for g in groups if g.params]
    params = params_of(groups)
    expert_params = next((g.params for g in groups if g.name == "experts"), 0)
    quant = c.raw.get("quantization_config") or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method == "fp8":
        weight_bytes = params
    elif method == "mxfp4":
        # 4-bit values plus one 8-bit scale per 32: 4.25 bits a weight.
        weight_bytes = (params - expert_params) * dtype_bytes + expert_params * 17 // 32
    else:
        weight_bytes = params * dtype_bytes
    groups = quantize(groups, format_of(c.raw, c.where, h))
    rotary = _rotary(c, arch, layers, head_dim)
    if rotary is not None:
        groups.append(rotary)
    vision = c.raw.get("vision_config")
    tower = vision_group(vision, h) if isinstance(vision, dict) else None
    if tower is not None:
        groups.append(tower)
    return params, weight_bytes, tuple(groups)


def moe_fields(c: _Config) -> dict[str, Any]:
    """Expert count, experts a token is routed to, and an expert's intermediate size."""
    experts = c.integer("num_local_experts", 0, low=0) or c.integer("n_routed_experts", 0, low=0) \
        or c.integer("num_experts", 0, low=0)
    if not experts:
        return {}
    top = (c.integer("num_experts_per_tok", 0, low=0) or c.integer("experts_per_token", 0, low=0)
           or c.integer("moe_topk", 0, low=0) or 1)
    inter = c.integer("moe_intermediate_size", 0, low=0) or c.integer("intermediate_size")
    return {"num_experts": experts, "experts_per_token": top, "moe_intermediate_size": inter}


def _rotary(c: _Config, arch: str, layers: tuple[LayerSpec, ...], head_dim: int) -> WeightGroup | None:
    """The rotary cos/sin cache vLLM keeps (one per distinct rope setting), if any."""
    if arch.startswith("OPT") or not any(layer.kind in ("full", "sliding", "chunked", "mla")
                                          for layer in layers):
        return None
    scaling = c.raw.get("rope_scaling") or c.raw.get("rope_parameters") or {}
    scaling = scaling if isinstance(scaling, dict) else {}
    positions = c.integer("max_position_embeddings", 2048)
    kind = str(scaling.get("rope_type") or scaling.get("type") or "default")
    factor = scaling.get("factor", 1)
    factor = factor if isinstance(factor, (int, float)) and factor >= 1 else 1
    if kind in ("yarn", "deepseek_yarn") and scaling.get("original_max_position_embeddings"):
        positions = int(scaling["original_max_position_embeddings"] * factor)
    elif kind in ("linear", "dynamic"):
        # vLLM's linear and dynamic-NTK caches cover max_position × factor
        positions = int(positions * factor)
    rotary_dim = c.integer("qk_rope_head_dim") if arch.startswith("DeepseekV") else int(
        head_dim * float(c.raw.get("partial_rotary_factor") or 1.0))
    copies = 2 if c.has("rope_local_base_freq") else 1     # Gemma 3: local and global
    return rotary_group(positions, rotary_dim, copies=copies)


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
