"""MLA decode attention (absorbed, Triton) against the naive PyTorch reference.

The reference materialises per-head K and V from the latent, so agreement checks the
absorption algebra as well as the kernel. Shapes stay tiny for Triton's interpreter.
"""

from __future__ import annotations

import math
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton", reason="the GPU backend's kernels need triton")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gpu_backend import kernels_mla  # noqa: E402
from gpu_backend.kernels_mla import _mla_plan, mla_decode_attention  # noqa: E402
from gpu_backend.reference import mla_decode_attention_ref  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda"
# Two more fp16 roundings than plain attention: q_lat and o_lat are stored in fp16.
TOL = {torch.float16: {"atol": 1e-2, "rtol": 1e-2}, torch.float32: {"atol": 1e-5, "rtol": 1e-5}}


def make_case(seq_lens: list[int], block_size: int, num_heads: int, qk_nope_dim: int,
              kv_lora_rank: int, rope_dim: int, v_head_dim: int, dtype: torch.dtype,
              seed: int = 0) -> dict:
    """Arguments of mla_decode_attention: weights scaled so outputs stay near 1."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)

    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(seq_lens), max(needed) + 1), -1, dtype=torch.int32)
    for i, n in enumerate(needed):
        table[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    batch, num_slots = len(seq_lens), num_blocks * block_size
    return {"q_nope": randn(batch, num_heads, qk_nope_dim), "q_pe": randn(batch, num_heads, rope_dim),
            "c_kv": randn(num_slots, kv_lora_rank), "k_pe": randn(num_slots, rope_dim),
            "w_uk": randn(num_heads, qk_nope_dim, kv_lora_rank, scale=qk_nope_dim ** -0.5),
            "w_uv": randn(num_heads, kv_lora_rank, v_head_dim, scale=kv_lora_rank ** -0.5),
            "block_tables": table.to(DEVICE),
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            "block_size": block_size}


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[want.dtype])


# (dtype, num_heads, qk_nope_dim, kv_lora_rank, rope_dim, v_head_dim, block_size, seq_lens,
# block_n, num_splits): one head, 3 heads (padded to 4), 16 heads through tl.dot; latent
# and dims not powers of two; block sizes 1, 3 and 16.
CASES = [
    (torch.float32, 1, 24, 80, 24, 40, 3, [1, 7, 20], 4, 1),
    (torch.float16, 3, 16, 48, 8, 24, 1, [1, 5, 9], 4, 2),
    (torch.float32, 16, 24, 80, 24, 40, 16, [1, 16, 40], 16, 1),
    (torch.float16, 16, 16, 64, 16, 16, 3, [2, 12, 33], 16, 3),
    (torch.float32, 4, 8, 32, 16, 8, 16, [17, 32], 8, 4),
]
CASE_IDS = [f"{str(c[0])[6:]}-h{c[1]}-r{c[3]}-p{c[4]}-bs{c[6]}-s{c[9]}" for c in CASES]


@pytest.mark.parametrize(("dtype", "num_heads", "qk_nope_dim", "kv_lora_rank", "rope_dim",
                          "v_head_dim", "block_size", "seq_lens", "block_n", "num_splits"),
                         CASES, ids=CASE_IDS)
def test_matches_naive_reference(dtype, num_heads, qk_nope_dim, kv_lora_rank, rope_dim,
                                 v_head_dim, block_size, seq_lens, block_n, num_splits):
    args = make_case(seq_lens, block_size, num_heads, qk_nope_dim, kv_lora_rank, rope_dim,
                     v_head_dim, dtype)
    out = mla_decode_attention(**args, block_n=block_n, num_splits=num_splits)
    want = mla_decode_attention_ref(**args)
    assert_close(out, want)
    # The rope part counts: without it the answer differs.
    no_rope = mla_decode_attention_ref(**{**args, "q_pe": args["q_pe"] * 0},
                                       scale=1 / math.sqrt(qk_nope_dim + rope_dim))
    assert not torch.allclose(out.float(), no_rope.float(), **TOL[dtype])


def test_small_head_blocks_and_scale():
    """Heads split over programs (block_h 4 of 6) re-read the latent and agree; scale applies."""
    args = make_case([3, 21], 4, 6, 8, 32, 8, 16, torch.float32)
    want = mla_decode_attention_ref(**args, scale=0.2)
    assert_close(mla_decode_attention(**args, scale=0.2, block_h=4, block_n=4), want)
    default = mla_decode_attention(**args, block_h=4, block_n=4)
    assert not torch.allclose(default, want, **TOL[torch.float32])


def test_one_cache_tensor_as_two_views():
    """vLLM's layout, [num_slots, kv_lora_rank + rope_dim]: pass its two column views."""
    args = make_case([5, 13], 4, 2, 8, 32, 16, 8, torch.float32)
    joint = torch.cat([args["c_kv"], args["k_pe"]], dim=1)
    views = {**args, "c_kv": joint[:, :32], "k_pe": joint[:, 32:]}
    out = torch.empty(2, 2, 8, device=DEVICE)
    assert mla_decode_attention(**views, out=out, block_n=4) is out
    assert_close(out, mla_decode_attention_ref(**args))


def test_padding_entries_never_read_and_corruption_shows():
    args = make_case([5, 8], 4, 2, 8, 16, 16, 8, torch.float32)
    args["block_tables"][:, -1] = 1 << 30  # past every sequence: never read
    want = mla_decode_attention_ref(**args)
    assert_close(mla_decode_attention(**args, block_n=4), want)
    corrupt = args["block_tables"].clone()
    corrupt[1, 1] = corrupt[0, 0]  # a double allocation
    out = mla_decode_attention(**{**args, "block_tables": corrupt}, block_n=4)
    assert_close(out[0], want[0])
    assert not torch.allclose(out[1], want[1], **TOL[torch.float32])


@settings(max_examples=6, deadline=None)
@given(seq_lens=st.lists(st.integers(1, 30), min_size=1, max_size=3),
       block_size=st.sampled_from([1, 3, 16]), num_heads=st.sampled_from([1, 2, 5]),
       num_splits=st.integers(1, 3))
def test_random_shapes(seq_lens, block_size, num_heads, num_splits):
    args = make_case(seq_lens, block_size, num_heads, 8, 24, 8, 8, torch.float32,
                     seed=len(seq_lens))
    out = mla_decode_attention(**args, block_n=4, num_splits=num_splits)
    assert_close(out, mla_decode_attention_ref(**args))


def test_empty_batch():
    args = make_case([1], 4, 2, 8, 16, 8, 8, torch.float16)
    args.update(q_nope=args["q_nope"][:0], q_pe=args["q_pe"][:0],
                block_tables=args["block_tables"][:0], seq_lens=args["seq_lens"][:0])
    assert mla_decode_attention(**args).shape == (0, 2, 8)


# --------------------------------------------------------------------------- validation


def _valid_args() -> dict:
    return make_case([5, 8], 4, 2, 8, 16, 8, 8, torch.float16)


MLA_ERRORS = [
    ("q_nope", lambda a: a["q_nope"][0], "q_nope must be"),
    ("q_nope", lambda a: a["q_nope"].to(torch.bfloat16), "dtype must be one of"),
    ("q_pe", lambda a: a["q_pe"][:, :, :4], r"q_pe must be \[batch, num_heads, rope_dim\]"),
    ("q_pe", lambda a: a["q_pe"].float(), "q_pe.dtype"),
    ("q_pe", lambda a: a["q_pe"].transpose(1, 2).contiguous().transpose(1, 2),
     "q_pe must be contiguous in its last"),
    ("c_kv", lambda a: a["c_kv"][None, None], r"c_kv must be \[num_slots, kv_lora_rank\]"),
    ("c_kv", lambda a: a["c_kv"][None], r"3-d c_kv and k_pe must be \[num_blocks"),
    ("c_kv", lambda a: a["c_kv"].t().contiguous().t(), "c_kv must be contiguous in its last"),
    ("k_pe", lambda a: a["k_pe"][:4], r"k_pe must be \[num_slots=20"),
    ("w_uk", lambda a: a["w_uk"][:, :, :8], r"w_uk must be \[num_heads, qk_nope_dim, kv_lora"),
    ("w_uv", lambda a: a["w_uv"][:1], r"w_uv must be \[num_heads=2"),
    ("w_uv", lambda a: a["w_uv"].float(), "w_uv.dtype"),
    ("out", lambda a: torch.empty(2, 2, 4, dtype=torch.float16, device=DEVICE), "out shape"),
    ("seq_lens", lambda a: a["seq_lens"].long(), "seq_lens must be int32"),
    ("seq_lens", lambda a: a["seq_lens"] * 0, "seq_lens entry must be >= 1"),
    ("seq_lens", lambda a: a["seq_lens"] * 2, "need more than"),
    ("block_tables", lambda a: a["block_tables"] + 3, "point outside the pool"),
    ("block_tables", lambda a: a["block_tables"][:1], "block_tables must have shape"),
    ("block_size", lambda a: 2.5, "block_size must be a positive int"),
]


@pytest.mark.parametrize(("field", "mutate", "message"), MLA_ERRORS,
                         ids=[f"{f}-{m[:18]}" for f, _, m in MLA_ERRORS])
def test_wrapper_rejects(field, mutate, message):
    args = _valid_args()
    args[field] = mutate(args)
    with pytest.raises(ValueError, match=message):
        mla_decode_attention(**args)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"block_n": 12}, "block_n must be a power of two"),
    ({"block_n": 8, "use_dot": True}, "block_n must be a power of two"),
    ({"block_h": 3}, "block_h must be a power of two"),
    ({"num_splits": 0}, "num_splits must be >= 1"),
    ({"num_warps": 3}, "num_warps must be a power of two"),
    ({"scale": float("inf")}, "scale must be finite"),
])
def test_tuning_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mla_decode_attention(**_valid_args(), **kwargs)


# --------------------------------------------------------------------------- ahead of time


def test_aot_variants_match_the_plan():
    variants = {v["name"]: v for v in kernels_mla.aot_variants()}
    lite = variants["mla/fp16/h16/r512/p64/bs16/bn32/s1"]  # DeepSeek-V2-Lite
    plan = _mla_plan(1, 16, 128, 512, 64, torch.float16, torch.device("cuda"), None, None, 1,
                     None, None, None, None)
    assert lite["constexprs"] == {**plan.meta, "BLOCK_SIZE": 16, "TILE_IN_BLOCK": False}
    assert lite["constexprs"]["USE_DOT"] and lite["constexprs"]["BLOCK_H"] == 16
    assert lite["num_warps"] == plan.num_warps == 8
    assert "mla/fp16/h16/r512/p64/bs16/bn32/s4" in variants and "combine/fp16/d512/s4" in variants
    for v in variants.values():
        sig, cx = v["signature"], v["constexprs"]
        assert list(sig) == v["fn"].arg_names
        assert {n for n, t in sig.items() if t == "constexpr"} == set(cx)
    assert lite["signature"]["c_kv_ptr"] == "*fp16" and lite["signature"]["qk_scale"] == "fp32"


def test_page_strided_latent_matches_flat():
    """The latent as pages of a hybrid pool: ``[num_blocks, block_size, width]`` views with
    poisoned padding between blocks give the flat cache's answer."""
    args = make_case([5, 13, 20], 4, 2, 8, 32, 16, 8, torch.float32)
    joint = torch.cat([args["c_kv"], args["k_pe"]], dim=1)          # [slots, 48]
    num_blocks = joint.shape[0] // 4
    raw = torch.full((num_blocks * (4 * 48 + 16),), float("nan"), device=DEVICE)
    pages = raw.as_strided((num_blocks, 4, 48), (4 * 48 + 16, 48, 1))
    pages.copy_(joint.view(num_blocks, 4, 48))
    got = mla_decode_attention(**{**args, "c_kv": pages[..., :32], "k_pe": pages[..., 32:]}, block_n=4)
    assert_close(got, mla_decode_attention_ref(**args))
    with pytest.raises(ValueError, match="3-d c_kv and k_pe"):
        mla_decode_attention(**{**args, "c_kv": pages[..., :32], "k_pe": args["k_pe"]})
