"""vLLM's hybrid KV cache plan: groups, pages, block counts, concurrency and the
blocks a sequence holds.

The expected figures of the five worked cases were produced by vLLM 0.33.0's own
planning code (``get_kv_cache_groups``, ``get_kv_cache_configs``,
``get_max_concurrency_for_kv_cache_config``) and its ``KVCacheManager.allocate_slots``
driven by hand on the same layer specs, 10 GiB of KV memory, max_model_len 131,072
and 8,192 batched tokens with async scheduling (16,384 in flight). vLLM is not a
dependency: the numbers are written down here.
"""

from __future__ import annotations

import json

import pytest

from fragsim.catalog import GPUS, MODELS, with_kv_cache_dtype
from fragsim.cli import main
from fragsim.errors import FragsimError
from fragsim.vllm_plan import default_max_num_batched_tokens, plan_vllm

H200, B200, A100 = GPUS["h200-141gb"], GPUS["b200"], GPUS["a100-80gb"]
TEN_GIB = 10 * 2**30


def plan(model: str, **kwargs):
    options = {"max_model_len": 131072, "max_num_batched_tokens": 8192, **kwargs}
    return plan_vllm(MODELS[model], H200, TEN_GIB, **options)


def groups(p):
    return [(g.kind, g.num_layers, g.num_padding_layers) for g in p.groups]


def test_gpt_oss_two_groups_of_eighteen():
    p = plan("gpt-oss-120b")
    assert groups(p) == [("sliding", 18, 0), ("full", 18, 0)]
    assert (p.block_size, p.page_size_bytes, p.bytes_per_block) == (16, 32_768, 589_824)
    assert p.num_gpu_blocks == 18_204
    # sliding: ceil((127 + 16384) / 16) + 1 = 1,033; full: 131072 / 16 = 8,192
    assert p.blocks_per_request == 1_033 + 8_192
    assert p.max_concurrency == pytest.approx(1.9733333333333334, rel=1e-12)
    expected = {1: [1, 1], 127: [8, 8], 128: [9, 9], 129: [9, 9], 1000: [9, 63], 4096: [9, 257]}
    assert {n: p.blocks_per_seq(n) for n in expected} == expected


def test_gemma3_padding_groups():
    """52 sliding + 10 full: groups of 10, the sliding ones 9,9,9,9,8,8 (8 phantom layers)."""
    p = plan("gemma-3-27b")
    assert groups(p) == [("sliding", 9, 1)] * 4 + [("sliding", 8, 2)] * 2 + [("full", 10, 0)]
    # every 6th sliding layer (layers[i::6] of the 52), as vLLM names them
    assert p.groups[0].layers == (0, 7, 14, 21, 28, 36, 43, 50, 57)
    assert p.bytes_per_block == 10 * 131_072
    assert p.padding_bytes_per_block == 8 * 131_072
    assert p.num_gpu_blocks == 8_192
    assert p.max_concurrency == pytest.approx(0.5562949884557925, rel=1e-12)
    assert p.blocks_per_seq(4096) == [65] * 6 + [257]
    assert p.blocks_per_seq(1000) == [63] * 7
    assert any("refuse to start" in n for n in p.notes)          # 18 GiB for one request


def test_mla_latent_whole_on_every_rank():
    p = plan("deepseek-v3", tp=8, block_size=64)
    assert groups(p) == [("mla", 61, 0)]
    assert p.page_size_bytes == 64 * 576 * 2 == 73_728
    assert p.num_gpu_blocks == 2_387
    assert p.max_concurrency == pytest.approx(1.16552734375, rel=1e-12)
    assert [p.blocks_per_seq(n) for n in (1, 127, 128, 1000, 4096)] == [[1], [2], [3], [16], [65]]


def test_mla_block_size_follows_the_backend():
    model = MODELS["deepseek-v3"]
    assert plan_vllm(model, H200, TEN_GIB, tp=8).block_size == 16              # FlashAttention MLA
    fp8 = with_kv_cache_dtype(model, "fp8")
    p = plan_vllm(fp8, H200, TEN_GIB, tp=8)
    assert (p.block_size, p.page_size_bytes) == (64, 64 * 576)             # FlashMLA, 1 B a value
    assert plan_vllm(model, B200, TEN_GIB, tp=8).block_size == 32              # FlashInfer MLA


def test_nemotron_h_blocks_inflate_for_the_state():
    """Mamba-2 state: conv (3, 8192 + 2·8·128) bf16 + ssm (128, 64, 128) fp32 = 4,255,744 B;
    attention 4,096 B a token, so 16 × ceil(4,255,744 / 65,536) = 1,040-token blocks."""
    p = plan("nemotron-h-8b")
    assert p.block_size == p.mamba_block_size == 1_040
    assert p.page_size_bytes == 1_040 * 4_096 == 4_259_840
    assert groups(p) == [("mamba", 4, 0)] * 6 + [("full", 4, 0)]
    assert p.padding_bytes_per_block == 24 * (4_259_840 - 4_255_744)
    assert p.num_gpu_blocks == 630
    # 6 Mamba-2 groups × (2 + 1 prefill checkpoint) + ceil(131,072 / 1,040): 145 a request
    # (the old 139 came from vLLM fed fragsim's specs, which left the checkpoint out)
    assert p.max_concurrency == pytest.approx(630 / 145, rel=1e-12)
    held = {1: [1] * 6 + [1], 1039: [1] * 6 + [1], 1040: [2] * 6 + [2], 1041: [1] * 6 + [2],
            2080: [2] * 6 + [3], 4096: [1] * 6 + [4]}
    assert {n: p.blocks_per_seq(n) for n in held} == held


def test_no_prefix_caching_gives_state_one_whole_sequence_block():
    p = plan("nemotron-h-8b", prefix_caching=False)
    assert p.mamba_block_size == 131_072 and p.block_size == 1_040
    assert p.blocks_per_request == 6 + 127
    assert p.blocks_per_seq(1040) == [1] * 6 + [2]


def test_chunked_local_with_the_hybrid_manager_kept_on():
    model = with_kv_cache_dtype(MODELS["llama-4-scout"], "fp8")
    p = plan_vllm(model, H200, TEN_GIB, max_model_len=131072, max_num_batched_tokens=8192,
                  hybrid_manager=True)
    assert groups(p) == [("chunked", 12, 0)] * 3 + [("full", 12, 0)]
    assert p.bytes_per_block == 393_216 and p.num_gpu_blocks == 27_306
    assert p.max_concurrency == pytest.approx(2.13328125, rel=1e-12)
    held = {1: [1, 1, 1, 1], 8191: [512] * 4, 8192: [1, 1, 1, 513], 10000: [114, 114, 114, 626]}
    assert {n: p.blocks_per_seq(n) for n in held} == held


def test_chunked_local_keeps_the_hybrid_manager_as_vllm_033_does():
    # VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE defaults to 1 in vLLM 0.33
    p = plan("llama-4-scout")
    assert p.hybrid_manager and ("chunked", 12, 0) in groups(p) and not p.notes
    off = plan_vllm(MODELS["llama-4-scout"], H200, TEN_GIB, max_model_len=131072,
                    chunked_hybrid=False)
    assert groups(off) == [("full", 48, 0)] and not off.hybrid_manager
    assert any("--no-hybrid-chunked" in n for n in off.notes)
    # the switch is for chunked local attention only
    assert plan_vllm(MODELS["gpt-oss-20b"], H200, TEN_GIB, chunked_hybrid=False).hybrid_manager


def test_qwen3_next_gdn_checkpoints_align_blocks_to_64():
    """GDN state: conv (3, 2·16·128 + 32·128) + ssm (32, 128, 128), bf16 = 1,097,728 B; an
    attention token 2,048 B; lcm(16, 64) = 64 → 64 × ceil(1,097,728 / 131,072) = 576."""
    p = plan("qwen3-next-80b-a3b")
    assert p.block_size == 576 and p.num_prefill_checkpoint_blocks == 1
    assert groups(p) == [("linear", 12, 0)] * 3 + [("full", 12, 0)]
    assert p.blocks_per_request == 3 * 3 + 131072 // 576 + 1
    a100 = plan_vllm(MODELS["qwen3-next-80b-a3b"], A100, TEN_GIB)
    assert a100.block_size == 16 * -(-1_097_728 // (16 * 2_048)) and a100.num_prefill_checkpoint_blocks == 0


def test_dense_models_are_one_group_of_every_layer():
    p = plan_vllm(MODELS["opt-13b"], GPUS["a100-40gb"], 12_686_565_376, max_model_len=2048)
    assert groups(p) == [("full", 40, 0)]
    assert p.num_gpu_blocks == 12_686_565_376 // (16 * 819_200) == 967
    assert p.max_concurrency == 967 / 128


def test_default_token_budget_by_card():
    assert [default_max_num_batched_tokens(GPUS[g]) for g in
            ("a100-80gb", "h100-80gb", "h200-141gb", "b200", "mi300x", "l4")] == [
        2048, 8192, 8192, 16384, 16384, 2048]


def test_bad_seq_len_and_memory_are_named():
    p = plan("gpt-oss-20b")
    with pytest.raises(FragsimError, match=r"seq_len \(--seq-len\) must be an integer >= 1"):
        p.blocks_per_seq(0)
    with pytest.raises(FragsimError, match=r"kv_cache_memory_bytes \(--kv-cache-memory-bytes\)"):
        plan_vllm(MODELS["gpt-oss-20b"], H200, -1)


JSON_KEYS = ("num_gpu_blocks", "block_size", "kv_cache_groups", "page_size_bytes",
             "max_concurrency", "blocks_per_seq", "bytes_per_token_by_kind",
             "state_bytes_per_seq", "naive_num_gpu_blocks")


def test_capacity_json_carries_the_plan(capsys):
    assert main(["capacity", "--model", "gpt-oss-120b", "--gpu", "h200-141gb", "--max-seq-len",
                 "131072", "--kv-cache-memory-bytes", str(TEN_GIB), "--max-num-batched-tokens",
                 "8192", "--seq-len", "4096", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    for key in JSON_KEYS:
        assert key in d
    assert d["num_gpu_blocks"] == 18_204 and d["block_size"] == 16
    assert [(g["kind"], g["num_layers"], g["num_padding_layers"], g["sliding_window"])
            for g in d["kv_cache_groups"]] == [("sliding", 18, 0, 128), ("full", 18, 0, None)]
    assert d["blocks_per_seq"] == [{"kind": "sliding", "blocks": 9}, {"kind": "full", "blocks": 257}]
    assert d["bytes_per_token_by_kind"] == {"sliding": 36_864, "full": 36_864}
    assert d["state_bytes_per_seq"] == 0
    assert d["naive_num_gpu_blocks"] == TEN_GIB // (16 * 73_728) == 9_102
    assert d["max_concurrency"] == pytest.approx(1.9733333333333334)


def test_capacity_table_for_a_state_model(capsys):
    assert main(["capacity", "--model", "jamba-mini-1.5", "--gpu", "h100-80gb", "--seq-len",
                 "1000", "--no-prefix-caching"]) == 0
    out = capsys.readouterr().out
    assert "vLLM's KV cache groups" in out and "prefix caching off" in out
    assert "mamba (mamba1)" in out and "state per sequence" in out
    assert "naive: every layer full attention" in out


def test_kv_cache_dtype_fp8_halves_bytes_and_names_bad_values(capsys):
    assert main(["capacity", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--json",
                 "--kv-cache-dtype", "fp8"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kv_bytes_per_token"] == 131_072 // 2 and d["kv_cache_dtype"] == "fp8"
    assert main(["capacity", "--model", "llama-3.1-8b", "--gpu", "h100-80gb",
                 "--kv-cache-dtype", "int3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kv_cache_dtype (--kv-cache-dtype) must be one of" in err


def test_hybrid_run_says_it_treats_every_layer_as_full(capsys):
    code = main(["run", "--model", "gpt-oss-20b", "--gpu", "h100-80gb", "--allocator", "vllm",
                 "--num-requests", "30", "--no-save", "--json"])
    assert code == 0
    err = capsys.readouterr().err
    assert "this run treats every layer as full attention" in err
    assert "49,152 B per token" in err and "vLLM's hybrid manager would fit" in err
