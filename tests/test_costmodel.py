"""Cost models: the closed forms, and scalar == array evaluation to the last bit."""

from __future__ import annotations

import numpy as np
import pytest

from fragsim.catalog import get_gpu, get_model
from fragsim.costmodel import FixedCostModel, RooflineCostModel, make_cost_model


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_scalar_and_array_step_times_are_bit_identical(tp: int) -> None:
    cost = RooflineCostModel(get_model("llama-2-13b"), get_gpu("a100-80gb"), tp=tp)
    rng = np.random.default_rng(0)
    for n in (1, 7, 64, 256):
        ctx = rng.integers(0, 3_000_000, size=200)
        batch = cost.decode_step_times(n, ctx)
        single = np.array([cost.decode_step_times(n, ctx[i: i + 1])[0] for i in range(len(ctx))])
        assert np.array_equal(batch, single)


def test_roofline_decode_is_bandwidth_bound_and_prefill_compute_bound() -> None:
    model, gpu = get_model("opt-13b"), get_gpu("a100-40gb")
    cost = RooflineCostModel(model, gpu, overhead_s=0.0)
    decode = cost.step_time(0, 0, 1, 1000)
    expected = (model.weight_bytes + model.kv_bytes_per_token * 1000) / (gpu.hbm_bandwidth * 0.8)
    assert decode == pytest.approx(expected)
    prefill = cost.step_time(2048, 2048 * 2047 // 2, 0, 0)
    flops = 2.0 * model.num_params * 2048 + 4.0 * model.num_layers * model.num_heads * model.head_dim * (2048 * 2047 // 2)
    assert prefill == pytest.approx(flops / (gpu.fp16_flops * 0.6))


def test_tensor_parallel_splits_work_and_adds_communication() -> None:
    model, gpu = get_model("llama-2-70b"), get_gpu("h100-80gb")
    one = RooflineCostModel(model, gpu, tp=1, overhead_s=0.0).step_time(0, 0, 32, 32 * 1000)
    four = RooflineCostModel(model, gpu, tp=4, overhead_s=0.0).step_time(0, 0, 32, 32 * 1000)
    assert one / 4 < four < one / 2


def test_fixed_and_errors() -> None:
    assert FixedCostModel(0.05).step_time(100, 0, 3, 10) == 0.05
    assert make_cost_model("fixed", step_time=0.1).decode_step_times(4, np.arange(3)).tolist() == [0.1] * 3
    with pytest.raises(ValueError, match="step_time"):
        FixedCostModel(0)
    with pytest.raises(ValueError, match="unknown cost model"):
        make_cost_model("magic")
    with pytest.raises(ValueError, match="flops_efficiency"):
        RooflineCostModel(get_model("opt-13b"), get_gpu("a100-40gb"), flops_efficiency=1.5)
