"""The kernel launches the validator and the benchmarks make, recorded on meta tensors.

Each wrapper (:func:`gpu_backend.kernels.paged_decode_attention`, the windowed and MLA
ones) is called on ``device="meta"`` tensors of the shapes its caller uses, with the
module's kernels swapped for recorders: ``kernel[grid](*args, **kwargs)`` records
``(kernel, args, kwargs)`` instead of launching, so the planners decide every
constexpr as they would on a GPU. Split counts come from
``kernels._default_num_splits`` itself, answered for the SM counts of :data:`NUM_SMS`.
:func:`launches` is what :func:`gpu_backend.aot.variants` compiles.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from gpu_backend import kernel_bench, kernels

# SM counts the split heuristic sees: A100 for sm_80, H100/H200 for sm_90.
NUM_SMS = {"a100": 108, "h100": 132}
_DTYPE_NAMES = {torch.float16: "fp16", torch.float32: "fp32"}
#: (name, kernel, args, kwargs, used by): one recorded launch
Launch = tuple[str, Any, tuple[Any, ...], dict[str, Any], str]


def launches() -> list[Launch]:
    """Every recorded launch: the dense decode kernels', then the hybrid pool's."""
    return _decode_launches() + _hybrid_launches()


@dataclass(frozen=True)
class _Launches:
    """Launches of both layouts over one pool shape, one per split count."""

    used_by: str
    dtype: torch.dtype
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_splits: tuple[int, ...]
    max_len: int  # sets the block-table width
    block_n: int | None = None


def _decode_launches() -> list[Launch]:
    bench = {k: p.default for k, p in
             inspect.signature(kernel_bench.bench_decode_attention).parameters.items()}
    launches = [_Launches("kernel_bench", bench["dtype"], bench["num_q_heads"],
                          bench["num_kv_heads"], bench["head_dim"], bench["block_size"],
                          _cuda_splits(bench["num_kv_heads"], bench["batches"], bench["contexts"]),
                          max(bench["contexts"]))]
    for dtype in (torch.float16, torch.float32):
        # The validator on CUDA: the 13B-shaped pool of gpu_check and `fragsim validate`;
        # any running batch, lengths up to --max-seq-len 2048.
        launches.append(_Launches("validate --device cuda", dtype, 40, 40, 128, 16,
                                  _cuda_splits(40, range(1, 65), range(256, 2049, 256)), 2048))
        # The interpreter's shapes: `fragsim validate --device cpu` (lengths x 0.05) and
        # the split-K test.
        launches.append(_Launches("validate --device cpu", dtype, 4, 2, 16, 16, (1,), 103))
        launches.append(_Launches("tests/test_kernels.py", dtype, 4, 2, 16, 4, (2, 3, 7), 100,
                                  block_n=16))
    return [v for launch in launches for layout in ("paged", "contiguous")
            for num_splits in launch.num_splits for v in _record(launch, layout, num_splits)]


def _record(launch: _Launches, layout: str, num_splits: int) -> list[Launch]:
    """Call the layout's wrapper on meta tensors and turn its kernel launches into variants."""
    width = -(-launch.max_len // launch.block_size)  # block-table entries per sequence

    def meta(*size: int, dtype: torch.dtype = launch.dtype) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device="meta")

    q = meta(1, launch.num_q_heads, launch.head_dim)
    k_cache, v_cache = (meta(width * launch.block_size, launch.num_kv_heads, launch.head_dim)
                        for _ in range(2))
    lens = meta(1, dtype=torch.int32)
    with _recording(kernels) as launched:
        if layout == "paged":
            kernels.paged_decode_attention(q, k_cache, v_cache, meta(1, width, dtype=torch.int32),
                                           lens, launch.block_size, num_splits=num_splits,
                                           block_n=launch.block_n, validate=False)
        else:
            kernels.contiguous_decode_attention(q, k_cache, v_cache, lens, lens,
                                                num_splits=num_splits, block_n=launch.block_n,
                                                validate=False)
    dtype = _DTYPE_NAMES[launch.dtype]
    out = []
    for fn, args, kwargs in launched:
        name = f"combine/{dtype}/d{launch.head_dim}/s{num_splits}"
        if fn is not kernels._combine_splits_kernel:
            bs = f"/bs{launch.block_size}" if layout == "paged" else ""
            name = (f"{layout}/{dtype}/q{launch.num_q_heads}kv{launch.num_kv_heads}"
                    f"/d{launch.head_dim}{bs}/bn{kwargs['BLOCK_N']}/s{num_splits}")
        out.append((name, fn, args, kwargs, launch.used_by))
    return out


_KERNEL_NAMES = ("_paged_decode_kernel", "_contiguous_decode_kernel", "_combine_splits_kernel")


@contextlib.contextmanager
def _recording(module: ModuleType, names: Sequence[str] = _KERNEL_NAMES
               ) -> Iterator[list[tuple[Any, tuple[Any, ...], dict[str, Any]]]]:
    """Swap the module's kernels for recorders: ``kernel[grid](*args, **kwargs)`` appends
    ``(kernel, args, kwargs)`` instead of launching."""
    launches: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    class Recorder:
        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def __getitem__(self, grid: Any) -> Any:
            return lambda *args, **kwargs: launches.append((self.fn, args, kwargs))

    saved = {name: getattr(module, name) for name in names}
    try:
        for name, fn in saved.items():
            setattr(module, name, Recorder(fn))
        yield launches
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def _cuda_splits(num_kv_heads: int, batches: Iterable[int], contexts: Iterable[int]
                 ) -> tuple[int, ...]:
    """The split counts ``kernels._default_num_splits`` picks on the cards of NUM_SMS."""
    batches, contexts = list(batches), list(contexts)
    real = torch.cuda.get_device_properties
    found = set()
    try:
        for num_sms in NUM_SMS.values():
            # The heuristic asks torch for the SM count; answer for the card in question.
            setattr(torch.cuda, "get_device_properties",  # noqa: B010 - a module function
                    lambda device=None, n=num_sms: SimpleNamespace(multi_processor_count=n))
            found |= {kernels._default_num_splits(torch.device("cuda"), b * num_kv_heads, c)
                      for b in batches for c in contexts}
    finally:
        setattr(torch.cuda, "get_device_properties", real)  # noqa: B010
    return tuple(sorted(found))


# --------------------------------------------------------------------------- hybrid pools


def _hybrid_launches() -> list[Launch]:
    """The windowed and MLA kernels over a hybrid pool's pages, as the CUDA hybrid
    validator and the windowed-kernel benchmark launch them."""
    from gpu_backend import kernels_mla, kernels_window, window_bench
    from gpu_backend.validate import CUDA_HYBRID_SCALE, CUDA_HYBRID_SHAPES

    out: list[Launch] = []
    names = ("_window_decode_kernel",)
    # The validator: every attention kind over the miniature's pages, any running batch,
    # lengths up to max_seq_len 4096 × its scale; sliding rows read window − 1 of them.
    for _, shape, _ in CUDA_HYBRID_SHAPES:
        kv, head_dim, group = shape["num_kv_heads"], shape["head_dim"], shape["q_per_kv"]
        max_len = int(4096 * CUDA_HYBRID_SCALE)
        for kind in (kernels_window.FULL, kernels_window.SLIDING, kernels_window.CHUNKED):
            span = 1 if kind == kernels_window.FULL else max(2, round(128 * CUDA_HYBRID_SCALE))
            reads = [kernels_window._attended_len(kind, span, n) or n for n in range(16, max_len + 1, 16)]
            for s in _cuda_splits(kv, range(1, 65), reads):
                out += _record_window(kv * group, kv, head_dim, 16, kind, span, s, max_len,
                                      "hybrid validate --device cuda", names, "validate")
    # The benchmark: its cases, batches and contexts.
    bench = {k: p.default for k, p in inspect.signature(window_bench.bench_window_attention).parameters.items()}
    for kind_name, span, shape in window_bench.CASES:
        for context in bench["contexts"]:
            if kind_name == "mla":
                for s in _cuda_splits(1, bench["batches"], [context]):
                    out += _record_mla(shape, s, context, "window_bench", kernels_mla)
                continue
            kind = window_bench.KINDS[kind_name]
            read = kernels_window._attended_len(kind, span or 1, context) or context
            for s in _cuda_splits(shape["num_kv_heads"], bench["batches"], [read]):
                out += _record_window(shape["num_q_heads"], shape["num_kv_heads"], shape["head_dim"], 16,
                                      kind, span or 1, s, context, "window_bench", names, f"ctx{context}")
    return out


def _meta(*size: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype, device="meta")


def _record_window(q_heads: int, kv_heads: int, head_dim: int, block_size: int, kind: int, span: int,
                   num_splits: int, max_len: int, used_by: str, names: Sequence[str],
                   tag: str) -> list[Launch]:
    """One windowed launch over pages; ``tag`` tells apart launches whose block tables differ
    (their width's divisibility is specialised)."""
    from gpu_backend import kernels_window

    width = -(-max_len // block_size)
    pages = _meta(width, 2, block_size, kv_heads, head_dim)       # K | V in one page
    with _recording(kernels_window, names) as launched, _recording(kernels) as merged:
        kernels_window.windowed_decode_attention(
            _meta(1, q_heads, head_dim), pages[:, 0], pages[:, 1], _meta(1, width, dtype=torch.int32),
            _meta(1, dtype=torch.int32), block_size, kind, span, num_splits=num_splits, validate=False)
    out: list[Launch] = []
    for fn, args, kwargs in launched + merged:
        if fn is kernels._combine_splits_kernel:
            name = f"pages-combine/fp16/q{q_heads}/d{head_dim}/s{num_splits}/{tag}"
        else:
            kind_name = kernels_window._KIND_NAMES[kind]
            name = (f"{kind_name}/fp16/g{q_heads // kv_heads}/d{head_dim}/bs{block_size}"
                    f"/bn{kwargs['BLOCK_N']}/s{num_splits}-pages/{tag}")
        out.append((name, fn, args, kwargs, used_by))
    return out


def _record_mla(shape: dict[str, int], num_splits: int, context: int, used_by: str,
                kernels_mla: ModuleType) -> list[Launch]:
    heads, dim, rank, rope = shape["num_q_heads"], shape["head_dim"], shape["kv_lora_rank"], shape["rope_dim"]
    width = -(-context // 16)
    pages = _meta(width, 16, rank + rope)
    with _recording(kernels_mla, ("_mla_decode_kernel",)) as launched, _recording(kernels) as merged:
        kernels_mla.mla_decode_attention(
            _meta(1, heads, dim), _meta(1, heads, rope), pages[..., :rank], pages[..., rank:],
            _meta(heads, dim, rank), _meta(heads, rank, dim), _meta(1, width, dtype=torch.int32),
            _meta(1, dtype=torch.int32), 16, num_splits=num_splits, validate=False)
    out: list[Launch] = []
    for fn, args, kwargs in launched + merged:
        name = (f"pages-combine/fp16/q{heads}/d{rank}/s{num_splits}/ctx{context}"
                if fn is kernels._combine_splits_kernel else
                f"mla/fp16/h{heads}/r{rank}/p{rope}/bs16/bn{kwargs['BLOCK_N']}/s{num_splits}-pages/ctx{context}")
        out.append((name, fn, args, kwargs, used_by))
    return out
