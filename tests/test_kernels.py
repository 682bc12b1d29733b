"""Decode-attention kernels against the PyTorch reference, on irregular sizes.

Without CUDA the kernels run through Triton's interpreter (conftest switches it on);
shapes stay tiny so the file runs in well under a minute. With
``FRAGSIM_TEST_CUDA=1`` on a CUDA machine the same tests run on the GPU.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton", reason="the GPU backend's kernels need triton")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gpu_backend import kernel_bench  # noqa: E402
from gpu_backend.kernels import contiguous_decode_attention, paged_decode_attention  # noqa: E402
from gpu_backend.reference import (  # noqa: E402
    contiguous_decode_attention_ref,
    gather_paged,
    paged_decode_attention_ref,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda"
TOL = {torch.float16: {"atol": 1e-2, "rtol": 2e-3}, torch.float32: {"atol": 1e-5, "rtol": 1e-5}}


def make_pool(num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of layer 1 of a 2-layer pool [layers, slots, kv_heads, head_dim], as the backend has."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(2, num_slots, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
            for _ in range(2))
    return k[1], v[1]


def make_query(batch: int, num_q_heads: int, head_dim: int, dtype: torch.dtype,
               seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, num_q_heads, head_dim, generator=gen).to(DEVICE, dtype)


def scattered_block_tables(seq_lens: list[int], block_size: int, num_blocks: int, pad: int = -1,
                           seed: int = 2) -> torch.Tensor:
    """Rows of distinct random blocks; unused entries hold ``pad``."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    needed = [-(-n // block_size) for n in seq_lens]
    assert sum(needed) <= num_blocks
    table = torch.full((len(seq_lens), max(needed) + 1), pad, dtype=torch.int32)
    for i, n in enumerate(needed):
        table[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    return table.to(DEVICE)


def lens_tensor(seq_lens: list[int]) -> torch.Tensor:
    return torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[want.dtype])


# (dtype, num_q_heads, num_kv_heads, head_dim, block_size, seq_lens): MHA and GQA x2/x4,
# lengths 1, block_size - 1, block_size, block_size + 1 and mixed, head_dim 24 padded to 32.
CASES = [
    (torch.float16, 2, 2, 16, 16, [1, 15, 16, 17]),
    (torch.float16, 4, 2, 16, 4, [1, 3, 4, 5, 40]),
    (torch.float16, 8, 2, 24, 16, [1, 15, 17, 40]),
    (torch.float32, 2, 2, 24, 1, [1, 2, 20]),
    (torch.float32, 4, 1, 16, 16, [17, 1, 40, 16]),
    (torch.float32, 4, 2, 16, 12, [1, 11, 12, 13, 30]),  # block_size not a power of two
    (torch.float16, 2, 1, 16, 32, [1, 31, 32, 33, 70]),  # a block holds two 16-token tiles
]
CASE_IDS = [f"{str(c[0])[6:]}-hq{c[1]}-hkv{c[2]}-d{c[3]}-bs{c[4]}" for c in CASES]


@pytest.mark.parametrize("use_dot", [False, True], ids=["sum", "dot"])
@pytest.mark.parametrize(("dtype", "num_q_heads", "num_kv_heads", "head_dim", "block_size",
                          "seq_lens"), CASES, ids=CASE_IDS)
def test_paged_matches_reference(dtype, num_q_heads, num_kv_heads, head_dim, block_size,
                                 seq_lens, use_dot):
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    k, v = make_pool(num_blocks * block_size, num_kv_heads, head_dim, dtype)
    q = make_query(len(seq_lens), num_q_heads, head_dim, dtype)
    table = scattered_block_tables(seq_lens, block_size, num_blocks)
    lens = lens_tensor(seq_lens)
    out = paged_decode_attention(q, k, v, table, lens, block_size, block_n=16, use_dot=use_dot)
    assert_close(out, paged_decode_attention_ref(q, k, v, table, lens, block_size))


@pytest.mark.parametrize("use_dot", [False, True], ids=["sum", "dot"])
@pytest.mark.parametrize(("dtype", "num_q_heads", "num_kv_heads", "head_dim", "block_size",
                          "seq_lens"), CASES, ids=CASE_IDS)
def test_contiguous_matches_reference(dtype, num_q_heads, num_kv_heads, head_dim, block_size,
                                      seq_lens, use_dot):
    # Runs in reverse order with gaps: offsets non-zero and not sorted by sequence.
    offsets, end = [], 5
    for n in reversed(seq_lens):
        offsets.insert(0, end)
        end += n + 3
    k, v = make_pool(end + 2, num_kv_heads, head_dim, dtype)
    q = make_query(len(seq_lens), num_q_heads, head_dim, dtype)
    offs, lens = lens_tensor(offsets), lens_tensor(seq_lens)
    out = contiguous_decode_attention(q, k, v, offs, lens, block_n=16, use_dot=use_dot)
    assert_close(out, contiguous_decode_attention_ref(q, k, v, offs, lens))


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_split_k_matches_reference(num_splits, dtype):
    # 7 splits of whole 16-token tiles leave the short sequences' last splits empty.
    seq_lens, block_size = [1, 17, 40, 100], 4
    num_blocks = sum(-(-n // block_size) for n in seq_lens)
    k, v = make_pool(num_blocks * block_size, 2, 16, dtype)
    q = make_query(len(seq_lens), 4, 16, dtype)
    table, lens = scattered_block_tables(seq_lens, block_size, num_blocks), lens_tensor(seq_lens)
    out = paged_decode_attention(q, k, v, table, lens, block_size, block_n=16,
                                 num_splits=num_splits)
    assert_close(out, paged_decode_attention_ref(q, k, v, table, lens, block_size))
    offs = lens_tensor([0, 1, 18, 58])
    out = contiguous_decode_attention(q, k, v, offs, lens, block_n=16, num_splits=num_splits)
    assert_close(out, contiguous_decode_attention_ref(q, k, v, offs, lens))


def test_default_tuning_scale_and_strides():
    """Default block_n (64), a custom scale, strided q and out, and the int32 -> int64 slot math."""
    seq_lens, block_size, dtype = [1, 65, 130], 16, torch.float32
    num_blocks = sum(-(-n // block_size) for n in seq_lens)
    k, v = make_pool(num_blocks * block_size, 1, 16, dtype)
    q = make_query(3, 2, 32, dtype)[:, :, 8:24]  # head stride 32, not 16
    out = torch.zeros(2, 3, 16, dtype=dtype, device=DEVICE).transpose(0, 1)
    table, lens = scattered_block_tables(seq_lens, block_size, num_blocks), lens_tensor(seq_lens)
    got = paged_decode_attention(q, k, v, table, lens, block_size, scale=0.3, out=out)
    assert got is out
    assert_close(out, paged_decode_attention_ref(q, k, v, table, lens, block_size, scale=0.3))
    offs = lens_tensor([0, 1, 66])
    got = contiguous_decode_attention(q, k, v, offs, lens, scale=0.3, out=out)
    assert_close(out, contiguous_decode_attention_ref(q, k, v, offs, lens, scale=0.3))


def test_padding_entries_are_never_read():
    """Entries past a sequence's blocks may hold anything, even ids far outside the pool."""
    seq_lens, block_size, dtype = [5, 8, 3], 4, torch.float32
    k, v = make_pool(6 * block_size, 1, 16, dtype)
    q = make_query(3, 1, 16, dtype)
    table = torch.tensor([[4, 0, 1 << 30, -7], [2, 5, 1 << 30, 1 << 30], [3, -1, -1, -1]],
                         dtype=torch.int32, device=DEVICE)
    lens = lens_tensor(seq_lens)
    out = paged_decode_attention(q, k, v, table, lens, block_size, block_n=16)
    assert_close(out, paged_decode_attention_ref(q, k, v, table, lens, block_size))


def test_corrupted_block_table_gives_wrong_answer():
    """An entry pointing at another sequence's block (a double allocation) must show up."""
    seq_lens, block_size, dtype = [8, 8, 8], 4, torch.float16
    k, v = make_pool(6 * block_size, 2, 16, dtype)
    q = make_query(3, 2, 16, dtype)
    table = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32, device=DEVICE)
    lens = lens_tensor(seq_lens)
    truth = paged_decode_attention_ref(q, k, v, table, lens, block_size)

    corrupt = table.clone()
    corrupt[1, 1] = 4  # sequence 1's second block now aliases sequence 2's first
    out = paged_decode_attention(q, k, v, corrupt, lens, block_size, block_n=16)
    assert_close(out[[0, 2]], truth[[0, 2]])
    assert not torch.allclose(out[1].float(), truth[1].float(), **TOL[dtype])
    assert_close(out, paged_decode_attention_ref(q, k, v, corrupt, lens, block_size))


def test_gather_paged_walks_the_block_table():
    cache = torch.arange(12).view(12, 1, 1)
    table = torch.tensor([2, 0, -1], dtype=torch.int32)
    assert gather_paged(cache, table, 6, 4).flatten().tolist() == [8, 9, 10, 11, 0, 1]


@settings(max_examples=8, deadline=None)
@given(
    seq_lens=st.lists(st.integers(1, 50), min_size=1, max_size=3),
    block_size=st.sampled_from([1, 2, 8, 16, 32]),
    group=st.sampled_from([1, 2, 4]),
    num_splits=st.integers(1, 3),
)
def test_paged_random_shapes(seq_lens, block_size, group, num_splits):
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 1
    k, v = make_pool(num_blocks * block_size, 1, 16, torch.float32, seed=len(seq_lens))
    q = make_query(len(seq_lens), group, 16, torch.float32)
    table = scattered_block_tables(seq_lens, block_size, num_blocks, seed=block_size)
    lens = lens_tensor(seq_lens)
    out = paged_decode_attention(q, k, v, table, lens, block_size, block_n=16,
                                 num_splits=num_splits)
    assert_close(out, paged_decode_attention_ref(q, k, v, table, lens, block_size))


def test_empty_batch():
    k, v = make_pool(8, 1, 16, torch.float16)
    q = make_query(0, 1, 16, torch.float16)
    empty = lens_tensor([])
    assert paged_decode_attention(q, k, v, empty.view(0, 1), empty, 4).shape == (0, 1, 16)
    assert contiguous_decode_attention(q, k, v, empty, empty).shape == (0, 1, 16)


# --------------------------------------------------------------------------- validation


def _valid_paged_args() -> dict:
    k, v = make_pool(32, 2, 16, torch.float16)
    return {"q": make_query(2, 4, 16, torch.float16), "k_cache": k, "v_cache": v,
            "block_tables": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE),
            "seq_lens": lens_tensor([5, 8]), "block_size": 4}


PAGED_ERRORS = [
    ("q", lambda a: a["q"][0], "q must be"),
    ("q", lambda a: a["q"].to(torch.bfloat16), "dtype must be one of"),
    ("k_cache", lambda a: a["k_cache"].float(), "k_cache.dtype"),
    ("v_cache", lambda a: a["v_cache"][:16], "v_cache shape"),
    ("q", lambda a: a["q"][:, :, :8].contiguous(), "head_dim differs"),
    ("q", lambda a: a["q"][:, :3].contiguous(), "multiple of num_kv_heads"),
    ("q", lambda a: a["q"].transpose(1, 2).contiguous().transpose(1, 2), "contiguous in its last"),
    ("seq_lens", lambda a: a["seq_lens"].long(), "seq_lens must be int32"),
    ("seq_lens", lambda a: a["seq_lens"][:1], r"seq_lens must have shape \[2\]"),
    ("seq_lens", lambda a: a["seq_lens"] * 0, "seq_lens entry must be >= 1"),
    ("seq_lens", lambda a: a["seq_lens"].to("meta"), "seq_lens is on meta"),
    ("seq_lens", lambda a: a["seq_lens"] * 2, "need more than"),
    ("block_tables", lambda a: a["block_tables"][:1], "block_tables must have shape"),
    ("block_tables", lambda a: a["block_tables"].t().contiguous().t(), "rows must be contig"),
    ("block_tables", lambda a: a["block_tables"] + 6, "point outside the pool"),
    ("block_tables", lambda a: a["block_tables"] - 1, "point outside the pool"),
    ("block_size", lambda a: 0, "block_size must be a positive int"),
    ("block_size", lambda a: 4.0, "block_size must be a positive int"),
]


@pytest.mark.parametrize(("field", "mutate", "message"), PAGED_ERRORS,
                         ids=[f"{f}-{m[:18]}" for f, _, m in PAGED_ERRORS])
def test_paged_wrapper_rejects(field, mutate, message):
    args = _valid_paged_args()
    args[field] = mutate(args)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"block_n": 24}, "block_n must be a power of two"),
    ({"block_n": 8, "use_dot": True}, "block_n must be a power of two"),
    ({"num_splits": 0}, "num_splits must be >= 1"),
    ({"scale": float("nan")}, "scale must be finite"),
    ({"out": torch.empty(2, 4, 8, dtype=torch.float16, device=DEVICE)}, "out shape"),
    ({"out": torch.empty(2, 4, 16, device=DEVICE)}, "out.dtype"),
])
def test_tuning_and_out_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**_valid_paged_args(), **kwargs)


@pytest.mark.parametrize(("offsets", "lens", "message"), [
    ([0, 30], [5, 8], "must lie in"),
    ([-1, 8], [5, 8], "must lie in"),
    ([0, 8], [5, 0], "seq_lens entry must be >= 1"),
    ([0], [5, 8], r"seq_offsets must have shape \[2\]"),
])
def test_contiguous_wrapper_rejects(offsets, lens, message):
    args = _valid_paged_args()
    with pytest.raises(ValueError, match=message):
        contiguous_decode_attention(args["q"], args["k_cache"], args["v_cache"],
                                    lens_tensor(offsets), lens_tensor(lens))


# --------------------------------------------------------------------------- benchmark helpers


def test_bench_case_layouts_and_bytes():
    case = kernel_bench.make_decode_case(batch=3, context=10, num_q_heads=4, num_kv_heads=2,
                                         head_dim=16, block_size=4, device=DEVICE)
    # 3 sequences x ceil(10 / 4) = 3 blocks: 9 blocks, 36 slots; each block used once.
    assert case.k_cache.shape == (36, 2, 16) and case.block_tables.shape == (3, 3)
    assert sorted(case.block_tables.flatten().tolist()) == list(range(9))
    assert case.seq_offsets.tolist() == [0, 12, 24] and case.seq_lens.tolist() == [10, 10, 10]
    # K+V: 2 x 30 tokens x 2 kv heads x 16 dims; q + out: 2 x 3 x 4 heads x 16; fp16 bytes.
    assert kernel_bench.decode_bytes(case) == (2 * 30 * 2 * 16 + 2 * 3 * 4 * 16) * 2 == 4608
    for layout in ("contiguous", "paged"):
        out = case.run(layout, block_n=16)
        assert kernel_bench.check_case(case, layout, out, rows=(0, 1, 2)) < 1e-2


def test_bench_timing_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: timing works here")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        kernel_bench.bench_decode_attention(device="cpu", batches=(1,), contexts=(16,))
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        kernel_bench.copy_bandwidth_gbps("cpu")


def test_bench_table_format():
    rows = [{"batch": 64, "context": 2048, "layout": lay, "ms": ms, "bytes": 2_000_000_000,
             "gbps": 2e9 / ms / 1e6, "copy_gbps": 4000.0, "frac_of_copy": 2e9 / ms / 1e6 / 4000,
             "max_err": 1e-3} for lay, ms in (("contiguous", 0.5), ("paged", 0.55))]
    table = kernel_bench.format_table(rows).splitlines()
    assert len(table) == 3 and table[0].split()[-2:] == ["paged/contig", "max_err"]
    assert table[2].split()[-2] == "0.909"  # 3636 / 4000 GB/s
    assert kernel_bench._parse_args(["--batches", "1,2", "--no-use-dot"]).batches == [1, 2]


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA only: real shapes and the benchmark path")
def test_cuda_llama_shapes_and_bench():
    case = kernel_bench.make_decode_case(batch=4, context=1000, device="cuda")
    for layout in ("contiguous", "paged"):
        kernel_bench.check_case(case, layout, case.run(layout), rows=range(4))
        kernel_bench.check_case(case, layout, case.run(layout, num_splits=5), rows=range(4))
    rows = kernel_bench.bench_decode_attention(batches=(2,), contexts=(300,), copy_gbps=1.0)
    assert [r["layout"] for r in rows] == ["contiguous", "paged"]
