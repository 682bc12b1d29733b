"""Windowed and MLA decode attention over a hybrid pool's pages: GB/s against copy bandwidth.

The pool is laid out as vLLM's hybrid manager lays one layer's buffer: block ``b`` is
one page, K then V of its ``block_size`` tokens side by side, so the kernels read
``[num_blocks, block_size, kv_heads, head_dim]`` views whose block stride is the page
(twice the K block). Tables are shuffled blocks; for a sliding window or a chunk the
entries of blocks wholly before the window are −1, as after the manager freed them.
Bytes are what one decode step must move::

    bytes = (2 · attended tokens · kv_heads · head_dim      K and V read (MLA: the latent once)
             + 2 · batch · q_heads · head_dim) · itemsize   q read, out written

    attended tokens, per sequence of length L:  full L;  sliding min(W, L);
                                                chunked L − ((L − 1) // C) · C

Each case is checked against the PyTorch reference on two sequences before timing.
Timing needs CUDA; cases and byte counts build anywhere.

    python -m gpu_backend.window_bench             # the gpu_check cases, a table and JSON
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpu_backend.kernel_bench import _int_list, _require_cuda, copy_bandwidth_gbps
from gpu_backend.kernels_mla import mla_decode_attention
from gpu_backend.kernels_window import CHUNKED, FULL, SLIDING, windowed_decode_attention
from gpu_backend.reference import (
    chunked_local_decode_attention_ref,
    mla_decode_attention_ref,
    paged_decode_attention_ref,
    sliding_window_decode_attention_ref,
)

KINDS = {"full": FULL, "sliding": SLIDING, "chunked": CHUNKED}


@dataclass(frozen=True)
class WindowCase:
    kind: str                       # full, sliding, chunked, mla
    span: int                       # window or chunk (full, mla: unused)
    q: torch.Tensor                 # [batch, q_heads, head_dim] (mla: q_nope)
    k: torch.Tensor                 # [num_blocks, block_size, kv_heads, head_dim] page views
    v: torch.Tensor                 # (mla: k is the latent, v its rope part)
    tables: torch.Tensor            # int32 [batch, blocks_per_seq]
    seq_lens: torch.Tensor
    block_size: int
    extra: dict[str, torch.Tensor]  # mla: q_pe, w_uk, w_uv

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    def run(self) -> torch.Tensor:
        if self.kind == "mla":
            e = self.extra
            return mla_decode_attention(self.q, e["q_pe"], self.k, self.v, e["w_uk"], e["w_uv"],
                                        self.tables, self.seq_lens, self.block_size, validate=False)
        return windowed_decode_attention(self.q, self.k, self.v, self.tables, self.seq_lens,
                                         self.block_size, KINDS[self.kind], self.span, validate=False)

    def reference(self, rows: Sequence[int]) -> torch.Tensor:
        idx = torch.as_tensor(list(rows), device=self.q.device, dtype=torch.long)
        flat_k, flat_v = _flat(self.k), _flat(self.v)
        lens, tables = self.seq_lens[idx], self.tables[idx]
        if self.kind == "mla":
            e = self.extra
            return mla_decode_attention_ref(self.q[idx], e["q_pe"][idx], flat_k, flat_v, e["w_uk"],
                                            e["w_uv"], tables, lens, self.block_size)
        if self.kind == "sliding":
            return sliding_window_decode_attention_ref(self.q[idx], flat_k, flat_v, tables, lens,
                                                       self.block_size, self.span)
        if self.kind == "chunked":
            return chunked_local_decode_attention_ref(self.q[idx], flat_k, flat_v, tables, lens,
                                                      self.block_size, self.span)
        return paged_decode_attention_ref(self.q[idx], flat_k, flat_v, tables, lens, self.block_size)


def _flat(pages: torch.Tensor) -> torch.Tensor:
    """A copy of page views as a flat ``[num_slots, ...]`` cache (slot = block · B + offset)."""
    return pages.reshape(pages.shape[0] * pages.shape[1], *pages.shape[2:]).contiguous()


def attended(kind: str, span: int, seq_len: int) -> int:
    if kind == "sliding":
        return min(span, seq_len)
    if kind == "chunked":
        return seq_len - (seq_len - 1) // span * span
    return seq_len


def make_window_case(kind: str, batch: int, context: int, *, span: int = 128, num_q_heads: int = 64,
                     num_kv_heads: int = 8, head_dim: int = 64, block_size: int = 16,
                     kv_lora_rank: int = 512, rope_dim: int = 64, dtype: torch.dtype = torch.float16,
                     device: str | torch.device = "cuda", seed: int = 0) -> WindowCase:
    """``batch`` sequences of ``context`` tokens in one page-laid pool."""
    if kind not in (*KINDS, "mla"):
        raise ValueError(f"kind must be one of {', '.join((*KINDS, 'mla'))}, got {kind!r}")
    if batch < 1 or context < 1:
        raise ValueError(f"batch and context must be >= 1, got batch={batch}, context={context}")
    gen = torch.Generator(device=device).manual_seed(seed)
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).mul(scale).to(dtype)

    tables = torch.randperm(num_blocks, generator=gen, device=device).view(batch, per_seq).int()
    lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    if kind in ("sliding", "chunked"):
        start = context - attended(kind, span, context)
        tables[:, : start // block_size] = -1        # freed by the window
    extra: dict[str, torch.Tensor] = {}
    if kind == "mla":
        width = kv_lora_rank + rope_dim
        pages = randn(num_blocks, block_size, width)
        k, v = pages[..., :kv_lora_rank], pages[..., kv_lora_rank:]
        q = randn(batch, num_q_heads, head_dim)
        extra = {"q_pe": randn(batch, num_q_heads, rope_dim),
                 "w_uk": randn(num_q_heads, head_dim, kv_lora_rank, scale=head_dim ** -0.5),
                 "w_uv": randn(num_q_heads, kv_lora_rank, head_dim, scale=kv_lora_rank ** -0.5)}
    else:
        pages = randn(num_blocks, 2, block_size, num_kv_heads, head_dim)   # K | V per page
        k, v = pages[:, 0], pages[:, 1]
        q = randn(batch, num_q_heads, head_dim)
    return WindowCase(kind, span, q, k, v, tables, lens, block_size, extra)


def window_bytes(case: WindowCase) -> int:
    itemsize = case.q.element_size()
    tokens = sum(attended(case.kind, case.span, n) for n in case.seq_lens.tolist())
    if case.kind == "mla":
        width = case.k.shape[-1] + case.v.shape[-1]
        heads, dim = case.q.shape[1], case.extra["w_uv"].shape[-1]
        return (tokens * width + 2 * case.batch * heads * dim) * itemsize
    kv_heads, head_dim = case.k.shape[2], case.k.shape[3]
    return (2 * tokens * kv_heads * head_dim + 2 * case.batch * case.q.shape[1] * head_dim) * itemsize


def check(case: WindowCase, out: torch.Tensor, atol: float = 1e-2, rtol: float = 1e-2) -> float:
    rows = sorted({0, case.batch - 1})
    want = case.reference(rows)
    got = out[torch.as_tensor(rows, device=out.device)]
    err = float((got.float() - want.float()).abs().max())
    if not torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol):
        raise AssertionError(f"{case.kind} kernel differs from the reference: max abs error {err}")
    return err


#: (kind, span, model shape): gpt-oss's sliding 128 and full layers, Llama 4's 8,192-token
#: chunks, Gemma 3's 1,024 window, DeepSeek-V2-Lite's MLA latent
CASES: list[tuple[str, int, dict[str, Any]]] = [
    ("sliding", 128, {"num_q_heads": 64, "num_kv_heads": 8, "head_dim": 64}),
    ("full", 0, {"num_q_heads": 64, "num_kv_heads": 8, "head_dim": 64}),
    ("sliding", 1024, {"num_q_heads": 32, "num_kv_heads": 16, "head_dim": 128}),
    ("chunked", 8192, {"num_q_heads": 40, "num_kv_heads": 8, "head_dim": 128}),
    ("mla", 0, {"num_q_heads": 16, "head_dim": 128, "kv_lora_rank": 512, "rope_dim": 64}),
]


def bench_window_attention(device: str | torch.device = "cuda", batches: Sequence[int] = (16, 64),
                           contexts: Sequence[int] = (2048, 8192, 12000),
                           cases: Sequence[tuple[str, int, dict[str, Any]]] = tuple(CASES),
                           copy_gbps: float | None = None) -> list[dict[str, Any]]:
    """One row per (kind, batch, context): ms, bytes, gbps, frac_of_copy, max_err."""
    import triton.testing

    device = _require_cuda(device)
    copy_gbps = copy_bandwidth_gbps(device) if copy_gbps is None else copy_gbps
    rows: list[dict[str, Any]] = []
    for kind, span, shape in cases:
        for batch in batches:
            for context in contexts:
                case = make_window_case(kind, batch, context, span=span or 1, device=device, **shape)
                out = case.run()
                err = check(case, out)
                ms = triton.testing.do_bench(case.run, return_mode="median")
                nbytes = window_bytes(case)
                gbps = nbytes / (ms * 1e-3) / 1e9
                rows.append({"kind": kind, "span": span, "batch": batch, "context": context, "ms": ms,
                             "bytes": nbytes, "gbps": gbps, "copy_gbps": copy_gbps,
                             "frac_of_copy": gbps / copy_gbps, "max_err": err})
                del case, out
                torch.cuda.empty_cache()
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'kind':>8} {'span':>6} {'batch':>5} {'context':>7} {'ms':>8} {'MB':>9} {'GB/s':>8} "
             f"{'%copy':>6} {'max_err':>8}"]
    for r in rows:
        lines.append(f"{r['kind']:>8} {r['span'] or '-':>6} {r['batch']:>5} {r['context']:>7} "
                     f"{r['ms']:>8.4f} {r['bytes'] / 1e6:>9.1f} {r['gbps']:>8.1f} "
                     f"{100 * r['frac_of_copy']:>5.1f}% {r['max_err']:>8.1e}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=_int_list, default=[16, 64], help="comma list (default 16,64)")
    p.add_argument("--contexts", type=_int_list, default=[2048, 8192, 12000],
                   help="comma list (default 2048,8192,12000)")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    rows = bench_window_attention(batches=args.batches, contexts=args.contexts)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

