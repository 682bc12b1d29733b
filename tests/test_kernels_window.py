"""Sliding-window and chunked-local decode attention against the PyTorch references.

Without CUDA the kernels run through Triton's interpreter (conftest switches it on), so
shapes stay tiny. The freed-block tests put -1 or poison (NaN, inf, another sequence's
blocks) in the table entries before each window: the output must not change.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton", reason="the GPU backend's kernels need triton")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gpu_backend import kernels_window  # noqa: E402
from gpu_backend.kernels import _plan, paged_decode_attention  # noqa: E402
from gpu_backend.kernels_window import (  # noqa: E402
    CHUNKED,
    FULL,
    SLIDING,
    chunked_local_decode_attention,
    sliding_window_decode_attention,
    windowed_decode_attention,
)
from gpu_backend.reference import (  # noqa: E402
    chunked_local_decode_attention_ref,
    paged_decode_attention_ref,
    sliding_window_decode_attention_ref,
    window_start,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda"
TOL = {torch.float16: {"atol": 1e-2, "rtol": 2e-3}, torch.float32: {"atol": 1e-5, "rtol": 1e-5}}
KERNELS = {"sliding": (sliding_window_decode_attention, sliding_window_decode_attention_ref),
           "chunked": (chunked_local_decode_attention, chunked_local_decode_attention_ref)}


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def make_case(seq_lens: list[int], block_size: int, num_q_heads: int, num_kv_heads: int,
              head_dim: int, dtype: torch.dtype, spare_blocks: int = 2, seed: int = 0):
    """q, K/V pool, a table of distinct shuffled blocks (padding -1) and the lengths."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    k = randn(num_blocks * block_size, num_kv_heads, head_dim, dtype=dtype, seed=seed)
    v = randn(num_blocks * block_size, num_kv_heads, head_dim, dtype=dtype, seed=seed + 1)
    q = randn(len(seq_lens), num_q_heads, head_dim, dtype=dtype, seed=seed + 2)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.full((len(seq_lens), max(needed) + 1), -1, dtype=torch.int32)
    for i, n in enumerate(needed):
        table[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k, v, table.to(DEVICE), lens


def leading_blocks(seq_len: int, block_size: int, start: int) -> range:
    """Table columns of the blocks that end at or before ``start`` (wholly out of window)."""
    return range(min(start // block_size, -(-seq_len // block_size)))


def starts(kind: str, seq_lens: list[int], span: int) -> list[int]:
    return [window_start(n, window=span) if kind == "sliding" else window_start(n, chunk=span)
            for n in seq_lens]


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[want.dtype])


# (dtype, num_q_heads, num_kv_heads, head_dim, block_size, seq_lens, span, block_n, use_dot,
# num_splits): groups 1/3/4/8, head_dim 24 and 80, block sizes 1/3/16, lengths 1 and
# multiples of the block and chunk, spans below, at and above the lengths and not
# multiples of the block size; each runs as a sliding window and as a chunk.
CASES = [
    (torch.float16, 8, 1, 24, 16, [1, 16, 32, 40], 16, 16, True, 1),
    (torch.float32, 3, 1, 80, 3, [1, 5, 6, 13], 5, 4, False, 1),
    (torch.float32, 4, 1, 24, 1, [1, 7, 9], 7, 4, False, 3),
    (torch.float16, 2, 2, 24, 3, [2, 9, 30], 50, 16, False, 2),
    (torch.float16, 6, 2, 24, 16, [1, 33, 47], 20, 16, True, 4),
    (torch.float32, 8, 1, 80, 16, [16, 48], 32, 16, True, 2),
]
CASE_IDS = [f"{str(c[0])[6:]}-g{c[1] // c[2]}-d{c[3]}-bs{c[4]}-w{c[6]}-s{c[9]}" for c in CASES]


@pytest.mark.parametrize("kind", ["sliding", "chunked"])
@pytest.mark.parametrize(("dtype", "num_q_heads", "num_kv_heads", "head_dim", "block_size",
                          "seq_lens", "span", "block_n", "use_dot", "num_splits"), CASES,
                         ids=CASE_IDS)
def test_matches_reference(kind, dtype, num_q_heads, num_kv_heads, head_dim, block_size,
                           seq_lens, span, block_n, use_dot, num_splits):
    kernel, ref = KERNELS[kind]
    q, k, v, table, lens = make_case(seq_lens, block_size, num_q_heads, num_kv_heads, head_dim,
                                     dtype)
    out = kernel(q, k, v, table, lens, block_size, span, block_n=block_n, use_dot=use_dot,
                 num_splits=num_splits)
    want = ref(q, k, v, table, lens, block_size, span)
    assert_close(out, want)
    # The window matters: one position less (within the longest sequence) shows.
    other = ref(q, k, v, table, lens, block_size, min(span, max(seq_lens)) - 1)
    assert not torch.allclose(out.float(), other.float(), **TOL[dtype])


def test_reference_windows():
    assert [window_start(n, window=4) for n in (1, 3, 4, 5, 9)] == [0, 0, 0, 1, 5]
    assert [window_start(n, chunk=4) for n in (1, 4, 5, 8, 9)] == [0, 0, 4, 4, 8]
    assert window_start(9) == 0


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN in the poisoned block
@pytest.mark.parametrize("kind", ["sliding", "chunked"])
@pytest.mark.parametrize("block_n", [4, 16], ids=["tile-spans-blocks", "tile-in-block"])
def test_freed_leading_blocks_are_never_read(kind, block_n):
    """Entries of blocks wholly before the window: -1, a NaN/inf block, another sequence's."""
    seq_lens, block_size, span, dtype = [5, 19, 37, 48], 4, 10, torch.float32
    kernel, ref = KERNELS[kind]
    q, k, v, table, lens = make_case(seq_lens, block_size, 4, 2, 24, dtype, spare_blocks=1)
    want = ref(q, k, v, table, lens, block_size, span)
    [poison] = set(range(k.shape[0] // block_size)) - set(table.flatten().tolist())
    # The spare block holds NaN and inf.
    k[poison * block_size:(poison + 1) * block_size] = float("nan")
    v[poison * block_size:(poison + 1) * block_size] = float("inf")
    freed_cols = [leading_blocks(n, block_size, s)
                  for n, s in zip(seq_lens, starts(kind, seq_lens, span), strict=True)]
    assert sum(map(len, freed_cols)) >= 5
    minus_one, poisoned, stolen = table.clone(), table.clone(), table.clone()
    for i, cols in enumerate(freed_cols):
        for col in cols:
            minus_one[i, col] = -1
            poisoned[i, col] = poison
            stolen[i, col] = table[(i + 1) % len(seq_lens), 0]  # reused by a neighbour
    for t in (minus_one, poisoned, stolen):
        out = kernel(q, k, v, t, lens, block_size, span, block_n=block_n, use_dot=False,
                     num_splits=2)
        assert_close(out, want)
    # The first block inside a window is read: poisoning it shows.
    seq = 3
    col = starts(kind, seq_lens, span)[seq] // block_size  # the block holding the start
    bad = minus_one.clone()
    bad[seq, col] = poison
    out = kernel(q, k, v, bad, lens, block_size, span, block_n=block_n, use_dot=False)
    assert out[seq].isnan().all() and not out[:seq].isnan().any()


def test_full_kind_and_wide_window_match_paged():
    seq_lens, block_size, dtype = [1, 15, 33], 3, torch.float16
    q, k, v, table, lens = make_case(seq_lens, block_size, 4, 1, 24, dtype)
    want = paged_decode_attention_ref(q, k, v, table, lens, block_size)
    full = windowed_decode_attention(q, k, v, table, lens, block_size, FULL, 0, block_n=16,
                                     num_splits=2)
    assert_close(full, want)
    assert_close(full, paged_decode_attention(q, k, v, table, lens, block_size, block_n=16,
                                              num_splits=2))
    assert_close(sliding_window_decode_attention(q, k, v, table, lens, block_size, 33,
                                                 block_n=16), want)
    assert_close(chunked_local_decode_attention(q, k, v, table, lens, block_size, 33,
                                                block_n=16), want)


def test_scale_out_and_strides():
    seq_lens, block_size, dtype = [7, 20], 4, torch.float32
    q, k, v, table, lens = make_case(seq_lens, block_size, 2, 1, 24, dtype)
    q = torch.cat([q, q], dim=-1)[:, :, 24:]  # head stride 48
    out = torch.zeros(2, 2, 24, dtype=dtype, device=DEVICE).transpose(0, 1)
    got = sliding_window_decode_attention(q, k, v, table, lens, block_size, 6, scale=0.3,
                                          out=out, block_n=4, use_dot=False)
    assert got is out
    assert_close(out, sliding_window_decode_attention_ref(q, k, v, table, lens, block_size, 6,
                                                          scale=0.3))


@settings(max_examples=10, deadline=None)
@given(
    seq_lens=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    block_size=st.sampled_from([1, 3, 4, 16]),
    span=st.integers(1, 45),
    kind=st.sampled_from(["sliding", "chunked"]),
    group=st.sampled_from([1, 3]),
    num_splits=st.integers(1, 3),
)
def test_random_shapes(seq_lens, block_size, span, kind, group, num_splits):
    kernel, ref = KERNELS[kind]
    q, k, v, table, lens = make_case(seq_lens, block_size, group, 1, 24, torch.float32,
                                     seed=len(seq_lens))
    for i, (n, s) in enumerate(zip(seq_lens, starts(kind, seq_lens, span), strict=True)):
        table[i, list(leading_blocks(n, block_size, s))] = -1
    out = kernel(q, k, v, table, lens, block_size, span, block_n=4, use_dot=False,
                 num_splits=num_splits)
    assert_close(out, ref(q, k, v, table, lens, block_size, span))


# --------------------------------------------------------------------------- validation


def _valid_args() -> dict:
    k, v = (randn(32, 2, 16, dtype=torch.float16, seed=s) for s in (0, 1))
    # Sequence 1 (length 8, window 3) attends to [5, 8): its first block is freed.
    return {"q": randn(2, 4, 16, dtype=torch.float16, seed=2), "k_cache": k, "v_cache": v,
            "block_tables": torch.tensor([[0, 1], [-1, 3]], dtype=torch.int32, device=DEVICE),
            "seq_lens": torch.tensor([5, 8], dtype=torch.int32, device=DEVICE),
            "block_size": 4, "window": 3}


def test_freed_entries_pass_validation():
    args = _valid_args()
    want = sliding_window_decode_attention_ref(**args)
    assert_close(sliding_window_decode_attention(**args, block_n=16), want)
    # Chunks of 3: sequence 0 attends to [3, 5) (blocks 0 and 1), sequence 1 to [6, 8).
    args["chunk"] = args.pop("window")
    want = chunked_local_decode_attention_ref(**args)
    assert_close(chunked_local_decode_attention(**args, block_n=16), want)
    args["block_tables"] = torch.tensor([[-1, 1], [-1, 3]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"inside the chunked window .*block_tables\[0, 0\]=-1"):
        chunked_local_decode_attention(**args)


WINDOW_ERRORS = [
    ("window", lambda a: 0, "window must be a positive int"),
    ("window", lambda a: True, "window must be a positive int"),
    ("window", lambda a: 2.0, "window must be a positive int"),
    ("window", lambda a: 5, r"inside the sliding window .* block_tables\[1, 0\]=-1"),
    ("block_tables", lambda a: a["block_tables"] + 7,
     r"point outside the pool, first block_tables\[0, 1\]=8.*num_slots=32"),
    ("block_tables", lambda a: a["block_tables"][:1], "block_tables must have shape"),
    ("block_tables", lambda a: a["block_tables"].long(), "block_tables must be int32"),
    ("block_tables", lambda a: a["block_tables"].t().contiguous().t(), "rows must be contig"),
    ("block_size", lambda a: 0, "block_size must be a positive int"),
    ("seq_lens", lambda a: a["seq_lens"] * 0, "seq_lens entry must be >= 1"),
    ("seq_lens", lambda a: a["seq_lens"] * 2, "need more than"),
    ("seq_lens", lambda a: a["seq_lens"][:1], r"seq_lens must have shape \[2\]"),
    ("q", lambda a: a["q"][:, :3].contiguous(), "multiple of num_kv_heads"),
    ("k_cache", lambda a: a["k_cache"].float(), "k_cache.dtype"),
]


@pytest.mark.parametrize(("field", "mutate", "message"), WINDOW_ERRORS,
                         ids=[f"{f}-{m[:18]}" for f, _, m in WINDOW_ERRORS])
def test_wrapper_rejects(field, mutate, message):
    args = _valid_args()
    args[field] = mutate(args)
    with pytest.raises(ValueError, match=message):
        sliding_window_decode_attention(**args)


def test_chunk_and_kind_rejected():
    args = _valid_args()
    args.pop("window")
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        chunked_local_decode_attention(**args, chunk=-2)
    with pytest.raises(ValueError, match="kind must be one of"):
        windowed_decode_attention(**args, kind=3, span=4)
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        windowed_decode_attention(**args, kind=SLIDING, span=4, num_splits=0)


# --------------------------------------------------------------------------- ahead of time


def test_aot_variants_cover_and_match_the_plan():
    variants = kernels_window.aot_variants()
    names = [v["name"] for v in variants]
    assert len(set(names)) == len(names)
    window = [v for v in variants if not v["name"].startswith("combine/")]
    assert len(window) == 32 and {n.split("/")[0] for n in names} == {"sliding", "chunked",
                                                                      "combine"}
    assert not any(v["constexprs"]["BLOCK_STRIDED"] for v in window)
    for v in variants:
        fn, sig, cx = v["fn"], v["signature"], v["constexprs"]
        assert list(sig) == fn.arg_names
        assert {n for n, t in sig.items() if t == "constexpr"} == set(cx)
        assert all(t in ("*fp16", "*fp32", "*i32", "i32", "fp32", "constexpr")
                   for t in sig.values())
        assert all(0 <= i < len(sig) and sig[fn.arg_names[i]] != "constexpr"
                   for (i,) in v["attrs"])
    v = next(v for v in window if v["name"] == "chunked/fp16/g8/d128/bs16/bn64/s4")
    q = torch.empty(1, 8, 128, dtype=torch.float16, device="meta")
    assert v["constexprs"] == {**_plan(q, 1, None, None, 4, None, None, 4).meta,
                               "BLOCK_SIZE": 16, "TILE_IN_BLOCK": False,
                               "WINDOW_KIND": CHUNKED, "BLOCK_STRIDED": False}
    assert v["signature"]["q_ptr"] == "*fp16" and v["signature"]["part_ptr"] == "*fp32"
    assert v["constexprs"]["USE_DOT"] and v["num_warps"] == 4
    # fp32 tl.dot at head_dim 128 takes 32-token tiles (64 spill on sm_80).
    assert "sliding/fp32/g8/d128/bs16/bn32/s1" in names
    assert "sliding/fp32/g1/d128/bs16/bn64/s1" in names


def paged_view(flat: torch.Tensor, block_size: int, page_pad: int, fill: float) -> torch.Tensor:
    """``flat [num_slots, heads, dim]`` copied into pages with ``page_pad`` poisoned
    elements after each block: a ``[num_blocks, block_size, heads, dim]`` view whose
    block stride is not ``block_size`` slots (a hybrid pool's page)."""
    num_slots, heads, dim = flat.shape
    num_blocks, per_block = num_slots // block_size, block_size * heads * dim
    raw = torch.full((num_blocks * (per_block + page_pad),), fill, dtype=flat.dtype, device=flat.device)
    view = raw.as_strided((num_blocks, block_size, heads, dim),
                          (per_block + page_pad, heads * dim, dim, 1))
    view.copy_(flat.view(num_blocks, block_size, heads, dim))
    return view


@pytest.mark.parametrize("kind", ["sliding", "chunked", "full"])
def test_page_strided_caches_match_flat(kind):
    """K and V as pages of a hybrid pool (a block stride, poisoned padding between
    blocks) give the flat cache's answer."""
    q, k, v, table, lens = make_case([1, 9, 23, 31], 4, 4, 2, 24, torch.float32, seed=3)
    span, code = 6, {"sliding": SLIDING, "chunked": CHUNKED, "full": FULL}[kind]
    k4, v4 = paged_view(k, 4, 40, float("nan")), paged_view(v, 4, 8, float("inf"))
    want = windowed_decode_attention(q, k, v, table, lens, 4, code, span, block_n=4, use_dot=False)
    got = windowed_decode_attention(q, k4, v4, table, lens, 4, code, span, block_n=4, use_dot=False,
                                    num_splits=2)
    assert_close(got, want)
    assert torch.isfinite(got).all()
    with pytest.raises(ValueError, match="block_size=8"):
        windowed_decode_attention(q, k4, v4, table, lens, 8, code, span)
