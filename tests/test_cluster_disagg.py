"""Prefill/decode disaggregation with KV transfer (fragsim.cluster.disagg)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fragsim.errors import FragsimError
from fragsim.simulate import RunSpec, load_workload, simulate
from fragsim.simulate_spec import _model_gpu
from fragsim.traces import Trace

STEP = 0.02      # fixed cost model: every step lasts this long
BLOCK = 16


def spec(**kw: object) -> RunSpec:
    base: dict[str, object] = dict(model="llama-3.1-8b", gpu="h100-80gb", cost_model="fixed",
                                   step_time_s=STEP, max_seq_len=4096, instances=2,
                                   prefill_instances=1, decode_instances=1,
                                   kv_transfer_bandwidth_gbps=10.0, kv_transfer_latency_ms=2.0)
    base.update(kw)
    return RunSpec(**base)  # type: ignore[arg-type]


def trace(arrival: list[float], prompt: list[int], output: list[int], **kw: object) -> Trace:
    return Trace("pd", "test", np.array(arrival), np.array(prompt), np.array(output), **kw)  # type: ignore[arg-type]


def token_bytes(run: RunSpec) -> int:
    model, _ = _model_gpu(run)
    return int(model.kv_bytes_per_token_per_gpu(run.tp))


def seconds(run: RunSpec, tokens: int) -> float:
    """Link time of ``tokens`` tokens' whole blocks."""
    moved = -(-tokens // BLOCK) * BLOCK
    return moved * token_bytes(run) / (run.kv_transfer_bandwidth_gbps * 1e9)


def test_one_request_by_hand() -> None:
    """TTFT = prefill + latency + bytes / bandwidth + first step, and the prefill side
    holds its copy exactly until the transfer lands."""
    run = spec()
    result = simulate(trace([0.0], [1000], [5]), "vllm", run, check=True)
    row = result.requests.iloc[0]
    link = seconds(run, 1000)
    assert row["ttft_s"] == pytest.approx(STEP + 0.002 + link + STEP, abs=1e-12)
    assert row["tpot_s"] == pytest.approx(STEP)
    assert (row["instance"], row["prefill_instance"]) == (1, 0)
    s = result.summary
    assert s["kv_transfer_bytes"] == row["kv_transfer_bytes"] == 1008 * token_bytes(run)
    assert s["mean_kv_transfer_s"] == pytest.approx(link)
    assert row["kv_transfer_s"] == pytest.approx(0.002 + link)  # reserved at the prefill's end
    assert (s["num_disaggregated"], s["num_kv_transfers"], s["num_finished"], s["num_requests"]) == (1, 1, 1, 1)
    prefill, decode = s["instances"]
    assert (prefill["role"], decode["role"]) == ("prefill", "decode")
    # The prefill side stores prompt + its one token, held from its end to the landing.
    held = prefill["mean_kv_sending_slots"] * prefill["sim_time_s"]
    assert held == pytest.approx(1001 * (0.002 + link), rel=1e-9)
    # The decode side reserved the prompt's blocks from the prefill's end to the landing.
    assert s["mean_kv_receiving_slots"] * s["sim_time_s"] == pytest.approx(1000 * (0.002 + link), rel=1e-9)


def test_transfers_that_share_a_port_queue_for_it() -> None:
    run = spec()
    result = simulate(trace([0.0, 0.0], [500, 500], [3, 3]), "vllm", run, check=True)
    link = seconds(run, 500)
    waits = sorted(result.requests["kv_transfer_s"])
    assert waits == pytest.approx([0.002 + link, 0.002 + 2 * link])


def test_a_decode_side_prefix_hit_is_not_moved() -> None:
    """The second request shares the first's prompt: its decode instance holds all but
    the last block, and only the rest crosses the link."""
    run = spec(prefix_caching=True)
    hashes = [(7, 8)] * 2  # two 512-token content blocks, the same in both prompts
    result = simulate(trace([0.0, 5.0], [1000, 1000], [4, 4], block_hashes=hashes, block_hash_size=512),
                      "vllm", run, check=True)
    first, second = result.requests["kv_transfer_bytes"]
    hit = 999 // BLOCK * BLOCK  # the decode side's own hit: every full block but the last token's
    assert first == 1008 * token_bytes(run)
    assert second == (1008 - hit) * token_bytes(run)


def test_a_request_the_decode_side_refuses_frees_the_prefill_copy() -> None:
    """prompt + 1 fits a pool, prompt + output does not: the prefill runs, the decode
    instance refuses it, and the prefill side frees its copy unread."""
    run = spec(kv_slots=1200)
    result = simulate(trace([0.0, 0.1], [1000, 100], [500, 4]), "vllm", run, check=True)
    rows = result.requests.set_index("request_id")
    assert rows.loc[0, "status"] == "refused" and rows.loc[0, "refused_reason"] == "too_large"
    assert rows.loc[1, "status"] == "finished"
    s = result.summary
    assert (s["num_kv_dropped"], s["num_kv_transfers"], s["num_finished"]) == (1, 1, 1)


@pytest.mark.parametrize("router", ["round-robin", "least-loaded"])
def test_a_loaded_cluster_keeps_its_split_at_every_step(router: str) -> None:
    """Small pools, so that requests are preempted, also while their KV is on the way."""
    run = RunSpec(trace="azure-conv", num_requests=300, model="llama-3.1-8b", gpu="a100-40gb",
                  max_seq_len=8192, kv_slots=12000, instances=5, prefill_instances=2,
                  decode_instances=2, router=router, pd_threshold=300)
    result = simulate(load_workload(run), "vllm", run, check=True)
    s = result.summary
    assert s["num_finished"] + s["num_refused"] == s["num_requests"] == 300
    assert s["num_preemptions"] > 0
    parts = ("token_states", "reservation", "internal_fragmentation", "free", "kv_sending")
    assert sum(s[f"{q}_frac"] for q in parts) == pytest.approx(1.0, abs=1e-9)
    for inst in s["instances"]:
        assert sum(inst.get(f"{q}_frac", 0.0) for q in parts) == pytest.approx(1.0, abs=1e-9)
    assert [p["role"] for p in s["pools"]] == ["prefill", "decode", "mixed"]
    assert len(result.requests) == 300 and result.requests["request_id"].is_unique
    split = result.requests["prefill_instance"] >= 0
    assert int(split.sum()) == s["num_disaggregated"] > 0
    assert set(result.requests.loc[split, "instance"]) <= {2, 3}
    assert set(result.requests.loc[~split, "instance"]) == {4}  # short prompts run whole, on the mixed one
    assert 0 < s["kv_duplicated_frac"] < s["kv_sending_frac"]


def test_the_decider_sends_short_prompts_to_be_served_whole() -> None:
    prompts = [100, 3000, 200, 2500]
    tr = trace([0.0, 0.5, 1.0, 1.5], prompts, [4] * 4)
    mixed = simulate(tr, "vllm", spec(instances=3, pd_threshold=1000), check=True)
    rows = mixed.requests.set_index("request_id")
    assert list(rows["prefill_instance"]) == [-1, 0, -1, 0]
    assert list(rows["instance"]) == [2, 1, 2, 1]
    # No mixed pool: the decode instance runs a short prompt itself, as llm-d does.
    whole = simulate(tr, "vllm", spec(pd_threshold=1000), check=True)
    assert list(whole.requests["instance"]) == [1, 1, 1, 1]
    assert whole.summary["num_disaggregated"] == 2
    assert not math.isnan(whole.requests.loc[0, "ttft_s"])


def test_bad_splits_name_the_option() -> None:
    tr = trace([0.0], [100], [4])
    with pytest.raises(FragsimError, match="--decode-instances 1: a decode pool needs a prefill pool"):
        simulate(tr, "vllm", spec(prefill_instances=0), check=True)
    with pytest.raises(FragsimError, match="needs a decode pool"):
        simulate(tr, "vllm", spec(decode_instances=0), check=True)
    with pytest.raises(FragsimError, match="exceed --instances 2"):
        simulate(tr, "vllm", spec(prefill_instances=2), check=True)
    with pytest.raises(FragsimError, match="--kv-transfer-bandwidth must be > 0"):
        simulate(tr, "vllm", spec(kv_transfer_bandwidth_gbps=0.0), check=True)


def test_the_cli_splits_pools_and_prints_the_transfers(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from fragsim.cli import main

    args = ["run", "--num-requests", "200", "--allocator", "vllm", "--prefill-instances", "1",
            "--decode-instances", "2", "--no-save"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "prefill ×1" in out and "decode ×2" in out and "#0 prefill" in out and "KV transfers" in out
    assert main([*args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[0])
    assert summary["num_instances"] == 3 and summary["num_requests"] == 200
    assert summary["num_kv_transfers"] == summary["num_disaggregated"] == 200
    assert [i["role"] for i in summary["instances"]] == ["prefill", "decode", "decode"]


def test_a_request_waiting_for_its_kv_keeps_its_blocks_and_the_running_one_is_preempted() -> None:
    """The decode instance reserved the second request's blocks when its prefill ended.
    When the first, running, request needs room, vLLM 0.33 preempts from its running set
    alone: the request waiting for its KV is not in it, so it keeps its blocks and its
    transfer, and the running one is recomputed once the other is done."""
    run = spec(kv_slots=1024, kv_transfer_bandwidth_gbps=0.001)  # 64 blocks; a very slow link
    result = simulate(trace([0.0, 0.1], [100, 500], [450, 4]), "vllm", run, check=True)
    rows = result.requests.set_index("request_id")
    assert list(rows["status"]) == ["finished", "finished"]
    assert list(rows["num_preemptions"]) == [1, 0]
    # Reserved at 0.12, when its prefill ended; it queued for the ports behind the first's.
    lands = 0.02 + 0.002 + seconds(run, 100) + seconds(run, 500)
    assert rows.loc[1, "kv_transfer_s"] == pytest.approx(lands - 0.12)
    assert rows.loc[1, "first_token_s"] > lands  # it waited for its KV, then ran
    assert rows.loc[0, "finish_s"] > rows.loc[1, "finish_s"]  # recomputed after the other
