"""An offload tier on the instances of a prefill/decode split: the transfer and the tier
share the engine's one connector slot as vLLM's MultiConnector composes them."""

from __future__ import annotations

import numpy as np
import pytest

from fragsim.simulate import RunSpec, load_workload, simulate
from fragsim.traces import Trace

STEP = 0.02
SPLIT = ("token_states", "reservation", "internal_fragmentation", "free", "kv_sending", "store_pending")


def spec(**kw: object) -> RunSpec:
    base: dict[str, object] = dict(model="llama-3.1-8b", gpu="h100-80gb", cost_model="fixed",
                                   step_time_s=STEP, max_seq_len=4096, instances=2,
                                   prefill_instances=1, decode_instances=1, prefix_caching=True,
                                   kv_offloading_size=1.0, kv_transfer_bandwidth_gbps=10.0,
                                   kv_transfer_latency_ms=2.0)
    base.update(kw)
    return RunSpec(**base)  # type: ignore[arg-type]


def trace(arrival: list[float], prompt: list[int], output: list[int], hashes: list[tuple[int, ...]]) -> Trace:
    return Trace("pd", "test", np.array(arrival), np.array(prompt), np.array(output),
                 block_hashes=hashes, block_hash_size=512)


def test_the_prefill_instance_loads_a_prompt_its_gpu_no_longer_holds() -> None:
    """Three 1,024-token prompts on a prefill instance whose GPU pool holds about one:
    the third repeats the first, whose blocks the second evicted from the GPU prefix
    cache; the prefill instance's CPU tier has them, so it loads them instead of
    computing them, and only the last token is computed again."""
    run = spec(kv_slots=1200)
    tr = trace([0.0, 1.0, 2.0], [1024, 1024, 1024], [4, 4, 4], [(1, 2), (3, 4), (1, 2)])
    result = simulate(tr, "vllm", run, check=True)
    s = result.summary
    prefill, decode = s["instances"]
    assert s["num_finished"] == 3 and s["num_kv_transfers"] == 3
    # What the GPU prefix cache kept of the first prompt, then the rest from the tier.
    assert 0 < prefill["external_prefix_cache_hits"] < 1024
    assert prefill["prefix_cache_hits"] + prefill["external_prefix_cache_hits"] == 1024
    assert prefill["num_prefill_tokens"] == 1024 + 1024 + 1  # the third: its last token only
    # The decode instance's tier stored the KV that arrived: what landed is cached there too.
    assert decode["tiers"][0]["stored_blocks"] > 0
    assert sum(s[f"{q}_frac"] for q in SPLIT) == pytest.approx(1.0, abs=1e-9)


def test_a_copy_lives_until_both_the_transfer_and_the_stores_are_done() -> None:
    """The prefill side's copy waits for the transfer and for its own stores to its
    tier, whichever ends last, and is counted once: a fast link leaves the stores last,
    a slow one the transfer."""
    for bandwidth, latency in ((1000.0, 0.0), (10.0, 2.0)):
        run = spec(kv_transfer_bandwidth_gbps=bandwidth, kv_transfer_latency_ms=latency)
        result = simulate(trace([0.0], [1024], [4], [(1, 2)]), "vllm", run, check=True)
        prefill = result.summary["instances"][0]
        tier = prefill["tiers"][0]
        assert tier["stored_blocks"] == 64 and tier["store_time_s"] > 0
        link = latency / 1e3 + result.summary["mean_kv_transfer_s"]
        held = prefill["mean_kv_sending_slots"] * prefill["sim_time_s"] / 1025  # seconds of 1,025 slots
        assert held == pytest.approx(max(link, tier["store_time_s"]), rel=1e-9)
        assert prefill["sim_time_s"] == pytest.approx(STEP + held)


@pytest.mark.parametrize("gpu_slots", [20000, 60000])
def test_a_loaded_split_with_tiers_keeps_its_split_at_every_step(gpu_slots: int) -> None:
    run = RunSpec(trace="azure-conv", num_requests=200, model="llama-3.1-8b", gpu="a100-40gb",
                  max_seq_len=8192, kv_slots=gpu_slots, instances=3, prefill_instances=1,
                  decode_instances=2, prefix_caching=True, kv_offloading_size=2.0,
                  system_prompt_len=512, router="least-loaded")
    result = simulate(load_workload(run), "vllm", run, check=True)
    s = result.summary
    assert s["num_finished"] + s["num_refused"] == 200
    assert s["num_kv_transfers"] > 0
    assert sum(s[f"{q}_frac"] for q in SPLIT) == pytest.approx(1.0, abs=1e-9)
    for inst in s["instances"]:
        assert sum(inst.get(f"{q}_frac", 0.0) for q in SPLIT) == pytest.approx(1.0, abs=1e-9)
        assert inst["tiers"] and inst["tiers"][0]["stored_blocks"] > 0
