"""Replay a slice of a trace on real memory and compare it with the simulation.

The simulator runs in exact-step mode with a :class:`~gpu_backend.backend.DeviceBackend`
attached; after every step the device's measured split must equal the simulated
one exactly, every stored token must hold its own K/V, and decode attention
through the Triton kernels must match the PyTorch reference.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from fragsim.simulate import RunSpec, load_workload, make_engine
from gpu_backend import POOL_REQUESTS


@dataclass(frozen=True)
class ModelShape:
    """The attention shape the pool is built with (a few layers of a real model)."""

    num_layers: int = 2
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    dtype: str = "float16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads ({self.num_q_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.dtype not in ("float16", "float32"):
            raise ValueError(f"dtype must be float16 or float32, got {self.dtype!r}")


class _Report:
    """What every validation report says of itself."""

    error: str | None
    table: list[dict[str, Any]]

    @property
    def ok(self) -> bool:
        return self.error is None and all(row["match"] for row in self.table)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)  # type: ignore[call-overload]
        out["ok"] = self.ok
        return out


@dataclass
class ValidationReport(_Report):
    allocator: str
    device: str
    num_requests: int
    capacity_slots: int
    steps_checked: int
    table: list[dict[str, Any]]
    attention_checks: int
    content_checks: int
    max_abs_error: float
    error: str | None
    wall_time_s: float


def scaled_trace(trace: Any, scale: float) -> Any:
    """Lengths × ``scale`` (at least 1 token each) and inter-arrival times × ``scale``, so the
    pool (also × ``scale``) is under about the same pressure as the full-size replay. Content
    hashes (prefix caching) are kept, each covering ``block_hash_size × scale`` tokens."""
    if scale == 1.0:
        return trace
    from fragsim.traces import Trace

    prompt = np.maximum(1, np.ceil(trace.prompt_len * scale)).astype(np.int64)
    output = np.maximum(1, np.ceil(trace.output_len * scale)).astype(np.int64)
    hash_size = None if trace.block_hashes is None else max(1, round(trace.block_hash_size * scale))
    return Trace(f"{trace.name}x{scale:g}", trace.source, trace.arrival_s * scale, prompt, output,
                 block_hashes=trace.block_hashes, block_hash_size=hash_size, has_timestamps=True)


def miniature_pool_bytes(mini: Any, max_seq_len: int, max_num_seqs: int, tp: int = 1) -> int:
    """The default pool of a hybrid validation: every layer's KV for
    :data:`POOL_REQUESTS` requests of ``max_seq_len`` tokens of ``mini``, and a state
    per state layer for each of the ``max_num_seqs`` sequences the scheduler may run
    (paged-uniform keeps those slots up front)."""
    states = sum(layer.state_bytes(mini.dtype_bytes, tp) for layer in mini.layer_specs
                 if layer.state is not None)
    return POOL_REQUESTS * mini.kv_bytes_per_token_per_gpu(tp) * max_seq_len + max_num_seqs * states


def run_validation(spec: RunSpec, allocator: str, *, device: str = "cpu", shape: ModelShape | None = None,
                   scale: float = 1.0, attention_every: int = 1, corrupt: Any = None,
                   offset: int = 0) -> ValidationReport:
    import torch

    from gpu_backend.backend import DeviceBackend, SharedDeviceBackend
    from gpu_backend.pool import KVPool

    shape = shape or ModelShape()
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    max_seq_len = max(16, int(math.ceil(spec.max_seq_len * scale)))
    capacity = spec.kv_slots or POOL_REQUESTS * max_seq_len
    spec = dataclasses.replace(spec, exact_steps=True, kv_slots=capacity, max_seq_len=max_seq_len)
    trace = load_workload(spec)
    if offset:
        from fragsim.traces import slice_trace

        trace = slice_trace(trace, offset=offset)
    trace = scaled_trace(trace, scale)
    engine = make_engine(trace, allocator, spec)
    alloc = engine.kv.alloc  # type: ignore[attr-defined]
    pool = KVPool(shape.num_layers, alloc.capacity, shape.num_kv_heads, shape.head_dim,
                  dtype=getattr(torch, shape.dtype), device=device)
    layers = tuple(sorted({0, shape.num_layers - 1}))
    # A sharing run (samples, beams, prefix caching) has several holders per block.
    backend_class = SharedDeviceBackend if engine.kv.shares else DeviceBackend  # type: ignore[attr-defined]
    backend = backend_class(pool, alloc, shape.num_q_heads, attention_every=attention_every,
                            attention_layers=layers, corrupt=corrupt)
    error, wall = _replay(engine, backend)
    return ValidationReport(allocator, device, len(trace), alloc.capacity, len(backend.records),
                            _table(backend.records, alloc.capacity), backend.attention_checks,
                            backend.content_checks, backend.max_abs_error, error, wall)


def _replay(engine: Any, backend: Any) -> tuple[str | None, float]:
    """Run ``engine`` with ``backend`` following every step: the first disagreement, if
    any, and the wall seconds."""
    from gpu_backend.pool import ValidationError

    engine.attach(backend)
    t0 = time.perf_counter()
    error = None
    try:
        engine.run()
    except ValidationError as exc:
        error = str(exc)
    return error, time.perf_counter() - t0


def _table(records: list[Any], capacity: int) -> list[dict[str, Any]]:
    """Simulated vs measured, averaged over the checked steps (each step must match)."""
    if not records:
        return []
    sim = np.array([r.simulated for r in records], dtype=np.float64)
    dev = np.array([r.measured for r in records], dtype=np.float64)
    rows = []
    for i, name in enumerate(("token_states", "reservation", "internal_fragmentation", "free")):
        rows.append({"quantity": f"mean {name} (slots)", "simulated": float(sim[:, i].mean()),
                     "measured": float(dev[:, i].mean()), "match": bool((sim[:, i] == dev[:, i]).all())})
    free_sim, free_dev = sim[:, 3], dev[:, 3]
    ls = np.array([r.simulated_largest for r in records], dtype=np.float64)
    ld = np.array([r.measured_largest for r in records], dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        ext_sim = np.where(free_sim > 0, 1 - ls / np.where(free_sim > 0, free_sim, 1), 0)
        ext_dev = np.where(free_dev > 0, 1 - ld / np.where(free_dev > 0, free_dev, 1), 0)
    rows.append({"quantity": "mean external fragmentation ratio", "simulated": float(ext_sim.mean()),
                 "measured": float(ext_dev.mean()), "match": bool((ls == ld).all())})
    running = max(r.running for r in records)
    rows.append({"quantity": "peak running", "simulated": running, "measured": running, "match": True})
    return rows


# ------------------------------------------------------------------ hybrid models


#: the hybrid validator on CUDA (benchmarks/gpu_check.py part 4): (model, miniature shape,
#: pool bytes); gpt-oss's heads and Nemotron-H's, lengths × CUDA_HYBRID_SCALE
CUDA_HYBRID_SHAPES: list[tuple[str, dict[str, int], int]] = [
    ("gpt-oss-20b", {"num_kv_heads": 8, "head_dim": 64, "q_per_kv": 8}, 8_000_000),
    ("nemotron-h-8b", {"num_kv_heads": 8, "head_dim": 128, "q_per_kv": 4}, 8_000_000),
]
CUDA_HYBRID_SCALE = 0.25


@dataclass(frozen=True)
class HybridShape:
    """The miniature a hybrid model is validated as (:func:`gpu_backend.hybrid_layout.miniature`)."""

    num_layers: int | None = None    # the model's first layers; None: enough for every kind
    num_kv_heads: int = 2
    head_dim: int = 16
    q_per_kv: int = 2
    dtype: str = "float16"

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "head_dim", "q_per_kv"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.dtype not in ("float16", "float32"):
            raise ValueError(f"dtype must be float16 or float32, got {self.dtype!r}")


@dataclass
class HybridValidationReport(_Report):
    allocator: str
    model: str
    device: str
    num_requests: int
    pool_bytes: int
    rows: list[str]
    steps_checked: int
    table: list[dict[str, Any]]
    attention_checks: int
    content_checks: int
    state_checks: int
    window_reuses: int
    preemptions: int
    max_abs_error: float
    error: str | None
    wall_time_s: float


def run_hybrid_validation(spec: RunSpec, allocator: str, *, device: str = "cpu",
                          shape: HybridShape | None = None, scale: float = 1.0,
                          attention_every: int = 1, corrupt: Any = None, offset: int = 0,
                          pool_bytes: int | None = None) -> HybridValidationReport:
    """Replay ``spec``'s trace with a hybrid manager on a miniature of ``spec.model``
    whose pool lives on ``device``; the byte split must agree at every step.

    Lengths, windows and chunks are multiplied by ``scale``; the pool (unless
    ``pool_bytes``) is :func:`miniature_pool_bytes`: sized for the miniature, never for
    the full model on a GPU.
    """
    import torch

    from fragsim.catalog import get_gpu, get_model
    from gpu_backend.hybrid_backend import HybridDeviceBackend
    from gpu_backend.hybrid_layout import layout_of, miniature
    from gpu_backend.hybrid_pool import HybridPool

    shape = shape or HybridShape()
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    if spec.prefix_caching:
        raise ValueError("prefix caching shares blocks between requests, which the hybrid device "
                         "backend does not follow yet (validate without --prefix-caching)")
    model, gpu = get_model(spec.model, catalog=spec.catalog), get_gpu(spec.gpu, catalog=spec.catalog)
    dtype = getattr(torch, shape.dtype)
    mini = miniature(model, num_layers=shape.num_layers, kv_heads=shape.num_kv_heads,
                     head_dim=shape.head_dim, scale=scale, dtype_bytes=2 if dtype == torch.float16 else 4)
    max_seq_len = max(16, int(math.ceil(spec.max_seq_len * scale)))
    if pool_bytes is None:
        pool_bytes = miniature_pool_bytes(mini, max_seq_len, spec.max_num_seqs, spec.tp)
    spec = dataclasses.replace(spec, exact_steps=True, address_map=True, kv_cache_memory_bytes=pool_bytes,
                               max_seq_len=max_seq_len)
    trace = load_workload(spec)
    if offset:
        from fragsim.traces import slice_trace

        trace = slice_trace(trace, offset=offset)
    trace = scaled_trace(trace, scale)
    engine = make_engine(trace, allocator, spec, model_gpu=(mini, gpu))
    manager: Any = engine.kv.manager  # type: ignore[attr-defined]
    pool = HybridPool(layout_of(manager, mini, spec.tp), dtype=dtype, device=device)
    backend = HybridDeviceBackend(pool, manager, shape.q_per_kv, attention_every=attention_every,
                                  corrupt=corrupt)
    error, wall = _replay(engine, backend)
    return HybridValidationReport(
        allocator, mini.name, device, len(trace), pool_bytes, list(manager.labels), len(backend.records),
        _hybrid_table(backend.records, manager.labels), backend.attention_checks, backend.content_checks,
        backend.state_checks, backend.window_reuses, int(engine.requests.preemptions.sum()), backend.max_abs_error,
        error, wall)


def _hybrid_table(records: list[Any], labels: list[str]) -> list[dict[str, Any]]:
    """Per row and category: mean bytes simulated and measured (each step must match)."""
    from fragsim.hybrid.groups import CATEGORIES

    if not records:
        return []
    sim = np.stack([r.simulated for r in records]).astype(np.float64)
    dev = np.stack([r.measured for r in records]).astype(np.float64)
    rows = []
    for i, label in enumerate(labels):
        for c, cat in enumerate(CATEGORIES):
            if not sim[:, i, c].any() and not dev[:, i, c].any():
                continue
            rows.append({"quantity": f"{label}: mean {cat} (bytes)", "simulated": float(sim[:, i, c].mean()),
                         "measured": float(dev[:, i, c].mean()),
                         "match": bool((sim[:, i, c] == dev[:, i, c]).all())})
    running = max(r.running for r in records)
    rows.append({"quantity": "peak running", "simulated": running, "measured": running, "match": True})
    return rows
