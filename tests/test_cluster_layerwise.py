"""Layer-wise overlap of the prefill-to-decode transfer (fragsim.cluster.layerwise): the
decode side reserves before the prefill runs, each chunk's KV is pushed layer by layer
as it is computed, and pieces that share a port queue for it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fragsim.errors import FragsimError
from fragsim.simulate import RunSpec, load_workload, simulate
from fragsim.simulate_spec import _model_gpu
from fragsim.traces import Trace

STEP = 0.02      # fixed cost model: every step lasts this long
LAT = 0.002
BLOCK = 16
LAYERS = 32      # llama-3.1-8b


def spec(**kw: object) -> RunSpec:
    base: dict[str, object] = dict(model="llama-3.1-8b", gpu="h100-80gb", cost_model="fixed",
                                   step_time_s=STEP, max_seq_len=4096, instances=2,
                                   prefill_instances=1, decode_instances=1, kv_transfer_bandwidth_gbps=10.0,
                                   kv_transfer_latency_ms=LAT * 1e3, kv_transfer_layerwise=True)
    base.update(kw)
    return RunSpec(**base)  # type: ignore[arg-type]


def trace(arrival: list[float], prompt: list[int], output: list[int]) -> Trace:
    return Trace("pd", "test", np.array(arrival), np.array(prompt), np.array(output))


def seconds(run: RunSpec, tokens: int) -> float:
    """Link time of ``tokens`` tokens' whole blocks."""
    model, _ = _model_gpu(run)
    return -(-tokens // BLOCK) * BLOCK * model.kv_bytes_per_token_per_gpu(1) / (run.kv_transfer_bandwidth_gbps * 1e9)


def test_a_prefill_bound_push_lands_one_layer_after_the_prefill() -> None:
    """The link (13 ms) is faster than the prefill (20 ms): only the last layer's share
    is left when the prefill ends. The decode side reserved at the arrival, before the
    prefill ran; the prefill side's copy lasts from its end to the landing."""
    run = spec()
    w = seconds(run, 1000)
    assert w < STEP
    result = simulate(trace([0.0], [1000], [5]), "vllm", run, check=True)
    row, s = result.requests.iloc[0], result.summary
    lands = STEP + LAT + w / LAYERS
    assert row["ttft_s"] == pytest.approx(lands + STEP, abs=1e-12)
    assert row["kv_transfer_s"] == pytest.approx(lands, abs=1e-12)  # reserved at 0
    assert s["mean_kv_transfer_s"] == pytest.approx(w)
    assert s["mean_kv_receiving_slots"] * s["sim_time_s"] == pytest.approx(1000 * lands, rel=1e-9)
    prefill = s["instances"][0]
    assert prefill["mean_kv_sending_slots"] * prefill["sim_time_s"] == pytest.approx(1001 * (LAT + w / LAYERS))
    # The pull flow, for the same request: the whole transfer after the prefill.
    pulled = simulate(trace([0.0], [1000], [5]), "vllm", spec(kv_transfer_layerwise=False), check=True)
    assert pulled.requests.iloc[0]["ttft_s"] == pytest.approx(STEP + LAT + w + STEP, abs=1e-12)


def test_a_link_bound_push_lands_the_bytes_after_the_first_layer() -> None:
    run = spec(kv_transfer_bandwidth_gbps=1.0)
    w = seconds(run, 1000)
    assert w > STEP
    result = simulate(trace([0.0], [1000], [5]), "vllm", run, check=True)
    assert result.requests.iloc[0]["ttft_s"] == pytest.approx(STEP / LAYERS + LAT + w + STEP, abs=1e-12)
    table = result.transfers
    # It holds the ports for its bytes only, from when the first layer is ready.
    assert table["start_s"].iloc[0] == pytest.approx(STEP / LAYERS + LAT, abs=1e-12)
    assert table["end_s"].iloc[0] - table["start_s"].iloc[0] == pytest.approx(w, abs=1e-12)


def test_every_chunk_of_a_chunked_prefill_streams_as_computed() -> None:
    """512 + 488 tokens in two steps: the first chunk's bytes go during its step, the
    second's during the second step, and only the second's last layer is left after it
    (a push of the last chunk only would leave 1/L of the whole prompt)."""
    run = spec(max_num_batched_tokens=512)
    w = seconds(run, 1000)
    second = w * 488 / 1000  # a chunk's share of the bytes, by tokens
    result = simulate(trace([0.0], [1000], [5]), "vllm", run, check=True)
    ttft = result.requests.iloc[0]["ttft_s"]
    assert ttft == pytest.approx(2 * STEP + LAT + second / LAYERS + STEP, abs=1e-12)
    assert ttft < 2 * STEP + LAT + w / LAYERS + STEP


def test_pushes_that_share_a_port_queue_for_it() -> None:
    """Two prompts in one prefill step, to one decode instance: each piece wants the
    ports for its bytes at the end of the step, the second gets them after the first."""
    run = spec()
    w = seconds(run, 500)
    result = simulate(trace([0.0, 0.0], [500, 500], [3, 3]), "vllm", run, check=True)
    first = STEP + LAT + w / LAYERS
    table = result.transfers.sort_values("end_s")
    assert list(table["start_s"]) == pytest.approx([first - w, first], abs=1e-12)
    assert list(table["end_s"]) == pytest.approx([first, first + w], abs=1e-12)
    # The second lands during the first one's first decode step, and starts after it.
    assert sorted(result.requests["ttft_s"]) == pytest.approx([first + STEP, first + 2 * STEP], abs=1e-12)


def test_the_decode_side_reserves_before_the_prefill_ends() -> None:
    """The decode instance's split shows the prompt's blocks reserved from the arrival,
    while the prefill instance still computes it."""
    run = spec(timeseries_resolution_s=0.001)
    result = simulate(trace([0.0], [1000], [5]), "vllm", run, check=True)
    series = result.timeseries
    decode = series[(series["instance"] == 1) & (series["time_s"] < STEP)]
    assert len(decode) and (decode["reservation"] >= 1000).all()
    prefill = series[(series["instance"] == 0) & (series["time_s"] < STEP)]
    assert (prefill["token_states"] == 0).all()  # its first chunk is computing


def test_a_full_decode_pool_makes_the_prefill_wait() -> None:
    """The decode pool holds one request: the second waits in its queue, unreserved, and
    its prefill instance runs it only once the first has finished there."""
    run = spec(kv_slots=1200)
    result = simulate(trace([0.0, 0.0], [1000, 1000], [5, 5]), "vllm", run, check=True)
    rows = result.requests.set_index("request_id")
    assert list(rows["status"]) == ["finished", "finished"]
    first_done = rows.loc[0, "finish_s"]
    table = result.transfers.set_index("request_id")
    assert table.loc[1, "reserved_s"] >= first_done
    assert table.loc[1, "start_s"] > table.loc[1, "reserved_s"]


@pytest.mark.parametrize("router", ["round-robin", "least-loaded"])
def test_a_loaded_cluster_keeps_its_split_at_every_step(router: str) -> None:
    """Small pools: the decode side runs out of room for reservations, requests are
    preempted, every request is served and the split adds up on every instance."""
    run = RunSpec(trace="azure-conv", num_requests=300, model="llama-3.1-8b", gpu="a100-40gb",
                  max_seq_len=8192, kv_slots=12000, instances=5, prefill_instances=2,
                  decode_instances=2, router=router, pd_threshold=300, kv_transfer_layerwise=True)
    result = simulate(load_workload(run), "vllm", run, check=True)
    s = result.summary
    assert s["num_finished"] + s["num_refused"] == s["num_requests"] == 300
    assert s["num_preemptions"] > 0 and s["num_kv_transfers"] == s["num_disaggregated"] > 0
    parts = ("token_states", "reservation", "internal_fragmentation", "free", "kv_sending")
    for part in (s, *s["instances"]):
        assert sum(part.get(f"{q}_frac", 0.0) for q in parts) == pytest.approx(1.0, abs=1e-9)
    assert 0 < s["kv_duplicated_frac"] and 0 < s["kv_receiving_frac"]


def test_what_layerwise_refuses_by_name() -> None:
    tr = trace([0.0], [100], [4])
    with pytest.raises(FragsimError, match="--kv-transfer-layerwise: needs a prefill/decode split"):
        simulate(tr, "vllm", spec(instances=2, prefill_instances=0, decode_instances=0))
    with pytest.raises(FragsimError, match="--queue-timeout with --kv-transfer-layerwise"):
        simulate(tr, "vllm", spec(queue_timeout_s=5.0))


@pytest.mark.parametrize("chunk", [None, 512])
def test_a_hybrid_model_streams_full_attention_and_sends_its_window_last(chunk: int | None) -> None:
    """gpt-oss-20b under vllm-hybrid: the same bytes as the pull flow; its full-attention
    bytes stream with each chunk, its sliding window's go with the last chunk."""
    run = spec(model="gpt-oss-20b", max_seq_len=8192, kv_cache_memory_bytes=4 << 30,
               max_num_batched_tokens=chunk)
    layers = _model_gpu(run)[0].num_layers
    result = simulate(trace([0.0], [1000], [5]), "vllm-hybrid", run, check=True)
    pulled = simulate(trace([0.0], [1000], [5]), "vllm-hybrid", replace(run, kv_transfer_layerwise=False))
    s = result.summary
    assert s["kv_transfer_bytes_by_kind"] == pulled.summary["kv_transfer_bytes_by_kind"]
    full, sliding = (s["kv_transfer_bytes_by_kind"][k] / 10e9 for k in ("full", "sliding"))
    last = full + sliding if chunk is None else full * 488 / 1000 + sliding
    steps = 1 if chunk is None else 2
    assert result.requests.iloc[0]["ttft_s"] == pytest.approx(steps * STEP + LAT + last / layers + STEP, abs=1e-12)


def test_the_cli_and_a_cluster_file_turn_it_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from fragsim.cli import main

    args = ["run", "--num-requests", "50", "--allocator", "vllm", "--prefill-instances", "1",
            "--decode-instances", "1", "--no-save", "--json"]
    out = []
    for extra in ([], ["--kv-transfer-layerwise"]):
        assert main([*args, *extra]) == 0
        out.append(json.loads(capsys.readouterr().out.splitlines()[0]))
    pull, push = out
    assert pull["num_kv_transfers"] == push["num_kv_transfers"] == 50
    assert pull["kv_transfer_bytes"] == push["kv_transfer_bytes"]
    assert push["mean_ttft_s"] < pull["mean_ttft_s"]
    path = tmp_path / "cluster.toml"
    pools = '[[pools]]\nrole = "prefill"\n[[pools]]\nrole = "decode"\n'
    path.write_text(f"[cluster]\nkv_transfer_layerwise = true\n[workload]\nnum_requests = 50\n{pools}")
    assert main(["cluster", str(path), "--no-save", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["mean_ttft_s"] == pytest.approx(push["mean_ttft_s"])
    path.write_text(f"[workload]\nnum_requests = 50\n{pools}kv_transfer_layerwise = true\n")
    assert main(["cluster", str(path), "--no-save"]) != 0
    assert "[[pools]] #2 kv_transfer_layerwise: a cluster setting" in capsys.readouterr().err
