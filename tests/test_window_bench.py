"""The windowed-kernel benchmark's cases: page-laid pools, byte counts, reference checks."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from gpu_backend.window_bench import attended, check, make_window_case, window_bytes  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() else "cuda"


def test_attended_tokens() -> None:
    assert attended("full", 0, 100) == 100
    assert attended("sliding", 128, 100) == 100 and attended("sliding", 128, 1000) == 128
    assert attended("chunked", 64, 64) == 64 and attended("chunked", 64, 65) == 1


@pytest.mark.parametrize(("kind", "span"), [("full", 1), ("sliding", 6), ("chunked", 8), ("mla", 1)])
def test_cases_are_page_strided_and_match_the_reference(kind: str, span: int) -> None:
    shape = ({"num_q_heads": 2, "head_dim": 8, "kv_lora_rank": 16, "rope_dim": 8} if kind == "mla"
             else {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16})
    case = make_window_case(kind, 3, 21, span=span, block_size=4, dtype=torch.float32, device=DEVICE, **shape)
    if kind != "mla":
        # K and V of a block share a page: the block stride is two K blocks.
        assert case.k.stride(0) == 2 * 4 * 2 * 16 and case.v.data_ptr() > case.k.data_ptr()
        if kind != "full":
            assert bool((case.tables[:, 0] == -1).all())   # freed by the window
    out = case.run()
    assert check(case, out, atol=1e-4, rtol=1e-4) < 1e-4
    with pytest.raises(AssertionError, match="differs from the reference"):
        check(case, out + 1.0)
    tokens = 3 * attended(kind, span, 21)
    per_token = (16 + 8) if kind == "mla" else 2 * 2 * 16
    assert window_bytes(case) > tokens * per_token * 4
