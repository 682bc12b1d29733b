"""Presets of the models served in 2025–2026, with their layer kinds.

Each entry is the part of the model's published ``config.json`` that memory
depends on, copied field for field (the source is the line above it), and goes
through the same reader as a user's file (:func:`fragsim.hfconfig.model_from_hf`).
Parameter counts are estimated from the architecture by that reader; where a
checkpoint is FP8 (DeepSeek V3) or MXFP4 (gpt-oss experts) its ``quantization_config``
sets the weight bytes.

    preset               layers                                   KV per token, bf16
    llama-3.1-8b         32 full (8 × 128)                        131,072 B
    llama-3.1-70b        80 full (8 × 128)                        327,680 B
    qwen3-8b             36 full (8 × 128)                        147,456 B
    qwen3-32b            64 full (8 × 128)                        262,144 B
    mistral-7b-v0.1      32 sliding 4,096 (8 × 128)               131,072 B in the window
    gemma-2-9b           21 sliding 4,096 + 21 full (8 × 256)     344,064 B
    gemma-3-27b          52 sliding 1,024 + 10 full (16 × 128)    507,904 B
    gpt-oss-20b          12 sliding 128 + 12 full (8 × 64)         49,152 B
    gpt-oss-120b         18 sliding 128 + 18 full (8 × 64)         73,728 B
    llama-4-scout        36 chunked 8,192 + 12 full (8 × 128)     196,608 B
    deepseek-v3          61 MLA (512 + 64 latent)                  70,272 B
    qwen3-next-80b-a3b   36 Gated DeltaNet + 12 full (2 × 256)     24,576 B + state
    jamba-mini-1.5       28 Mamba-1 + 4 full (8 × 128)             32,768 B + state
    nemotron-h-8b        24 Mamba-2 + 4 full (8 × 128)             32,768 B + state

(Per-token figures count every layer that holds KV, on one GPU, before windows.)
"""

from __future__ import annotations

from typing import Any

_HF = "huggingface.co/{}/blob/main/config.json"

_GEMMA3_27B_TEXT = {
    "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
    "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
    "sliding_window": 1024, "sliding_window_pattern": 6, "vocab_size": 262208,
    "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
}


def _gpt_oss(layers: int, experts: int) -> dict[str, Any]:
    return {
        "architectures": ["GptOssForCausalLM"], "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": layers, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_local_experts": experts, "experts_per_token": 4,
        "vocab_size": 201088, "sliding_window": 128, "max_position_embeddings": 131072,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "mxfp4"},
    }


def _llama(layers: int, hidden: int, inter: int, heads: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def _qwen3(layers: int, hidden: int, inter: int, heads: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
        "torch_dtype": "bfloat16",
    }


# name → (config.json fields, source)
HF_PRESETS: dict[str, tuple[dict[str, Any], str]] = {
    "llama-3.1-8b": (_llama(32, 4096, 14336, 32), _HF.format("meta-llama/Llama-3.1-8B")),
    "llama-3.1-70b": (_llama(80, 8192, 28672, 64), _HF.format("meta-llama/Llama-3.1-70B")),
    "qwen3-8b": (_qwen3(36, 4096, 12288, 32), _HF.format("Qwen/Qwen3-8B")),
    "qwen3-32b": (_qwen3(64, 5120, 25600, 64), _HF.format("Qwen/Qwen3-32B")),
    "mistral-7b-v0.1": ({
        "architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 32000, "max_position_embeddings": 32768, "sliding_window": 4096,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }, _HF.format("mistralai/Mistral-7B-v0.1")),
    "gemma-2-9b": ({
        "architectures": ["Gemma2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 14336,
        "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 256, "sliding_window": 4096, "vocab_size": 256000,
        "max_position_embeddings": 8192, "torch_dtype": "float32",
    }, _HF.format("google/gemma-2-9b")),
    "gemma-3-27b": ({
        "architectures": ["Gemma3ForConditionalGeneration"], "text_config": _GEMMA3_27B_TEXT,
        "torch_dtype": "bfloat16",
    }, _HF.format("google/gemma-3-27b-it") + " (text_config)"),
    "gpt-oss-20b": (_gpt_oss(24, 32), _HF.format("openai/gpt-oss-20b")),
    "gpt-oss-120b": (_gpt_oss(36, 128), _HF.format("openai/gpt-oss-120b")),
    "llama-4-scout": ({
        "architectures": ["Llama4ForConditionalGeneration"],
        "text_config": {
            "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
            "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
            "head_dim": 128, "num_local_experts": 16, "interleave_moe_layer_step": 1,
            "attention_chunk_size": 8192, "no_rope_layers": [1, 1, 1, 0] * 12,
            "vocab_size": 202048, "max_position_embeddings": 10485760,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        },
    }, _HF.format("meta-llama/Llama-4-Scout-17B-16E-Instruct") + " (text_config)"),
    "deepseek-v3": ({
        "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
        "first_k_dense_replace": 3, "vocab_size": 129280, "max_position_embeddings": 163840,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8"},
    }, _HF.format("deepseek-ai/DeepSeek-V3")),
    "qwen3-next-80b-a3b": ({
        "architectures": ["Qwen3NextForCausalLM"], "hidden_size": 2048,
        "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "vocab_size": 151936, "max_position_embeddings": 262144,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }, _HF.format("Qwen/Qwen3-Next-80B-A3B-Instruct")),
    "jamba-mini-1.5": ({
        "architectures": ["JambaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "attn_layer_period": 8, "attn_layer_offset": 4, "expert_layer_period": 2,
        "expert_layer_offset": 1, "num_experts": 16, "mamba_d_state": 16, "mamba_d_conv": 4,
        "mamba_expand": 2, "mamba_dt_rank": 256, "vocab_size": 65536,
        "max_position_embeddings": 262144, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }, _HF.format("ai21labs/AI21-Jamba-Mini-1.5")),
    "nemotron-h-8b": ({
        "architectures": ["NemotronHForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 21504, "num_hidden_layers": 52, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 128,
        "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
        "expand": 2, "hybrid_override_pattern":
            "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "vocab_size": 131072, "max_position_embeddings": 8192,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }, _HF.format("nvidia/Nemotron-H-8B-Base-8K")),
}


def hf_preset_models() -> list[Any]:
    """The presets above as ModelConfigs."""
    from fragsim.hfconfig import model_from_hf

    return [model_from_hf(raw, f"preset {name!r}", name=name, source=source)
            for name, (raw, source) in HF_PRESETS.items()]
