"""What a request holds in vLLM 0.33's state (Mamba, Gated DeltaNet) groups, by family.

The expected figures follow vLLM 0.33.0's rules, read in its source, not fragsim's
output:

- ``MambaSpec.max_memory_usage_bytes`` (v1/kv_cache_interface.py): a request needs
  ``2 + num_speculative_blocks + num_prefill_checkpoint_blocks`` pages in "align"
  mode (prefix caching on) and ``1 + num_speculative_blocks`` in "none" mode;
- ``num_prefill_checkpoint_blocks``: 1 from ``MambaMixer2.get_kv_cache_spec``
  (Nemotron-H, Falcon-H1), 1 from Gated DeltaNet's when its prefill runs FlashInfer's
  kernel (sm90; sm100/sm120 with 128-dim keys), else 0; Mamba-1's mixer keeps the
  default 0 (layers/mamba/abstract.py);
- ``get_max_concurrency_for_kv_cache_config`` (v1/core/kv_cache_utils.py):
  ``num_blocks / Σ_groups cdiv(max_memory_usage_bytes, page_size_bytes)``, and the
  "GPU KV cache size" log is ``int(that × max_model_len)`` tokens.

The Nemotron-H-56B case is the one a vLLM 0.33 server logs on one H200:
``GPU KV cache size: 156,057 tokens, Maximum concurrency for 8,192 tokens per
request: 19.05x`` (``benchmarks/vllm_crosscheck.py --from-config`` reproduces it from
the config.json with vLLM's own model classes).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from fragsim.catalog import GPUS, MODELS, get_model
from fragsim.presets import FILES
from fragsim.vllm_plan import plan_vllm

H200, B200, A100 = GPUS["h200-141gb"], GPUS["b200"], GPUS["a100-80gb"]
TEN_GIB = 10 * 2**30
NEMOTRON_H_56B = FILES / "nemotron-h-56b.json"          # the published file, a preset

# Falcon-H1's layout (attention and a Mamba-2 mixer side by side in each of 36 layers)
# with Falcon-H1-0.5B's dimensions; the rule does not depend on the sizes.
FALCON_H1 = {
    "architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1", "hidden_size": 1024,
    "intermediate_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "mamba_d_conv": 4, "mamba_d_head": 64,
    "mamba_d_ssm": 1536, "mamba_d_state": 128, "mamba_expand": 2, "mamba_n_groups": 1,
    "mamba_n_heads": 24, "max_position_embeddings": 16384, "vocab_size": 32784,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def test_nemotron_h_56b_on_one_h200_as_vllm_logs_it():
    """54 Mamba-2 + 10 attention layers in 4,128-token blocks: 6 state groups of 9 and
    one attention group of 10. With prefix caching each state group needs 2 + 1
    (checkpoint) blocks and the attention group ceil(8,192 / 4,128) = 2: 20 a request."""
    model = get_model(str(NEMOTRON_H_56B))
    probe = plan_vllm(model, H200, 0, max_model_len=8192)
    p = plan_vllm(model, H200, 381 * probe.bytes_per_block, max_model_len=8192)
    assert (p.block_size, p.num_gpu_blocks, p.num_prefill_checkpoint_blocks) == (4_128, 381, 1)
    assert p.blocks_per_request == 6 * (2 + 1) + 2 == 20
    assert p.max_concurrency == 381 / 20 == 19.05
    assert p.kv_cache_tokens == 156_057                  # int(19.05 × 8,192)
    off = plan_vllm(model, H200, 381 * probe.bytes_per_block, max_model_len=8192, prefix_caching=False)
    assert off.blocks_per_request == 6 * 1 + 2 and off.kv_cache_tokens == 390_144   # 47.625x


def test_mamba2_checkpoint_leaves_the_block_size_alone():
    """The Mamba-2 mixer exports its checkpoint at any token (alignment 1): Nemotron-H-8B
    keeps its 1,040-token blocks, and a request needs 6 × 3 + ceil(131,072 / 1,040)."""
    p = plan_vllm(MODELS["nemotron-h-8b"], H200, TEN_GIB, max_model_len=131072)
    assert p.block_size == 1_040 and p.num_prefill_checkpoint_blocks == 1
    assert p.blocks_per_request == 6 * 3 + 127
    assert p.max_concurrency == 630 / 145


def test_jamba_mamba1_asks_for_no_checkpoint():
    p = plan_vllm(MODELS["jamba-mini-1.5"], H200, TEN_GIB, max_model_len=131072)
    assert p.block_size == 80 and p.num_prefill_checkpoint_blocks == 0
    assert p.blocks_per_request == 7 * 2 + 1_639           # ceil(131,072 / 80)
    off = plan_vllm(MODELS["jamba-mini-1.5"], H200, TEN_GIB, max_model_len=131072, prefix_caching=False)
    assert off.blocks_per_request == 7 * 1 + 1_639


@pytest.mark.parametrize(("gpu", "block_size", "checkpoint"), [
    (H200, 576, 1),     # FlashInfer prefill on sm90: lcm(16, 64) = 64-token steps
    (B200, 576, 1),     # sm100 with 128-dim keys: FlashInfer too
    (A100, 544, 0),     # Triton's prefill: no checkpoint, 16-token steps
])
def test_gdn_checkpoint_follows_its_prefill_kernel(gpu, block_size, checkpoint):
    p = plan_vllm(MODELS["qwen3-next-80b-a3b"], gpu, TEN_GIB, max_model_len=131072)
    assert (p.block_size, p.num_prefill_checkpoint_blocks) == (block_size, checkpoint)
    assert p.blocks_per_request == 3 * (2 + checkpoint) + -(-131072 // block_size)


def test_falcon_h1_every_layer_hybrid(tmp_path):
    """36 attention + 36 Mamba-2 layers: one group each. Attention 2 × 2 × 64 × 2 =
    512 B a token; state 3 × (1,536 + 2 × 128) × 2 + 24 × 64 × 128 × 2 = 403,968 B →
    16 × ceil(403,968 / (16 × 512)) = 800-token blocks."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(FALCON_H1))
    model = get_model(str(path))
    on = plan_vllm(model, H200, TEN_GIB, max_model_len=16384)
    assert on.block_size == 800 and [g.num_layers for g in on.groups] == [36, 36]
    assert on.blocks_per_request == (2 + 1) + 21           # ceil(16,384 / 800) = 21
    off = plan_vllm(model, H200, TEN_GIB, max_model_len=16384, prefix_caching=False)
    assert off.blocks_per_request == 1 + 21


def test_a_prompt_step_holds_the_checkpoint_block():
    """``allocate_slots`` for a whole prompt of L tokens in align mode: the running
    state's block, and the checkpoint block at the last boundary before L once L passes
    one block (``MambaManager.get_num_blocks_to_allocate``); the decode step after it
    holds 1 (2 at a boundary). Attention groups hold every block of the prompt."""
    p = plan_vllm(MODELS["nemotron-h-8b"], H200, TEN_GIB, max_model_len=131072)
    assert p.blocks_at_prompt(1040) == [1] * 6 + [1]
    assert p.blocks_at_prompt(1041) == [2] * 6 + [2]
    assert p.blocks_at_prompt(4096) == [2] * 6 + [4]
    assert p.blocks_per_seq(4096) == [1] * 6 + [4]
    jamba = plan_vllm(MODELS["jamba-mini-1.5"], H200, TEN_GIB, max_model_len=131072)
    assert jamba.blocks_at_prompt(4096) == [1] * 7 + [52]
    off = plan_vllm(MODELS["nemotron-h-8b"], H200, TEN_GIB, max_model_len=131072, prefix_caching=False)
    assert off.blocks_at_prompt(4096) == [1] * 6 + [4]
    gpt = plan_vllm(MODELS["gpt-oss-20b"], H200, TEN_GIB, max_model_len=131072)
    assert gpt.blocks_at_prompt(1000) == [63, 63]            # the window drops blocks only later
    assert np.array_equal(gpt.blocks_per_seq(1000), [9, 63])
