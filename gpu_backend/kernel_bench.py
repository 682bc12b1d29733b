"""Decode-attention kernel benchmark: achieved GB/s of contiguous vs paged against copy bandwidth.

Decode attention reads every stored K/V token once per step and does little math per
byte, so it is bandwidth bound; the figure of merit is bytes moved / time, compared
with what a plain device copy achieves::

    bytes = (2 * sum(seq_lens) * num_kv_heads * head_dim      K and V of every token
             + 2 * batch * num_q_heads * head_dim) * itemsize  q read, out written

Each case builds one pool of ``batch * ceil(context / block_size)`` blocks. The paged
kernel reads it through shuffled block tables (so consecutive positions land in
scattered blocks); the contiguous kernel reads the same pool as one run of slots per
sequence. Both are checked against the PyTorch reference on a few sequences before
timing. Timing needs CUDA; case construction and byte accounting run anywhere.

    python -m gpu_backend.kernel_bench --batches 1,16,64 --contexts 512,2048,8192
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpu_backend.kernels import contiguous_decode_attention, paged_decode_attention
from gpu_backend.reference import contiguous_decode_attention_ref, paged_decode_attention_ref

_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class DecodeCase:
    """One decode step over a pool filled with random K/V.

    The pool holds ``batch * blocks_per_seq`` blocks of ``block_size`` slots; sequence
    i owns slots ``seq_offsets[i] + [0, context)`` in the contiguous view, and the
    blocks ``block_tables[i]`` (a random permutation of all blocks, cut in rows) in the
    paged view.
    """

    q: torch.Tensor  # [batch, num_q_heads, head_dim]
    k_cache: torch.Tensor  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    seq_lens: torch.Tensor  # int32 [batch]
    seq_offsets: torch.Tensor  # int32 [batch]
    block_tables: torch.Tensor  # int32 [batch, blocks_per_seq]
    block_size: int

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    def run(self, layout: str, out: torch.Tensor | None = None, **kernel_kwargs: Any) -> torch.Tensor:
        """Run the ``"contiguous"`` or ``"paged"`` kernel on this case."""
        if layout == "contiguous":
            return contiguous_decode_attention(self.q, self.k_cache, self.v_cache, self.seq_offsets,
                                               self.seq_lens, out=out, **kernel_kwargs)
        if layout == "paged":
            return paged_decode_attention(self.q, self.k_cache, self.v_cache, self.block_tables,
                                          self.seq_lens, self.block_size, out=out, **kernel_kwargs)
        raise ValueError(f"layout must be 'contiguous' or 'paged', got {layout!r}")

    def reference(self, layout: str, rows: Sequence[int]) -> torch.Tensor:
        """The PyTorch reference for the sequences ``rows``."""
        idx = torch.as_tensor(list(rows), device=self.q.device, dtype=torch.long)
        if layout == "contiguous":
            return contiguous_decode_attention_ref(self.q[idx], self.k_cache, self.v_cache,
                                                   self.seq_offsets[idx], self.seq_lens[idx])
        return paged_decode_attention_ref(self.q[idx], self.k_cache, self.v_cache,
                                          self.block_tables[idx], self.seq_lens[idx],
                                          self.block_size)


def make_decode_case(
    batch: int,
    context: int,
    num_q_heads: int = 32,
    num_kv_heads: int = 32,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = torch.float16,
    device: str | torch.device = "cuda",
    seed: int = 0,
) -> DecodeCase:
    """A pool exactly big enough for ``batch`` sequences of ``context`` tokens."""
    if batch < 1 or context < 1:
        raise ValueError(f"batch and context must be >= 1, got batch={batch}, context={context}")
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    num_slots = num_blocks * block_size

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    perm = torch.randperm(num_blocks, generator=gen, device=device)
    return DecodeCase(
        q=randn(batch, num_q_heads, head_dim),
        k_cache=randn(num_slots, num_kv_heads, head_dim),
        v_cache=randn(num_slots, num_kv_heads, head_dim),
        seq_lens=torch.full((batch,), context, device=device, dtype=torch.int32),
        seq_offsets=(torch.arange(batch, device=device) * blocks_per_seq * block_size).int(),
        block_tables=perm.view(batch, blocks_per_seq).int(),
        block_size=block_size,
    )


def decode_bytes(case: DecodeCase) -> int:
    """Bytes a decode step must move: K+V of every token, q read and out written."""
    _, num_q_heads, head_dim = case.q.shape
    num_kv_heads = case.k_cache.shape[1]
    itemsize = case.q.element_size()
    tokens = int(case.seq_lens.sum())
    return (2 * tokens * num_kv_heads + 2 * case.batch * num_q_heads) * head_dim * itemsize


def check_case(case: DecodeCase, layout: str, out: torch.Tensor, rows: Sequence[int] = (0, -1),
               atol: float = 1e-2, rtol: float = 1e-2) -> float:
    """Compare ``out`` (a kernel's output for ``case``) with the reference on ``rows``.

    Returns the largest absolute error; raises AssertionError if not allclose.
    """
    rows = sorted({r % case.batch for r in rows})
    ref = case.reference(layout, rows)
    got = out[torch.as_tensor(rows, device=out.device)]
    err = float((got.float() - ref.float()).abs().max())
    if not torch.allclose(got.float(), ref.float(), atol=atol, rtol=rtol):
        raise AssertionError(f"{layout} kernel differs from the reference on rows {rows}: "
                             f"max abs error {err}")
    return err


def _require_cuda(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"kernel timing needs a CUDA device, got {device} "
                           f"(cuda available: {torch.cuda.is_available()})")
    return device


def copy_bandwidth_gbps(device: str | torch.device = "cuda", nbytes: int = 2 << 30) -> float:
    """Device copy bandwidth in GB/s (1e9 bytes): (bytes read + bytes written) / time."""
    import triton.testing

    device = _require_cuda(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9


def bench_decode_attention(
    device: str | torch.device = "cuda",
    batches: Sequence[int] = (1, 16, 64),
    contexts: Sequence[int] = (512, 2048, 8192),
    num_q_heads: int = 32,
    num_kv_heads: int = 32,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = torch.float16,
    kernel_kwargs: Mapping[str, Any] | None = None,
    copy_gbps: float | None = None,
) -> list[dict[str, Any]]:
    """Time both kernels on every (batch, context); one row per (case, layout).

    ``kernel_kwargs`` go to both kernels (``num_splits``, ``block_n``, ``use_dot``,
    ``num_warps``). Rows: batch, context, layout, ms, bytes, gbps, copy_gbps,
    frac_of_copy, max_err.
    """
    import triton.testing

    device = _require_cuda(device)
    kwargs = {**(kernel_kwargs or {}), "validate": False}
    if copy_gbps is None:
        copy_gbps = copy_bandwidth_gbps(device)
    rows: list[dict[str, Any]] = []
    for batch in batches:
        for context in contexts:
            case = make_decode_case(batch, context, num_q_heads, num_kv_heads, head_dim,
                                    block_size, dtype, device)
            nbytes = decode_bytes(case)
            for layout in ("contiguous", "paged"):
                out = torch.empty_like(case.q)
                case.run(layout, out=out, **kwargs)
                err = check_case(case, layout, out)
                ms = triton.testing.do_bench(lambda c=case, lay=layout, o=out: c.run(lay, o, **kwargs),
                                             return_mode="median")
                gbps = nbytes / (ms * 1e-3) / 1e9
                rows.append({"batch": batch, "context": context, "layout": layout, "ms": ms,
                             "bytes": nbytes, "gbps": gbps, "copy_gbps": copy_gbps,
                             "frac_of_copy": gbps / copy_gbps, "max_err": err})
            del case
            torch.cuda.empty_cache()
    return rows


def sweep_decode_attention(
    device: str | torch.device = "cuda",
    cases: Sequence[tuple[int, int]] = ((64, 2048), (16, 8192)),
    layouts: Sequence[str] = ("paged", "contiguous"),
    grid: Mapping[str, Sequence[Any]] | None = None,
    copy_gbps: float | None = None,
    **shape: Any,
) -> list[dict[str, Any]]:
    """Every combination of the kernels' knobs in ``grid`` (default: ``block_n``,
    ``num_warps``, ``num_stages``, ``num_splits``) on each (batch, context) of
    ``cases``: one row per (case, layout, knobs), as :func:`bench_decode_attention`'s
    rows with the knobs added. ``shape`` goes to :func:`make_decode_case`. A
    combination the compiler rejects is a row with ``error`` set."""
    import itertools

    import triton.testing

    device = _require_cuda(device)
    grid = dict(grid or {"block_n": (32, 64, 128), "num_warps": (4, 8),
                         "num_stages": (2, 3, 4), "num_splits": (None, 2)})
    copy_gbps = copy_bandwidth_gbps(device) if copy_gbps is None else copy_gbps
    rows: list[dict[str, Any]] = []
    for batch, context in cases:
        case = make_decode_case(batch, context, device=device, **shape)
        nbytes = decode_bytes(case)
        for layout in layouts:
            for values in itertools.product(*grid.values()):
                knobs = {**dict(zip(grid, values, strict=True)), "validate": False}
                row: dict[str, Any] = {"batch": batch, "context": context, "layout": layout,
                                       **{k: v for k, v in knobs.items() if k != "validate"}}
                try:
                    out = torch.empty_like(case.q)
                    case.run(layout, out=out, **knobs)
                    row["max_err"] = check_case(case, layout, out)
                    ms = triton.testing.do_bench(
                        lambda c=case, lay=layout, o=out, kw=knobs: c.run(lay, o, **kw),
                        return_mode="median")
                except Exception as exc:  # noqa: BLE001 - a rejected combination is a row
                    rows.append({**row, "error": f"{type(exc).__name__}: {exc}"[:300]})
                    continue
                gbps = nbytes / (ms * 1e-3) / 1e9
                rows.append({**row, "ms": ms, "bytes": nbytes, "gbps": gbps, "copy_gbps": copy_gbps,
                             "frac_of_copy": gbps / copy_gbps})
        del case
        torch.cuda.empty_cache()
    return rows


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Fixed-width table; ``paged/contig`` is the paged row's GB/s over its contiguous twin."""
    contig = {(r["batch"], r["context"]): r["gbps"] for r in rows if r["layout"] == "contiguous"}
    lines = [f"{'batch':>5} {'context':>7} {'layout':>10} {'ms':>9} {'MB':>9} {'GB/s':>8} "
             f"{'%copy':>6} {'paged/contig':>12} {'max_err':>8}"]
    for r in rows:
        ratio = ""
        if r["layout"] == "paged" and (r["batch"], r["context"]) in contig:
            ratio = f"{r['gbps'] / contig[r['batch'], r['context']]:.3f}"
        lines.append(f"{r['batch']:>5} {r['context']:>7} {r['layout']:>10} {r['ms']:>9.4f} "
                     f"{r['bytes'] / 1e6:>9.1f} {r['gbps']:>8.1f} {100 * r['frac_of_copy']:>5.1f}% "
                     f"{ratio:>12} {r['max_err']:>8.1e}")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", type=_int_list, default=[1, 16, 64])
    p.add_argument("--contexts", type=_int_list, default=[512, 2048, 8192])
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp16")
    p.add_argument("--num-splits", type=int, default=None, help="default: per-device heuristic")
    p.add_argument("--block-n", type=int, default=None)
    p.add_argument("--use-dot", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--num-warps", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    knobs = {"num_splits": args.num_splits, "block_n": args.block_n, "use_dot": args.use_dot,
             "num_warps": args.num_warps}
    rows = bench_decode_attention(
        args.device, args.batches, args.contexts, args.num_q_heads, args.num_kv_heads,
        args.head_dim, args.block_size, _DTYPES[args.dtype],
        kernel_kwargs={k: v for k, v in knobs.items() if v is not None})
    name = torch.cuda.get_device_name(torch.device(args.device))
    print(f"{name}: copy bandwidth {rows[0]['copy_gbps']:.0f} GB/s" if rows else name)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
