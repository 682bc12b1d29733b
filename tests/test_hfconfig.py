"""Models from config.json: layer kinds per family, state shapes, dtypes, and one-line
errors for malformed files. The configs here are written by the tests (trimmed to
the fields that matter); nothing is fetched."""

from __future__ import annotations

import json

import pytest

from fragsim.catalog import MODELS, get_model
from fragsim.cli import main
from fragsim.errors import FragsimError
from fragsim.hfconfig import read_hf_config
from fragsim.layers import LayerSpec, StateShape, mla


def write(tmp_path, raw, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return path


def kinds(model):
    return [layer.kind for layer in model.layer_specs]


LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
         "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
         "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
         "tie_word_embeddings": True, "torch_dtype": "bfloat16"}


def test_dense_llama_from_a_folder_matches_its_parameter_count(tmp_path):
    write(tmp_path, LLAMA)
    m = read_hf_config(tmp_path)                      # the folder, not the file
    assert kinds(m) == ["full"] * 16 and not m.is_hybrid
    assert m.kv_bytes_per_token == 2 * 16 * 8 * 64 * 2
    assert m.num_params == 1_235_814_400              # Llama-3.2-1B's published count
    assert get_model(str(tmp_path / "config.json")).num_params == m.num_params


def test_mistral_sliding_everywhere_qwen_sliding_switched_off(tmp_path):
    mistral = {**LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    assert kinds(read_hf_config(write(tmp_path, mistral))) == ["sliding"] * 16
    qwen = {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32768,
            "use_sliding_window": False}
    assert kinds(read_hf_config(write(tmp_path, qwen))) == ["full"] * 16


def test_layer_types_and_gemma_patterns(tmp_path):
    g2 = {**LLAMA, "architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 6,
          "sliding_window": 4096, "torch_dtype": "float32"}
    m = read_hf_config(write(tmp_path, g2))
    assert kinds(m) == ["sliding", "full"] * 3 and m.dtype_bytes == 2   # fp32 served in 16 bits
    g3 = {"architectures": ["Gemma3ForConditionalGeneration"],
          "text_config": {**LLAMA, "num_hidden_layers": 12, "sliding_window": 512,
                          "sliding_window_pattern": 6}}
    assert kinds(read_hf_config(write(tmp_path, g3))) == (["sliding"] * 5 + ["full"]) * 2
    oss = {**LLAMA, "architectures": ["GptOssForCausalLM"], "num_hidden_layers": 4,
           "sliding_window": 128, "layer_types": ["full_attention", "sliding_attention"] * 2}
    m = read_hf_config(write(tmp_path, oss))
    assert kinds(m) == ["full", "sliding"] * 2 and m.layer_specs[1].window == 128


def test_llama4_chunked_from_no_rope_layers(tmp_path):
    raw = {"architectures": ["Llama4ForConditionalGeneration"],
           "text_config": {**LLAMA, "num_hidden_layers": 8, "attention_chunk_size": 8192,
                           "no_rope_layers": [1, 1, 1, 0] * 2, "num_local_experts": 16,
                           "intermediate_size_mlp": 16384}}
    m = read_hf_config(write(tmp_path, raw))
    assert kinds(m) == (["chunked"] * 3 + ["full"]) * 2 and m.layer_specs[0].chunk == 8192


def test_deepseek_mla_and_fp8_weights(tmp_path):
    raw = {"architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048,
           "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
           "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None,
           "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2,
           "first_k_dense_replace": 1, "vocab_size": 102400, "torch_dtype": "bfloat16",
           "quantization_config": {"quant_method": "fp8"}}
    m = read_hf_config(write(tmp_path, raw))
    assert m.layer_specs == (mla(512, 64),) * 27
    assert m.layer_specs[0].bytes_per_token(2, tp=8) == 576 * 2          # whole on every rank
    assert m.weight_bytes == m.num_params                                 # one byte a weight
    assert 15.0e9 < m.num_params < 16.5e9                                 # DeepSeek-V2-Lite: 15.7B


def test_state_layers_and_their_shapes(tmp_path):
    nemotron = MODELS["nemotron-h-8b"]
    mamba = [la for la in nemotron.layer_specs if la.kind == "mamba"]
    assert len(mamba) == 24 and nemotron.num_attention_layers == 4
    conv, ssm = mamba[0].state.tensors(2)
    assert conv == ((3, 8192 + 2 * 8 * 128), 2) and ssm == ((128, 64, 128), 4)   # fp32 SSM
    assert mamba[0].state_bytes(2) == 4_255_744
    assert mamba[0].state_bytes(2, tp=2) == 3 * 5120 * 2 + 64 * 64 * 128 * 4
    gdn = StateShape("gdn", conv_kernel=4, num_heads=16, head_dim=128, num_v_heads=32, v_head_dim=128)
    assert gdn.shapes() == ((3, 8192), (32, 128, 128))
    jamba = MODELS["jamba-mini-1.5"]
    assert kinds(jamba)[:9] == ["mamba"] * 4 + ["full"] + ["mamba"] * 4
    assert jamba.layer_specs[0].state.shapes() == ((8192, 3), (8192, 16))
    falcon = {**LLAMA, "architectures": ["FalconH1ForCausalLM"], "num_hidden_layers": 3,
              "mamba_n_heads": 24, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 128,
              "mamba_d_conv": 4, "mamba_expand": 2, "mamba_d_ssm": 1536}
    m = read_hf_config(write(tmp_path, falcon))
    assert kinds(m) == ["full", "mamba"] * 3            # attention and Mamba-2 in every layer
    assert m.layer_specs[1].state.shapes(tp=2) == ((3, (1536 + 2 * 2 * 128) // 2), (12, 64, 128))
    bamba = {**falcon, "architectures": ["BambaForCausalLM"], "num_hidden_layers": 4,
             "attn_layer_indices": [2], "mamba_n_heads": 64, "mamba_d_ssm": None}
    assert kinds(read_hf_config(write(tmp_path, bamba))) == ["mamba", "mamba", "full", "mamba"]


def test_shared_kv_layers_hold_nothing():
    layer = LayerSpec("shared", target=0)
    assert layer.bytes_per_token(2) == 0 and layer.state_bytes(2) == 0
    with pytest.raises(ValueError, match="shared layer must name an earlier attention"):
        from fragsim.layers import check_layers
        check_layers((LayerSpec("shared", target=0),))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON (line 1, column 2)"),
        ("[1, 2]", "must hold a JSON object, got list"),
        (json.dumps({"hidden_size": 1}), "missing field 'architectures'"),
        # neither transformers nor fragsim knows it, and it has none of the standard fields
        (json.dumps({"architectures": ["FooBarForCausalLM"]}),
         "missing field 'num_hidden_layers' (needed for FooBarForCausalLM)"),
        (json.dumps({**LLAMA, "architectures": ["FooBarForCausalLM"], "layer_types": ["x"] * 16}),
         "layer_types[0] is 'x'"),
        # what transformers' config class refuses, in its words, naming the field
        (json.dumps({**LLAMA, "num_hidden_layers": None}),
         "Field 'num_hidden_layers' expected int, got NoneType"),
        (json.dumps({**LLAMA, "num_attention_heads": "32"}),
         "Field 'num_attention_heads' expected int, got str"),
        (json.dumps({**LLAMA, "layer_types": ["full_attention"] * 15}),
         "`num_hidden_layers` (16) must be equal to the number of `layer_types` (15)"),
        (json.dumps({**LLAMA, "layer_types": ["full_attention"] * 15 + ["local"]}),
         "The `layer_types` entries must be in"),
        (json.dumps({**LLAMA, "architectures": ["Qwen3NextForCausalLM"], "linear_num_key_heads": 0}),
         "field 'linear_num_key_heads' must be an integer >= 1, got 0"),
        (json.dumps({**LLAMA, "architectures": ["MambaForCausalLM"], "model_type": "mamba"}),
         "MambaForCausalLM has state (linear-attention or Mamba) layers, whose state shape"),
        (json.dumps({**LLAMA, "torch_dtype": "int4"}), "field 'torch_dtype' must be one of"),
        (json.dumps({**LLAMA, "num_key_value_heads": 5}), '"num_kv_heads" must divide'),
    ],
)
def test_malformed_configs_get_one_line_naming_the_field(tmp_path, capsys, text, message):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(FragsimError) as info:
        read_hf_config(path)
    assert message in str(info.value) and str(path) in str(info.value)
    assert main(["capacity", "--model", str(path), "--gpu", "h100-80gb"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_missing_file_is_named(capsys):
    assert main(["capacity", "--model", "nowhere/config.json", "--gpu", "h100-80gb"]) == 2
    assert "cannot read model config 'nowhere/config.json'" in capsys.readouterr().err
    # a hub id: nothing is fetched, and the error says how to get the file
    assert main(["capacity", "--model", "google/gemma-3-27b-it"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "huggingface-cli download google/gemma-3-27b-it config.json" in err


def test_dense_presets_keep_their_bytes_and_new_presets_cite_configs():
    assert {m: MODELS[m].kv_bytes_per_token for m in ("opt-13b", "llama-2-7b", "qwen2.5-7b")} == {
        "opt-13b": 819_200, "llama-2-7b": 524_288, "qwen2.5-7b": 57_344}
    assert MODELS["llama-3.1-8b"].num_params == 8_030_261_248
    assert MODELS["qwen3-8b"].num_params == 8_190_735_360
    assert MODELS["qwen3-32b"].num_params == 32_762_123_264
    for name in ("gpt-oss-120b", "gemma-3-27b", "deepseek-v3", "qwen3-next-80b-a3b",
                 "jamba-mini-1.5", "nemotron-h-8b", "llama-4-scout", "mistral-7b-v0.1"):
        assert MODELS[name].is_hybrid and "config.json" in MODELS[name].source
    assert 60e9 < MODELS["gpt-oss-120b"].weight_bytes < 70e9          # MXFP4 experts
