"""Capacity arithmetic: the seed documents' cases to the byte, the vLLM paper's
OPT-13B check, and the ``fragsim capacity`` command."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fragsim.capacity import kv_budget_slots, plan_capacity
from fragsim.catalog import GPUS, MODELS, activation_peak_bytes
from fragsim.cli import main
from fragsim.errors import FragsimError

A100_40, A100_80 = GPUS["a100-40gb"], GPUS["a100-80gb"]


@pytest.mark.parametrize(
    ("model", "batch", "max_seq_len", "static_kv_bytes"),
    [
        # Seed 004 §3.1.1. 2 × 40 × 32 × 2048 × 40 × 128 × 2 = 53.7 GB; the seed's
        # first result, 536,870,912,000 B "≈ 500 GB", has one factor of 10 too many.
        ("llama-2-13b", 32, 2048, 53_687_091_200),
        ("llama-2-7b", 16, 1024, 8_589_934_592),     # §3.1.3: "≈ 8.6 GB/卡"
        ("llama-2-7b", 48, 1024, 25_769_803_776),    # §3.1.3: "25.8GB/卡"
        ("llama-2-13b", 8, 2048, 13_421_772_800),    # §3.3.3: "≈ 13.4 GB/卡"
    ],
)
def test_seed_static_reservations(model, batch, max_seq_len, static_kv_bytes):
    report = plan_capacity(MODELS[model], A100_80, batch=batch, max_seq_len=max_seq_len)
    assert report.static_kv_bytes == static_kv_bytes
    assert report.static_kv_bytes_per_gpu == static_kv_bytes
    assert report.static_formula.endswith(f"= {static_kv_bytes:,} B")


def test_seed_static_utilization_and_per_request_kv():
    report = plan_capacity(MODELS["llama-2-7b"], A100_80, batch=16, max_seq_len=1024, avg_len=180)
    assert report.static_utilization == 180 / 1024 == 0.17578125   # "17.6%"
    assert report.static_used_bytes == 16 * 180 * 524_288
    # §3.3.3: one 2048-token 13B request needs "约 1.7GB" of KV.
    assert plan_capacity(MODELS["llama-2-13b"], A100_80, max_seq_len=2048).kv_bytes_per_seq == (
        1_677_721_600
    )


def _profile_budget(r):
    """vLLM's identity: requested − weights − activations − non-torch − graphs (where
    the release subtracts them)."""
    graphs = r.cuda_graph_bytes if r.cuda_graph_subtracted else 0
    return r.usable_memory_bytes - r.weight_bytes_per_gpu - r.activation_bytes - r.non_torch_bytes - graphs


def test_opt_13b_on_a100_40gb_matches_the_vllm_paper():
    """Table 1 of the vLLM paper: 12 GB of KV, 15.7K slots. fragsim run's pool (the
    paper's arithmetic, no CUDA graphs, no sampler) gives 15,486."""
    assert kv_budget_slots(MODELS["opt-13b"], A100_40) == 15_486
    assert 15_486 == pytest.approx(15_700, rel=0.02)
    r = plan_capacity(MODELS["opt-13b"], A100_40)
    assert r.max_seq_len == 2048 and r.max_num_batched_tokens == 2048 and r.max_num_seqs == 256
    # 92% (vLLM 0.33's default) of CUDA's 39.39 GiB (40 GiB on nvidia-smi), rounded up
    assert r.gpu_memory_utilization == 0.92
    assert r.usable_memory_bytes == -(-40335 * 2**20 * 92 // 100)
    # 12,853,473,280 parameters × 2 B, and 32 rows of vocabulary padding (50,272 → 50,304)
    assert r.weight_bytes_per_gpu == 25_706_946_560 + 32 * 5120 * 2
    assert r.kv_budget_bytes == _profile_budget(r)
    assert r.kv_slots == r.kv_budget_bytes // 819_200
    assert r.num_blocks == r.kv_slots // 16
    assert r.max_concurrency == r.kv_slots / 2048
    # today's vLLM (0.33) also sets aside its CUDA graphs; 0.19 did not
    old = plan_capacity(MODELS["opt-13b"], A100_40, vllm_version="0.19", gpu_memory_utilization=0.92)
    assert not old.cuda_graph_subtracted and r.cuda_graph_subtracted
    assert old.kv_budget_bytes - r.kv_budget_bytes == r.cuda_graph_bytes > 0


def test_tensor_parallel_splits_weights_and_kv_heads():
    model = MODELS["llama-2-70b"]
    r = plan_capacity(model, A100_80, tp=4, batch=8, max_seq_len=4096)
    assert r.kv_bytes_per_token_per_gpu == 327_680 // 4
    # everything but the norms (replicated) and the 32,000-row vocabulary splits 4 ways
    norms = (2 * 80 + 1) * 8192 * 2
    assert r.weight_bytes_per_gpu == (137_953_296_384 - norms) // 4 + norms + 4096 * 128 * 2
    assert r.non_torch_bytes > plan_capacity(model, A100_80, tp=8).non_torch_bytes - 2**30
    assert r.kv_budget_bytes == _profile_budget(r)
    assert r.kv_slots == r.kv_budget_bytes // 81_920
    assert r.static_kv_bytes == 8 * 4096 * 327_680
    assert r.static_kv_bytes_per_gpu == 8 * 4096 * 81_920
    replicated = plan_capacity(model, A100_80, tp=16)
    assert replicated.num_kv_heads_per_gpu == 1
    assert any("replicated" in note for note in replicated.notes)


def test_no_room_for_kv():
    r = plan_capacity(MODELS["opt-175b"], A100_40)
    assert r.kv_budget_bytes < 0
    assert (r.kv_slots, r.num_blocks, r.max_concurrency, r.static_max_batch) == (0, 0, 0.0, 0)
    assert "no KV cache fits" in r.notes[0]
    with pytest.raises(FragsimError, match=r"no room for the KV cache of opt-175b on a100-40gb"):
        kv_budget_slots(MODELS["opt-175b"], A100_40)


def test_options_change_the_budget_as_stated():
    model = MODELS["llama-2-7b"]
    given = plan_capacity(model, A100_80, activation_bytes=2 * 10**9, gpu_memory_utilization=1)
    assert not given.activation_estimated and given.activation_bytes == 2 * 10**9
    assert given.usable_memory_bytes == A100_80.driver_total_bytes == 81050 * 2**20  # 79.15 GiB
    assert given.kv_budget_bytes == _profile_budget(given)
    bigger = plan_capacity(model, A100_80, max_num_batched_tokens=8192)
    assert bigger.activation_bytes > plan_capacity(model, A100_80).activation_bytes
    r = plan_capacity(model, A100_80, block_size=32, avg_len=180)
    assert r.max_seq_len == 4096                      # model default
    assert r.num_blocks == r.kv_slots // 32
    assert r.paged_concurrency_at_avg_len == r.num_blocks // 6   # ceil(180 / 32) blocks
    static = plan_capacity(model, A100_40, batch=64, max_seq_len=4096)
    assert static.static_fits is False and "static reservation needs" in static.notes[0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpu_memory_utilization": 0}, r"gpu_memory_utilization \(--gpu-memory-utilization\) must be in \(0, 1\], got 0"),
        ({"gpu_memory_utilization": 1.5}, r"must be in \(0, 1\], got 1.5"),
        ({"tp": 0}, r"tp \(--tp\) must be an integer >= 1, got 0"),
        ({"block_size": 0}, r"block_size \(--block-size\) must be an integer >= 1, got 0"),
        ({"max_seq_len": 0}, r"max_seq_len \(--max-seq-len\) must be an integer >= 1, got 0"),
        ({"batch": 0}, r"batch \(--batch\) must be an integer >= 1, got 0"),
        ({"avg_len": 0}, r"avg_len \(--avg-len\) must be in \(0, 4096\], got 0"),
        ({"max_num_batched_tokens": 0}, r"max_num_batched_tokens \(--max-num-batched-tokens\) must be"),
        ({"activation_bytes": -1}, r"activation_bytes \(--activation-bytes\) must be an integer >= 0"),
    ],
)
def test_bad_options_name_the_option_and_range(kwargs, message):
    with pytest.raises(FragsimError, match=message):
        plan_capacity(MODELS["llama-2-7b"], A100_80, **kwargs)


def test_cli_json(capsys):
    code = main(["capacity", "--model", "llama-2-13b", "--gpu", "a100-80gb", "--batch", "32",
                 "--max-seq-len", "2048", "--avg-len", "680", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["static_kv_bytes"] == 53_687_091_200
    assert data["kv_bytes_per_token"] == 819_200
    for key in ("kv_budget_bytes", "kv_slots", "num_blocks", "max_concurrency", "notes"):
        assert key in data
    assert data["num_blocks"] == data["kv_slots"] // 16
    assert data["static_utilization"] == 680 / 2048


def test_cli_json_without_batch_has_null_static(capsys):
    assert main(["capacity", "--model", "OPT-13B", "--gpu", "a100-40gb", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["static_kv_bytes"] is None and data["static_fits"] is None
    assert data["kv_slots"] == plan_capacity(MODELS["opt-13b"], A100_40).kv_slots
    for key in ("weight_bytes_per_gpu", "activation_peak_bytes", "non_torch_bytes",
                "cuda_graph_bytes", "kv_cache_memory_bytes"):
        assert isinstance(data[key], int)
    assert data["kv_cache_memory_bytes"] == data["kv_budget_bytes"]


def test_cli_table_and_list(capsys):
    assert main(["capacity", "--model", "llama-2-7b", "--gpu", "a100-80gb", "--batch", "16",
                 "--max-seq-len", "1024", "--avg-len", "180"]) == 0
    out = capsys.readouterr().out
    assert "8,589,934,592 B" in out and "8.59 GB" in out and "8.00 GiB" in out
    assert "17.6%" in out
    assert main(["capacity", "--list"]) == 0
    out = capsys.readouterr().out
    assert "llama-2-70b" in out and "h200-141gb" in out and "819,200 B" in out
    assert main(["capacity", "--list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["models"]["opt-13b"]["kv_bytes_per_token"] == 819_200
    assert data["gpus"]["a100-40gb"]["memory_bytes"] == 40 * 2**30
    assert data["gpus"]["a100-40gb"]["driver_total_bytes"] == 40335 * 2**20
    assert data["gpus"]["h100-80gb"]["driver_total_bytes"] == 81091 * 2**20


def test_capacity_starts_from_the_driver_total_and_run_from_nvidia_smis():
    """vLLM's budget starts from CUDA's total (79.19 GiB on an H100), not nvidia-smi's
    81,559 MiB; fragsim run's pool keeps nvidia-smi's so its references stay put."""
    model, h100 = MODELS["llama-3-8b"], GPUS["h100-80gb"]
    r = plan_capacity(model, h100, max_num_batched_tokens=2048)
    assert r.gpu_memory_bytes == 81091 * 2**20 and r.gpu_memory_from_driver
    # vLLM's requested memory rounds up: ceil(total × 0.92), 0.33's default utilization
    assert r.usable_memory_bytes == -(-81091 * 2**20 * 92 // 100) == 78_227_670_303
    # 0.19's default was 0.9
    old = plan_capacity(model, h100, max_num_batched_tokens=2048, vllm_version="0.19")
    assert old.gpu_memory_utilization == 0.9 and old.usable_memory_bytes == 76_527_068_775
    assert r.kv_budget_bytes == _profile_budget(r)
    run_slots = kv_budget_slots(model, h100)
    assert run_slots == (81559 * 2**20 * 9 // 10 - 16_060_522_496
                         - activation_peak_bytes(model, 2048)) // 131_072
    unknown = dataclasses.replace(A100_80, driver_total_bytes=None)  # a catalog's card
    a100 = plan_capacity(model, unknown)
    assert a100.gpu_memory_bytes == 80 * 2**30 and not a100.gpu_memory_from_driver


def test_capacity_table_names_which_total_it_starts_from(capsys, tmp_path):
    assert main(["capacity", "--model", "llama-3-8b", "--gpu", "rtx-3090", "--max-seq-len",
                 "8192"]) == 0
    out = capsys.readouterr().out
    assert "GPU memory (driver total)" in out and "23.58 GiB" in out
    # A catalog's card with a memory size of its own has no driver total: nvidia-smi's.
    catalog = tmp_path / "cards.toml"
    catalog.write_text('[gpus.a10g-custom]\nbase = "a10g"\nmemory_bytes = 24146509824\n')
    assert main(["capacity", "--model", "llama-3-8b", "--gpu", "a10g-custom", "--catalog", str(catalog),
                 "--max-seq-len", "8192"]) == 0
    assert "GPU memory (nvidia-smi)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "opt-13b", "--gpu", "a100-40gb", "--gpu-memory-utilization", "1.5"],
         "--gpu-memory-utilization) must be in (0, 1], got 1.5"),
        (["--model", "opt-13b", "--gpu", "a100-40gb", "--tp", "0"], "(--tp) must be an integer >= 1"),
        (["--model", "opt-13b", "--gpu", "a100-40gb", "--block-size", "0"], "(--block-size)"),
        (["--model", "gpt-5", "--gpu", "a100-40gb"], "unknown model 'gpt-5' (--model); known: "),
        (["--gpu", "a100-40gb"], "--model is required"),
        (["--model", "opt-13b", "--gpu", "l4", "--catalog", "missing.toml"], "cannot read catalog"),
    ],
)
def test_cli_errors_exit_2_with_one_line(capsys, argv, message):
    assert main(["capacity", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("fragsim: error: ") and message in captured.err


def test_longer_than_the_model_context_is_noted_not_refused():
    r = plan_capacity(MODELS["llama-2-7b"], A100_80, max_seq_len=16384, batch=1)
    assert r.static_kv_bytes == 16384 * MODELS["llama-2-7b"].kv_bytes_per_token
    assert any("exceeds llama-2-7b's context of 4,096" in n for n in r.notes)


def test_capacity_without_gpu_uses_the_run_default(capsys):
    from fragsim.catalog import DEFAULT_GPU

    assert main(["capacity", "--model", "llama-3.1-8b", "--json"]) == 0
    without = json.loads(capsys.readouterr().out)
    assert main(["capacity", "--model", "llama-3.1-8b", "--gpu", DEFAULT_GPU, "--json"]) == 0
    assert without == json.loads(capsys.readouterr().out) and without["gpu"] == "h100-80gb"
