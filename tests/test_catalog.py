"""The model/GPU catalog: preset numbers, validation, custom TOML catalogs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fragsim.catalog import (
    GPUS,
    MODELS,
    ModelConfig,
    activation_peak_bytes,
    get_gpu,
    get_model,
    load_catalog,
)
from fragsim.errors import FragsimError

EXAMPLE_CATALOG = Path(__file__).resolve().parents[1] / "experiments" / "catalog_example.toml"


def llama_params(m: ModelConfig, *, tied: bool = False, qkv_bias: bool = False) -> int:
    """Llama-family count: embeddings (+ untied LM head), per layer Q/K/V/O, SwiGLU
    gate/up/down and two RMSNorms, and the final norm."""
    h, qkv = m.hidden_size, (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    layer = h * qkv + m.num_heads * m.head_dim * h + 3 * h * m.intermediate_size + 2 * h
    layer += qkv if qkv_bias else 0
    return m.vocab_size * h * (1 if tied else 2) + m.num_layers * layer + h


def opt_params(m: ModelConfig) -> int:
    """OPT count: tied embeddings, 2048 + 2 learned positions, biased Q/K/V/O and
    fc1/fc2, two LayerNorms (weight + bias) per layer, and the final LayerNorm."""
    h, f = m.hidden_size, m.intermediate_size
    layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
    return m.vocab_size * h + (m.max_position_embeddings + 2) * h + m.num_layers * layer + 2 * h


@pytest.mark.parametrize(
    ("name", "derive"),
    [
        ("opt-13b", opt_params),
        ("opt-66b", opt_params),
        ("opt-175b", opt_params),
        ("llama-2-7b", llama_params),
        ("llama-2-13b", llama_params),
        ("llama-2-70b", llama_params),
        ("llama-3-8b", llama_params),
        ("llama-3-70b", llama_params),
        ("mistral-7b", llama_params),
        ("qwen2.5-7b", lambda m: llama_params(m, qkv_bias=True)),
    ],
)
def test_preset_param_count_matches_architecture(name, derive):
    model = MODELS[name]
    assert model.num_params == derive(model)
    assert model.num_heads * model.head_dim == model.hidden_size


def test_presets_are_the_promised_ones_and_cite_a_source():
    assert {"opt-13b", "opt-66b", "opt-175b", "llama-2-7b", "llama-2-13b", "llama-2-70b",
            "llama-3-8b", "llama-3-70b", "mistral-7b", "qwen2.5-7b"} <= set(MODELS)
    assert {"a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "l4", "rtx-4090"} <= set(GPUS)
    for key, config in [*MODELS.items(), *GPUS.items()]:
        assert key == config.name
        assert config.source


@pytest.mark.parametrize(
    ("name", "kv_bytes", "params"),
    [
        ("opt-13b", 819_200, 12_853_473_280),        # 2 × 40 × 40 × 128 × 2, 800 KiB
        ("llama-2-7b", 524_288, 6_738_415_616),      # 2 × 32 × 32 × 128 × 2
        ("llama-2-13b", 819_200, 13_015_864_320),
        ("llama-2-70b", 327_680, 68_976_648_192),    # GQA: 8 of 64 heads cached
        ("llama-3-8b", 131_072, 8_030_261_248),
        ("qwen2.5-7b", 57_344, 7_615_616_512),       # 2 × 28 × 4 × 128 × 2
    ],
)
def test_kv_bytes_per_token_and_weights(name, kv_bytes, params):
    model = MODELS[name]
    assert model.kv_bytes_per_token == kv_bytes
    assert model.weight_bytes == 2 * params


def test_gpu_memory_is_what_the_device_reports():
    assert GPUS["a100-40gb"].memory_bytes == 40 * 2**30
    assert GPUS["a100-80gb"].memory_bytes == 80 * 2**30
    assert GPUS["h100-80gb"].memory_bytes == 81559 * 2**20


@pytest.mark.parametrize(
    ("name", "smi_mib", "driver_gib", "bandwidth", "flops", "pcie", "arch"),
    [
        # nvidia-smi's memory.total; CUDA's total as published logs print it, to 0.01 GiB
        ("h100-80gb", 81559, 79.19, 3.35e12, 989.4e12, 64e9, "sm90"),
        ("l40s", 46068, 44.31, 864e9, 362.05e12, 32e9, "sm89"),
        ("rtx-3090", 24576, 23.58, 936e9, 71e12, 32e9, "sm86"),
        ("a10g", 23028, 22.19, 600e9, 70e12, 32e9, "sm86"),
        ("rtx-5090", 32607, 31.36, 1792e9, 209.5e12, 64e9, "sm120"),
        ("a100-80gb", 81920, 79.15, 2039e9, 312e12, 32e9, "sm80"),
        ("a100-40gb", 40960, 39.39, 1555e9, 312e12, 32e9, "sm80"),
        ("h200-141gb", 143771, 139.80, 4.8e12, 989.4e12, 64e9, "sm90"),
        ("l4", 23034, 22.03, 300e9, 121e12, 32e9, "sm89"),
        ("rtx-4090", 24564, 23.64, 1008e9, 165.2e12, 32e9, "sm89"),
        ("b200", 183359, 178.35, 8e12, 2.25e15, 64e9, "sm100"),
        ("mi300x", 196608, 191.98, 5.3e12, 1307.4e12, 64e9, "gfx942"),
    ],
)
def test_gpu_presets_carry_both_totals(name, smi_mib, driver_gib, bandwidth, flops, pcie, arch):
    gpu = GPUS[name]
    assert gpu.memory_bytes == smi_mib * 2**20
    assert (gpu.hbm_bandwidth, gpu.fp16_flops, gpu.pcie_bandwidth, gpu.arch) == (
        bandwidth, flops, pcie, arch)
    assert round(gpu.driver_total_bytes / 2**30, 2) == driver_gib
    assert gpu.startup_total_bytes == gpu.driver_total_bytes < gpu.memory_bytes
    assert f"{driver_gib:.2f} GiB" in gpu.source


def test_driver_total_may_not_exceed_nvidia_smis():
    with pytest.raises(ValueError, match=r'"driver_total_bytes" must be in \[1, 24152899584\]'):
        dataclasses.replace(GPUS["l4"], driver_total_bytes=GPUS["l4"].memory_bytes + 1)


def test_lookup_is_case_insensitive_and_unknown_names_list_the_known_ones():
    assert get_model(" OPT-13B ") is MODELS["opt-13b"]
    assert get_gpu("A100-40GB") is GPUS["a100-40gb"]
    with pytest.raises(FragsimError, match=r"unknown model 'gpt-5' \(--model\); known: .*llama-2-7b"):
        get_model("gpt-5")
    with pytest.raises(FragsimError, match=r"unknown GPU 'tpu' \(--gpu\); known: .*h100-80gb"):
        get_gpu("tpu")


def test_presets_are_read_only():
    with pytest.raises(TypeError):
        MODELS["mine"] = MODELS["opt-13b"]  # type: ignore[index]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("name", "", r'"name" must be a non-empty string'),
        ("num_layers", 0, r'"num_layers" must be >= 1, got 0'),
        ("num_heads", -4, r'"num_heads" must be >= 1'),
        ("num_kv_heads", 64, r'"num_kv_heads" must be in \[1, 32\], got 64'),
        ("num_kv_heads", 3, r'"num_kv_heads" must divide "num_heads" \(32\), got 3'),
        ("head_dim", 12.5, r'"head_dim" must be an integer, got 12.5'),
        ("hidden_size", True, r'"hidden_size" must be an integer'),
        ("intermediate_size", 0, r'"intermediate_size" must be >= 1'),
        ("vocab_size", 0, r'"vocab_size" must be >= 1'),
        ("num_params", 0, r'"num_params" must be >= 1'),
        ("dtype_bytes", 3, r'"dtype_bytes" must be 1 \(fp8\), 2 \(fp16/bf16\) or 4 \(fp32\), got 3'),
        ("max_position_embeddings", 0, r'"max_position_embeddings" must be >= 1'),
        ("gated_mlp", "yes", r'"gated_mlp" must be true or false'),
    ],
)
def test_bad_model_values_name_the_field_and_the_range(field, value, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(MODELS["llama-2-7b"], **{field: value})


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("memory_bytes", 0, r'"memory_bytes" must be >= 1'),
        ("memory_bytes", 4.0e10, r'"memory_bytes" must be an integer'),
        ("hbm_bandwidth", 0.0, r'"hbm_bandwidth" must be a finite number > 0'),
        ("fp16_flops", float("inf"), r'"fp16_flops" must be a finite number > 0'),
        ("pcie_bandwidth", -1, r'"pcie_bandwidth" must be a finite number > 0'),
    ],
)
def test_bad_gpu_values_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(GPUS["l4"], **{field: value})


@pytest.mark.parametrize(
    ("name", "tp", "heads"),
    [
        ("llama-2-70b", 1, 8),
        ("llama-2-70b", 4, 2),
        ("llama-2-70b", 8, 1),
        ("llama-2-70b", 16, 1),   # more GPUs than KV heads: one replicated head each
        ("opt-66b", 8, 9),
    ],
)
def test_kv_heads_per_gpu(name, tp, heads):
    model = MODELS[name]
    assert model.kv_heads_per_gpu(tp) == heads
    assert model.kv_bytes_per_token_per_gpu(tp) == 2 * model.num_layers * heads * 128 * 2


@pytest.mark.parametrize(
    ("name", "tp", "message"),
    [
        ("llama-2-70b", 0, r"tp \(--tp\) must be an integer >= 1, got 0"),
        ("llama-2-70b", 3, r"tp \(--tp\) must divide llama-2-70b's 64 attention heads, got 3"),
        ("qwen2.5-7b", 8, r"must divide qwen2.5-7b's 28 attention heads"),
        ("opt-66b", 16, r"must divide opt-66b's 72 attention heads, got 16"),
    ],
)
def test_tp_that_does_not_split_the_heads_is_refused(name, tp, message):
    with pytest.raises(FragsimError, match=message):
        MODELS[name].kv_heads_per_gpu(tp)


def test_tp_that_does_not_split_the_kv_heads_is_refused():
    # No preset hits these: their query and KV head counts share their divisors.
    model = dataclasses.replace(MODELS["llama-2-7b"], name="odd", num_heads=24, num_kv_heads=6)
    assert model.kv_heads_per_gpu(3) == 2
    with pytest.raises(FragsimError, match=r"must divide odd's 6 KV heads, got 4"):
        model.kv_heads_per_gpu(4)
    assert model.kv_heads_per_gpu(12) == 1
    with pytest.raises(FragsimError, match=r"above odd's 6 KV heads must be a multiple of it.*got 8"):
        model.kv_heads_per_gpu(8)


def test_flops():
    model = MODELS["llama-2-7b"]
    assert model.flops_per_token() == 2 * 6_738_415_616
    assert model.attention_flops(1000) == 4 * 32 * 32 * 128 * 1000


def test_activation_peak_worked_example():
    # OPT-13B, 2048 tokens: the MLP phase dominates (fc1 output + ReLU output),
    # (2 × 5120 + 2 × 20480) × 2 B = 102,400 B per token, plus fp32 logits for 256 rows.
    assert activation_peak_bytes(MODELS["opt-13b"], 2048) == 2048 * 102_400 + 256 * 50272 * 4
    # Llama-2-7B, 16 tokens: gated MLP (3 × 11008), logits for every token.
    assert activation_peak_bytes(MODELS["llama-2-7b"], 16) == (
        16 * (2 * 4096 + 3 * 11008) * 2 + 16 * 32000 * 4
    )
    # tp shards the MLP and the heads but not the residual stream or the logits.
    assert activation_peak_bytes(MODELS["llama-2-70b"], 100, tp=8) == (
        100 * (2 * 8192 + 3 * 28672 // 8) * 2 + 100 * 32000 * 4
    )
    with pytest.raises(FragsimError, match=r"--max-num-batched-tokens\) must be an integer >= 1"):
        activation_peak_bytes(MODELS["opt-13b"], 0)


def test_example_catalog_loads():
    models, gpus = load_catalog(EXAMPLE_CATALOG)
    fp8 = models["llama-2-7b-fp8"]
    assert fp8.kv_bytes_per_token == 524_288 // 2
    assert fp8.num_params == MODELS["llama-2-7b"].num_params
    small = models["llama-3.2-1b"]
    assert small.num_params == llama_params(small, tied=True)
    assert small.kv_bytes_per_token == 2 * 16 * 8 * 64 * 2
    assert gpus["a100-80gb-pcie"].hbm_bandwidth == 1.935e12
    assert get_model("LLAMA-3.2-1B", catalog=EXAMPLE_CATALOG) == small
    assert get_gpu("a100-80gb-pcie", catalog=str(EXAMPLE_CATALOG)) == gpus["a100-80gb-pcie"]
    assert get_model("opt-13b", catalog=EXAMPLE_CATALOG) is MODELS["opt-13b"]


GOOD_MODEL = """
[models.tiny]
num_layers = 2
num_heads = 4
num_kv_heads = 2
head_dim = 16
hidden_size = 64
intermediate_size = 256
vocab_size = 1000
num_params = 200000
"""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (GOOD_MODEL + "num_layer = 3\n", r"\[models.tiny\]: unknown key 'num_layer'; allowed: base, num_layers"),
        (GOOD_MODEL.replace("num_layers = 2", 'num_layers = "2"'),
         r"\[models.tiny\]: key 'num_layers' must be int, got '2'"),
        (GOOD_MODEL.replace("num_kv_heads = 2", "num_kv_heads = 3"),
         r'\[models.tiny\]: "num_kv_heads" must divide "num_heads" \(4\), got 3'),
        (GOOD_MODEL.replace("vocab_size = 1000\n", ""),
         r"\[models.tiny\]: missing key\(s\) vocab_size"),
        ('[models.mine]\nbase = "gpt-9"\n', r"\[models.mine\]: key 'base' must name a preset"),
        ('[models.OPT-13B]\nbase = "opt-13b"\n', r"\[models.opt-13b\]: name clashes with a preset"),
        ('[gpus.fast]\nmemory_bytes = 1024\nhbm_bandwidth = 1e12\nfp16_flops = 1e14\n',
         r"\[gpus.fast\]: missing key\(s\) pcie_bandwidth"),
        ('[gpus.fast]\nbase = "l4"\nhbm_bandwidth = 0\n',
         r'\[gpus.fast\]: "hbm_bandwidth" must be a finite number > 0'),
        ("[gpu.fast]\n", r"unknown table\(s\) gpu; allowed: models, gpus"),
        ("models = 3\n", r"'models' must be a table"),
        ("[models.x\n", r"is not valid TOML"),
    ],
)
def test_catalog_errors_name_the_table_and_key(tmp_path, text, message):
    path = tmp_path / "catalog.toml"
    path.write_text(text)
    with pytest.raises(FragsimError, match=message):
        load_catalog(path)


def test_catalog_base_overrides_and_missing_file(tmp_path):
    path = tmp_path / "catalog.toml"
    path.write_text('[models.long-opt]\nbase = "opt-13b"\nmax_position_embeddings = 8192\n'
                    + GOOD_MODEL)
    models, gpus = load_catalog(path)
    assert models["long-opt"] == dataclasses.replace(
        MODELS["opt-13b"], name="long-opt", max_position_embeddings=8192
    )
    assert models["tiny"].dtype_bytes == 2 and models["tiny"].gated_mlp
    assert gpus == {}
    # A new memory size drops the preset's driver total, which was measured for its own.
    path.write_text('[gpus.h100-half]\nbase = "h100-80gb"\nmemory_bytes = 42949672960\n'
                    '[gpus.h100-same]\nbase = "h100-80gb"\nhbm_bandwidth = 3e12\n')
    gpus = load_catalog(path)[1]
    assert gpus["h100-half"].driver_total_bytes is None
    assert gpus["h100-half"].startup_total_bytes == 40 * 2**30
    assert gpus["h100-same"].driver_total_bytes == GPUS["h100-80gb"].driver_total_bytes
    with pytest.raises(FragsimError, match=r"cannot read catalog .*nope.toml"):
        load_catalog(tmp_path / "nope.toml")
