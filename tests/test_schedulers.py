"""How a step is built (``--scheduler``): today's vLLM (vllm-v1, the default), vLLM 0.1
as the vLLM paper ran it (vllm-v0: prompt-only steps first, else decode-only steps) and
Orca's iteration-level batching (whole prompts beside decodes)."""

from __future__ import annotations

import numpy as np
import pytest

from fragsim.errors import FragsimError
from fragsim.simulate import RunSpec, load_workload, simulate
from fragsim.traces import Trace

STEP = 0.02


def spec(scheduler: str, **kw: object) -> RunSpec:
    base: dict[str, object] = dict(model="opt-13b", gpu="a100-40gb", cost_model="fixed", step_time_s=STEP,
                                   max_seq_len=2048, scheduler=scheduler)
    base.update(kw)
    return RunSpec(**base)  # type: ignore[arg-type]


def trace(arrival: list[float], prompt: list[int], output: list[int]) -> Trace:
    return Trace("sched", "test", np.array(arrival), np.array(prompt), np.array(output))


def times(scheduler: str, tr: Trace, **kw: object) -> list[tuple[float, float]]:
    rows = simulate(tr, "vllm", spec(scheduler, **kw), check=True).requests
    return [(round(a, 9), round(b, 9)) for a, b in zip(rows["first_token_s"], rows["finish_s"], strict=True)]


def test_a_prompt_step_of_vllm_v0_pauses_the_decoding_request() -> None:
    """A (prompt 100, 5 tokens) at 0, B (50, 3) at 0.05. Under vllm-v0 the step at 0.06
    runs B's prompt alone and A waits it out; under vllm-v1 and orca, B's prompt shares
    that step with A's decode, so A ends a step sooner."""
    tr = trace([0.0, 0.05], [100, 50], [5, 3])
    assert times("vllm-v0", tr) == [(0.02, 0.12), (0.08, 0.12)]
    assert times("vllm-v1", tr) == [(0.02, 0.10), (0.08, 0.12)]
    assert times("orca", tr) == times("vllm-v1", tr)


def test_orca_runs_a_prompt_whole_or_waits() -> None:
    """A 300-token step budget; A (prompt 100, 10 tokens) decodes from 0.02 to 0.20 and C
    (a 300-token prompt) arrives at 0.01. vllm-v1 chunks C beside A's decodes (299 tokens,
    then 1); orca runs a prompt whole, so C waits until A's decode leaves the step room
    (A's end); vllm-v0 runs C's prompt alone at once, A waiting out that step."""
    tr = trace([0.0, 0.01], [100, 300], [10, 2])
    kw: dict[str, object] = dict(max_num_batched_tokens=300, max_num_seqs=4)
    assert times("vllm-v1", tr, **kw) == [(0.02, 0.20), (0.06, 0.08)]
    assert times("orca", tr, **kw) == [(0.02, 0.20), (0.22, 0.24)]
    assert times("vllm-v0", tr, **kw) == [(0.02, 0.22), (0.04, 0.06)]


def test_the_paper_engines_refuse_a_prompt_no_step_can_hold() -> None:
    """vLLM 0.1 ignores a prompt longer than min(max_model_len, max_num_batched_tokens);
    by default the budget is 2,560 or the context, whichever is more, so none is."""
    tr = trace([0.0, 0.0], [3000, 100], [4, 4])
    for scheduler in ("vllm-v0", "orca"):
        result = simulate(tr, "vllm", spec(scheduler, max_seq_len=4096, max_num_batched_tokens=2560), check=True)
        assert list(result.requests["refused_reason"]) == ["too_long", ""]
        assert simulate(tr, "vllm", spec(scheduler, max_seq_len=4096), check=True).summary["num_refused"] == 0
    assert simulate(tr, "vllm", spec("vllm-v1", max_seq_len=4096, max_num_batched_tokens=2560)
                    ).summary["num_refused"] == 0


@pytest.mark.parametrize("scheduler", ["vllm-v0", "orca"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_stretches_give_the_exact_steps_results(scheduler: str, preemption: str) -> None:
    """Loaded enough to preempt: the default (uneventful decode stretches advanced at
    once) and --exact-steps agree on every figure, and the split holds at every step."""
    run = RunSpec(trace="sharegpt-paper", num_requests=300, rate=4.0, model="opt-13b", gpu="a100-40gb",
                  max_seq_len=2048, cost_model="vllm-paper", scheduler=scheduler, preemption=preemption,
                  kv_slots=12000)
    fast = simulate(load_workload(run), "vllm", run, check=True)
    exact = simulate(load_workload(run), "vllm", RunSpec(**{**run.__dict__, "exact_steps": True}))
    assert fast.summary["num_preemptions"] > 0
    for key in ("num_finished", "num_preemptions", "mean_running", "mean_waiting", "token_states_frac",
                "mean_normalized_latency_s", "sim_time_s"):
        assert fast.summary[key] == pytest.approx(exact.summary[key], rel=1e-9), key
    assert fast.summary["num_steps"] == exact.summary["num_steps"]
    assert fast.summary["num_events"] < exact.summary["num_events"]  # stretches ran


def test_the_scheduler_is_named_where_it_cannot_run() -> None:
    tr = trace([0.0], [100], [4])
    with pytest.raises(FragsimError, match="scheduler vllm-v0 builds iteration-level steps"):
        simulate(tr, "vllm", spec("vllm-v0", batching="static"))
    with pytest.raises(FragsimError, match="a tier runs under today's scheduler"):
        simulate(tr, "vllm", spec("orca", kv_offloading_size=1.0))
    with pytest.raises(FragsimError, match="--scheduler orca with --prefill-instances"):
        simulate(tr, "vllm", spec("orca", instances=2, prefill_instances=1, decode_instances=1))
