"""vLLM's start-up memory profile, term by term (fragsim.vllm_memory, fragsim.weights)
and the log it prints (fragsim.vllm_log, ``fragsim capacity --from-log``)."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest

from fragsim.catalog import GPUS, MODELS
from fragsim.cli import main
from fragsim.errors import FragsimError
from fragsim.hfconfig import model_from_hf
from fragsim.vllm_log import read_log
from fragsim.vllm_memory import (
    capture_sizes,
    check_release,
    default_max_num_seqs,
    nearest_release,
    predicted_log,
    startup_profile,
)
from fragsim.weights import WeightGroup, format_of, group_bytes_per_rank, weight_bytes_per_rank

GiB = 1 << 30
H100 = GPUS["h100-80gb"]
LOG = Path(__file__).parent / "fixtures" / "vllm_logs" / "llama-3.1-8b-tp2-h100-v0.19.log"


def test_llama_weights_per_rank_are_the_checkpoint_and_the_rotary_cache():
    """8,030,261,248 bf16 parameters and a 131,072 × 128 bf16 cos/sin cache: vLLM logs
    'Model loading took 14.99 GiB' (14.9888 in 0.6's four decimals)."""
    m = MODELS["llama-3.1-8b"]
    assert weight_bytes_per_rank(m, 1) == 8_030_261_248 * 2 + 131_072 * 128 * 2
    assert round(weight_bytes_per_rank(m, 1) / GiB, 4) == 14.9888
    # tp 2: everything splits but the norms, the rotary cache (replicated)
    norms = (2 * 32 + 1) * 4096 * 2
    assert weight_bytes_per_rank(m, 2) == (8_030_261_248 * 2 - norms) // 2 + norms + 131_072 * 128 * 2


def test_vocabulary_rows_pad_to_64_per_rank_and_kv_heads_replicate():
    vocab = WeightGroup("embed_tokens", 50_272 * 10, "vocab", rows=50_272)
    assert group_bytes_per_rank(vocab, 1, 2, Fraction(1)) == 50_304 * 10 * 2
    assert group_bytes_per_rank(vocab, 8, 2, Fraction(1)) == 50_304 // 8 * 10 * 2
    kv = WeightGroup("attention.kv", 1000, "kv")
    # 8 KV heads at tp 16: each rank keeps one whole head, 1/8 of them
    assert group_bytes_per_rank(kv, 16, 2, Fraction(1, 8)) == 250


@pytest.mark.parametrize(
    ("quant", "per_param"),
    [
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, 1 + Fraction(4, 128 * 128)),
        ({"quant_method": "fp8"}, Fraction(1)),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
         Fraction(1, 2) + Fraction(2, 128) + Fraction(4, 8 * 128)),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True},
         Fraction(1, 2) + Fraction(2, 128)),
        ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
            "num_bits": 8, "type": "float", "strategy": "channel"}}}}, 1 + Fraction(4, 4096)),
        ({"quant_method": "mxfp4"}, Fraction(17, 32)),
    ],
)
def test_quantization_formats_price_a_parameter(quant, per_param):
    assert format_of({"quantization_config": quant}, "config.json", 4096).linear == per_param


def test_unknown_quantization_is_refused_by_name():
    with pytest.raises(FragsimError, match=r"config.json: quantization_config quant_method 'eetq'"):
        format_of({"quantization_config": {"quant_method": "eetq"}}, "config.json", 4096)


def test_quantized_checkpoint_keeps_embeddings_and_norms_in_the_model_dtype():
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
           "torch_dtype": "bfloat16", "tie_word_embeddings": False,
           "quantization_config": {"quant_method": "compressed-tensors", "ignore": ["lm_head"],
                                   "config_groups": {"group_0": {"weights": {
                                       "num_bits": 8, "type": "float", "strategy": "channel"}}}}}
    m = model_from_hf(raw, "config.json", name="llama-fp8", source="test")
    dense = model_from_hf({k: v for k, v in raw.items() if k != "quantization_config"},
                          "config.json", name="llama", source="test")
    by_name = {g.name: g for g in m.weights}
    assert by_name["embed_tokens"].bytes_per_param is None and by_name["norms"].bytes_per_param is None
    assert by_name["mlp"].bytes_per_param == 1 + Fraction(4, 4096)
    saved = weight_bytes_per_rank(dense, 1) - weight_bytes_per_rank(m, 1)
    linear = by_name["mlp"].params + by_name["attention"].params + by_name["attention.kv"].params
    assert saved == pytest.approx(linear * (1 - Fraction(4, 4096)), abs=4)


def test_profile_terms_add_up_and_name_the_release():
    p = startup_profile(MODELS["llama-3.1-8b"], H100, gpu_memory_utilization=0.95,
                        max_num_batched_tokens=8192, vllm_version="0.19")
    assert p.max_num_seqs == 1024 == default_max_num_seqs(H100)
    assert p.activation_peak_bytes > p.sampler_peak_bytes > p.forward_peak_bytes
    assert p.kv_cache_memory_bytes == (p.requested_bytes - p.weight_bytes - p.activation_peak_bytes
                                       - p.non_torch_bytes)
    new = startup_profile(MODELS["llama-3.1-8b"], H100, gpu_memory_utilization=0.95,
                          max_num_batched_tokens=8192, vllm_version="0.33")
    assert new.cuda_graph_subtracted and new.kv_cache_memory_bytes == (
        new.requested_bytes - new.weight_bytes - new.activation_peak_bytes - new.non_torch_bytes
        - new.cuda_graph_bytes)
    assert new.sampler_peak_bytes < p.sampler_peak_bytes     # one fp32 copy, not three
    eager = startup_profile(MODELS["llama-3.1-8b"], H100, max_num_batched_tokens=8192,
                            enforce_eager=True)
    assert eager.cuda_graph_bytes == 0 and not eager.cuda_graph_subtracted
    # the sampler's share grows with the rows it samples, the forward's with the tokens
    fewer = startup_profile(MODELS["llama-3.1-8b"], H100, max_num_seqs=256,
                            max_num_batched_tokens=8192)
    assert fewer.sampler_peak_bytes < new.sampler_peak_bytes
    assert fewer.forward_peak_bytes == new.forward_peak_bytes
    assert startup_profile(MODELS["llama-3.1-8b"], H100, max_num_batched_tokens=16384,
                           tp=2).non_torch_bytes > new.non_torch_bytes


def test_releases_and_capture_sizes():
    assert check_release("v0.19.1").name == "0.19" and check_release("0.33").name == "0.33"
    with pytest.raises(FragsimError, match=r"vllm_version \(--vllm-version\) must be one of 0.19, 0.33"):
        check_release("0.5")
    assert nearest_release("0.10.1.1") == "0.19" and nearest_release("0.24.0") == "0.33"
    assert len(capture_sizes(1024)) == 51 and capture_sizes(1024)[-1] == 512
    assert capture_sizes(4) == [1, 2, 4, 8]


def test_log_reader_takes_the_figures_and_settings_of_a_start_up():
    logged = read_log(LOG.read_text())
    assert (logged.weights_gib, logged.activation_gib, logged.non_torch_gib) == (7.51, 1.89, 2.07)
    assert (logged.kv_cache_gib, logged.kv_cache_tokens, logged.concurrency) == (63.76, 1_044_688, 127.53)
    assert (logged.total_gib, logged.cuda_graph_gib) == (79.19, 0.76)
    s = logged.settings
    assert (s["vllm_version"], s["tensor_parallel_size"], s["gpu_memory_utilization"]) == ("0.19.0", 2, 0.95)
    assert s["max_model_len"] == 8192
    old = read_log("Loading model weights took 14.9888 GB\nMemory profiling results: "
                   "total_gpu_memory=23.58GiB initial_memory_usage=15.34GiB "
                   "peak_torch_memory=17.06GiB non_torch_memory=0.35GiB kv_cache_size=3.81GiB "
                   "gpu_memory_utilization=0.90\n# GPU blocks: 1952, # CPU blocks: 2048")
    assert (old.weights_gib, old.total_gib, old.non_torch_gib, old.kv_cache_gib,
            old.num_gpu_blocks) == (14.9888, 23.58, 0.35, 3.81, 1952)


def test_from_log_compares_term_by_term(capsys):
    assert main(["capacity", "--from-log", str(LOG), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "llama-3.1-8b" and data["tp"] == 2 and data["vllm_version"] == "0.19"
    assert data["gpu_memory_utilization"] == 0.95 and data["max_seq_len"] == 8192
    assert data["kv_cache_tokens"] == data["num_gpu_blocks"] * 16    # one group: blocks × 16
    checks = data["from_log"]["checks"]
    assert len(checks) == 1 and "consistent" in checks[0] and "NOT" not in checks[0]
    assert main(["capacity", "--from-log", str(LOG)]) == 0
    out = capsys.readouterr().out
    assert "fragsim against" in out and "available KV cache memory" in out
    assert "Available KV cache memory:" in out and "GPU KV cache size:" in out


def test_predicted_log_uses_vllms_rounding(capsys):
    assert main(["capacity", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--tp", "2",
                 "--gpu-memory-utilization", "0.95", "--max-seq-len", "8192",
                 "--vllm-version", "0.19"]) == 0
    out = capsys.readouterr().out
    assert "Model loading took 7.51 GiB memory" in out
    assert "GPU KV cache size: " in out and "Maximum concurrency for 8,192 tokens per request" in out


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("INFO nothing to see\n", "not a vLLM start-up log: no 'Available KV cache memory'"),
        ("Available KV cache memory: 10.0 GiB\n", "the log's model is not named; give --model"),
    ],
)
def test_bad_or_partial_logs_get_one_line(tmp_path, capsys, text, message):
    log = tmp_path / "start.log"
    log.write_text(text)
    assert main(["capacity", "--from-log", str(log)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_missing_log_file_is_named(capsys):
    assert main(["capacity", "--from-log", "no-such.log", "--model", "llama-3.1-8b"]) == 2
    assert "cannot read log 'no-such.log'" in capsys.readouterr().err


def test_predicted_log_lines_follow_each_release():
    from fragsim.capacity import plan_capacity

    for version, joined in (("0.19", False), ("0.33", True)):
        r = plan_capacity(MODELS["qwen3-8b"], H100, max_seq_len=8192, vllm_version=version)
        lines = predicted_log(r, r.vllm)
        size = [x for x in lines if x.startswith("GPU KV cache size")]
        assert len(size) == 1 and ("Maximum concurrency" in size[0]) == joined


def test_online_fp8_quantization_halves_the_linear_layers(capsys):
    base = ["capacity", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--json"]
    assert main(base) == 0
    bf16 = json.loads(capsys.readouterr().out)["weight_bytes_per_gpu"]
    assert main([*base, "--quantization", "fp8"]) == 0
    fp8 = json.loads(capsys.readouterr().out)["weight_bytes_per_gpu"]
    # vLLM 0.19 logged 8.49 GiB for Llama-3.1-8B with --quantization fp8 (14.99 without)
    assert round(fp8 / GiB, 2) == 8.49 and bf16 > fp8
    assert main([*base, "--quantization", "awq"]) == 2
    assert "quantization (--quantization) must be fp8" in capsys.readouterr().err
