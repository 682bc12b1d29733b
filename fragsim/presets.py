"""Presets of the models served in 2025–2026, with their layer kinds.

Each preset is the model's published ``config.json``, read by the same reader as a
user's file (:func:`fragsim.hfconfig.read_hf_config`, through transformers' config
class). The files are bundled unedited in ``fragsim/model_configs/``, with where each
was found in ``SOURCES.md`` beside them. Four presets have no bundled file (no
unedited copy could be found); their entries below copy the published file's
fields that memory depends on, and go through the same reader. Parameter counts
are estimated from the architecture by that reader; where a checkpoint is FP8
(DeepSeek V3) or MXFP4 (gpt-oss experts) its ``quantization_config`` sets the weight
bytes. A preset is read when it is first asked for (:class:`fragsim.catalog.Presets`).

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
    jamba-mini-1.5       28 Mamba-1 + 4 full (8 × 128)             16,384 B + state
    nemotron-h-8b        24 Mamba-2 + 4 full (8 × 128)             16,384 B + state
    nemotron-h-56b       54 Mamba-2 + 10 full (8 × 128)            40,960 B + state

(Per-token figures count every layer that holds KV, on one GPU, before windows.)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

FILES = Path(__file__).resolve().parent / "model_configs"

_HF = "huggingface.co/{}/blob/main/config.json"

#: preset → hub id of its published config.json, bundled as ``model_configs/PRESET.json``
PUBLISHED: dict[str, str] = {
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen3-32b": "Qwen/Qwen3-32B",
    "mistral-7b-v0.1": "mistralai/Mistral-7B-v0.1",
    "gemma-3-27b": "google/gemma-3-27b-it",
    "gpt-oss-20b": "openai/gpt-oss-20b",
    "gpt-oss-120b": "openai/gpt-oss-120b",
    "llama-4-scout": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "nemotron-h-56b": "nvidia/Nemotron-H-56B-Base-8K",
}

# preset → (the published config.json's fields that memory depends on, source), for the
# presets whose file is not bundled
COPIED: dict[str, tuple[dict[str, Any], str]] = {
    "gemma-2-9b": ({
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584,
        "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 256, "sliding_window": 4096, "vocab_size": 256000,
        "max_position_embeddings": 8192, "torch_dtype": "float32",
    }, _HF.format("google/gemma-2-9b")),
    "qwen3-next-80b-a3b": ({
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
        "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "vocab_size": 151936, "max_position_embeddings": 262144,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }, _HF.format("Qwen/Qwen3-Next-80B-A3B-Instruct")),
    "jamba-mini-1.5": ({
        "architectures": ["JambaForCausalLM"], "model_type": "jamba", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "attn_layer_period": 8, "attn_layer_offset": 4,
        "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 16,
        "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 256,
        "vocab_size": 65536, "max_position_embeddings": 262144, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }, _HF.format("ai21labs/AI21-Jamba-Mini-1.5")),
    "nemotron-h-8b": ({
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 4096,
        "intermediate_size": 21504, "num_hidden_layers": 52, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 128,
        "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
        "expand": 2, "hybrid_override_pattern":
            "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "vocab_size": 131072, "max_position_embeddings": 8192,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }, _HF.format("nvidia/Nemotron-H-8B-Base-8K")),
}

#: the order presets are listed in
ORDER = ["llama-3.1-8b", "llama-3.1-70b", "qwen3-8b", "qwen3-32b", "mistral-7b-v0.1",
         "gemma-2-9b", "gemma-3-27b", "gpt-oss-20b", "gpt-oss-120b", "llama-4-scout",
         "deepseek-v3", "qwen3-next-80b-a3b", "jamba-mini-1.5", "nemotron-h-8b", "nemotron-h-56b"]


def preset_readers() -> dict[str, Callable[[], Any]]:
    """preset → a function that reads it (a ModelConfig), in :data:`ORDER`."""
    from fragsim.hfconfig import model_from_hf, read_hf_config

    def published(name: str) -> Callable[[], Any]:
        return lambda: read_hf_config(FILES / f"{name}.json", name=name,
                                      source=_HF.format(PUBLISHED[name]))

    def copied(name: str) -> Callable[[], Any]:
        raw, source = COPIED[name]
        return lambda: model_from_hf(raw, f"preset {name!r}", name=name, source=source)

    return {name: published(name) if name in PUBLISHED else copied(name) for name in ORDER}
