"""Serving workloads that drive the caching-allocator model, HF-style.

A HuggingFace-style server allocates everything through PyTorch's caching
allocator, one ``torch.empty`` at a time:

- the weights, once, one tensor per parameter;
- per request, its KV cache as tensors: one K and one V per layer
  (``kv_layout="per-layer"``, DynamicCache) or one tensor for all layers
  (``"stacked"``); sized for ``max_seq_len`` at admission (``kv_alloc="max"``) or
  for the tokens so far, rounded up to ``kv_chunk_tokens``, and reallocated when
  it fills (``"grow"``: allocate the larger tensor, copy, free the old one; HF's
  DynamicCache does this every token with torch.cat, chunks keep the op count
  down);
- per forward pass, temporaries sized from the batch's tokens and the model's
  dimensions (see :func:`_forward_temporaries`), freed before the pass ends.

Time is simulated: gamma inter-arrival times (Poisson when ``arrival_cv`` is 1),
a prefill of ``T`` tokens takes ``T / prefill_tokens_per_s`` seconds, a decode step
of the running batch ``decode_step_s``. Requests run FCFS, at most ``max_batch`` at
a time. Decode steps between two events (an admission, a KV reallocation, a
finish) allocate and free the same temporaries over the same state, so the
allocator hands out the same blocks each time; a run of such steps is simulated
once, with the sizes of its first step (the attention buffers grow by one token a
step, a few KiB). An OOM fails
the request being served (prefill, KV growth) or the whole batch (decode
temporaries), as an exception in ``generate`` would; the server carries on.

Presets (:data:`WORKLOADS`):

``rag-longtail``
    Seed 004 §3.2: a RAG service whose prompts are mostly 200-300 tokens, 2% of
    them ~1,500 (1,400-1,600), outputs 16-256 tokens; Llama-2-13B in fp16 on a
    32 GB card (31.5 GiB left to the allocator after the CUDA context: 24.2 GiB of
    weights, 7.3 GiB for KV and temporaries); up to 16 requests at once; bursty
    arrivals averaging 1 per second (gamma inter-arrival times, CV 2); eager
    attention (a long prompt's fp32 softmax buffer is 40 × 1,500² × 4 B ≈ 343 MiB,
    the largest single temporary; the seed's "800 MB" is of the order of all of a
    long prompt's temporaries together);
    fp32 logits for every prompt position as HF computed them before 4.45; per-layer
    K and V tensors grown 128 tokens at a time. One simulated hour (the default)
    takes a few seconds and, for seed 0, fails 10 allocations, every one of them
    with more free memory on the device than it asked for: a 16 MiB KV tensor with
    1.3 GiB free whose largest block is 15 MiB, a 307 MiB softmax buffer with
    986 MiB free, ... (``fragsim caching`` prints them). ``expandable_segments``
    removes most of them.
``hf-serving``
    Llama-2-7B on 23.5 GiB (a 24 GB card), prompts of 100-1,000 tokens, KV
    allocated for max_seq_len = 2,048 tokens at admission (``kv_alloc="max"``):
    every KV tensor has the same size, blocks are reused exactly, fragmentation
    stays low; the memory is lost to reservation instead (seed 004 §3.1).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fragsim.caching.model import CachingAllocatorModel, GiB

DANGER_RATIO = 0.2  # seed 004: above 20% fragmentation, OOM risk is significant


@dataclass(frozen=True)
class ModelDims:
    """The dimensions that size a transformer's tensors."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def weight_tensors(self) -> list[tuple[str, int]]:
        """(name, bytes) of every parameter tensor of a Llama-style decoder."""
        d, h, q = self.dtype_bytes, self.hidden_size, self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        layer = [("q_proj", h * q), ("k_proj", h * kv), ("v_proj", h * kv), ("o_proj", q * h),
                 ("gate_proj", h * self.intermediate_size), ("up_proj", h * self.intermediate_size),
                 ("down_proj", self.intermediate_size * h), ("input_norm", h), ("post_norm", h)]
        out = [("embed_tokens", self.vocab_size * h * d)]
        for i in range(self.num_layers):
            out += [(f"layers.{i}.{name}", n * d) for name, n in layer]
        return out + [("norm", h * d), ("lm_head", self.vocab_size * h * d)]

    @classmethod
    def from_name(cls, name: str) -> ModelDims:
        """From the project catalog (:func:`fragsim.catalog.get_model`)."""
        from fragsim.catalog import get_model

        m = get_model(name)
        return cls(m.name, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim,
                   m.hidden_size, m.intermediate_size, m.vocab_size, m.dtype_bytes)


@dataclass(frozen=True)
class ServingWorkload:
    """One serving scenario; every field is validated at construction."""

    name: str = "custom"
    model: str = "llama-2-13b"
    device_gb: float = 31.5  # GiB the allocator may cudaMalloc in total
    hours: float = 1.0  # simulated time
    arrival_rate: float = 1.0  # requests per second
    arrival_cv: float = 2.0  # inter-arrival coefficient of variation: 1 Poisson, > 1 bursty (gamma)
    prompt_tokens: tuple[int, int] = (200, 300)  # uniform, inclusive
    long_prompt_tokens: tuple[int, int] = (1400, 1600)
    long_fraction: float = 0.02  # share of requests with a long prompt
    output_tokens: tuple[int, int] = (16, 256)
    max_batch: int = 16
    max_seq_len: int = 2048
    kv_alloc: str = "grow"  # "grow" | "max"
    kv_chunk_tokens: int = 128
    kv_layout: str = "per-layer"  # "per-layer" | "stacked"
    attention: str = "eager"  # "eager" (T×T scores, fp32 softmax) | "fused"
    logits: str = "all"  # "all" prompt positions (HF < 4.45) | "last"
    decode_step_s: float = 0.04
    prefill_tokens_per_s: float = 4000.0
    load_weights: bool = True
    max_split_size_mb: int | None = None
    expandable_segments: bool = False
    roundup_power2_divisions: int | None = None
    seed: int = 0
    record_ops: bool = False  # keep the malloc/free sequence (for native replay)

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ValueError(f'"{name}" must be {allowed}, got {getattr(self, name)!r}')

        def pair(name: str) -> None:
            lo, hi = getattr(self, name)
            need(isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi, name,
                 "a pair of integers 1 <= low <= high")

        need(self.device_gb > 0, "device_gb", "> 0")
        need(self.hours > 0, "hours", "> 0")
        need(self.arrival_rate > 0, "arrival_rate", "> 0 requests per second")
        need(self.arrival_cv > 0, "arrival_cv", "> 0")
        for name in ("prompt_tokens", "long_prompt_tokens", "output_tokens"):
            pair(name)
        need(0 <= self.long_fraction <= 1, "long_fraction", "in [0, 1]")
        need(isinstance(self.max_batch, int) and self.max_batch >= 1, "max_batch", "an integer >= 1")
        longest = max(self.prompt_tokens[1], self.long_prompt_tokens[1] if self.long_fraction else 0)
        need(self.max_seq_len >= longest + self.output_tokens[1], "max_seq_len",
             f">= the longest prompt + output ({longest + self.output_tokens[1]})")
        need(self.kv_alloc in ("grow", "max"), "kv_alloc", "'grow' or 'max'")
        need(isinstance(self.kv_chunk_tokens, int) and self.kv_chunk_tokens >= 1, "kv_chunk_tokens",
             "an integer >= 1")
        need(self.kv_layout in ("per-layer", "stacked"), "kv_layout", "'per-layer' or 'stacked'")
        need(self.attention in ("eager", "fused"), "attention", "'eager' or 'fused'")
        need(self.logits in ("all", "last"), "logits", "'all' or 'last'")
        need(self.decode_step_s > 0, "decode_step_s", "> 0 seconds")
        need(self.prefill_tokens_per_s > 0, "prefill_tokens_per_s", "> 0")

    @property
    def device_bytes(self) -> int:
        return int(self.device_gb * GiB)


WORKLOADS: dict[str, ServingWorkload] = {
    "rag-longtail": ServingWorkload(name="rag-longtail"),
    "hf-serving": ServingWorkload(
        name="hf-serving", model="llama-2-7b", device_gb=23.5, kv_alloc="max", max_batch=8,
        prompt_tokens=(100, 1000), long_fraction=0.0, output_tokens=(16, 512), arrival_rate=0.5,
    ),
}


@dataclass
class WorkloadResult:
    """Time series (one row per event, the state until the next row), OOM events,
    a summary, and the model at the end of the run."""

    workload: ServingWorkload
    timeseries: Any  # pandas.DataFrame
    ooms: Any  # pandas.DataFrame
    summary: dict[str, Any]
    model: CachingAllocatorModel
    #: with record_ops: ("malloc", tensor id, bytes) / ("free", tensor id) in order;
    #: a failed malloc has id None (the format gpu_backend.native_caching replays)
    ops: list[tuple[Any, ...]] = field(default_factory=list)
    wall_s: float = 0.0  # not part of the summary, which is deterministic


def _forward_temporaries(
    dims: ModelDims, tokens: int, kv_len: int, logit_rows: int, w: ServingWorkload
) -> list[tuple[str, str, int]]:
    """A forward pass over ``tokens`` new tokens attending to ``kv_len`` tokens,
    as HF Llama computes it, as ("m", name, bytes) / ("f", name, 0) steps::

        h                              tokens × hidden, the residual stream
        x = norm(h); q, k, v           tokens × heads × head_dim (k, v: KV heads)
        -- "kv": the request's KV cache tensors are allocated here --
        scores = q @ kᵀ                heads × tokens × kv_len, fp16   (eager only)
        probs32 = softmax(scores.float())                       fp32   (eager only)
        probs = probs32.half()                                  fp16   (eager only)
        attn = probs @ v; o = o_proj(attn)
        gate, up, act                  tokens × intermediate
        down                           tokens × hidden
        logits16, logits32             logit_rows × vocab, fp16 then fp32

    Layers repeat the same sizes and free them before the next layer starts, so
    one layer's sequence stands for all of them.
    """
    d, t = dims.dtype_bytes, tokens
    hid, q = t * dims.hidden_size * d, t * dims.num_heads * dims.head_dim * d
    kv = t * dims.num_kv_heads * dims.head_dim * d
    ops: list[tuple[str, str, int]] = [("m", "h", hid), ("m", "x", hid), ("m", "q", q),
                                       ("m", "k", kv), ("m", "v", kv), ("kv", "", 0)]
    if w.attention == "eager":
        s = dims.num_heads * t * kv_len
        ops += [("m", "scores", s * d), ("m", "probs32", s * 4), ("f", "scores", 0),
                ("m", "probs", s * d), ("f", "probs32", 0), ("m", "attn", q), ("f", "probs", 0)]
    else:
        ops += [("m", "attn", q)]
    inter = t * dims.intermediate_size * d
    rows = logit_rows * dims.vocab_size
    ops += [("f", "q", 0), ("f", "k", 0), ("f", "v", 0), ("m", "o", hid), ("f", "attn", 0),
            ("f", "x", 0), ("m", "x2", hid), ("m", "gate", inter), ("m", "up", inter),
            ("m", "act", inter), ("f", "gate", 0), ("f", "up", 0), ("m", "down", hid),
            ("f", "act", 0), ("f", "x2", 0), ("f", "o", 0), ("f", "down", 0),
            ("m", "logits16", rows * 2), ("m", "logits32", rows * 4), ("f", "logits16", 0),
            ("f", "logits32", 0), ("f", "h", 0)]
    return ops


class _Request:
    __slots__ = ("rid", "arrival", "prompt", "output", "generated", "kv", "capacity")

    def __init__(self, rid: int, arrival: float, prompt: int, output: int) -> None:
        self.rid, self.arrival, self.prompt, self.output = rid, arrival, prompt, output
        self.generated = 0
        self.kv: list[int] = []  # tensor ids
        self.capacity = 0  # tokens the KV tensors hold

    @property
    def context(self) -> int:
        return self.prompt + self.generated


_SERIES = ("reserved_bytes", "allocated_bytes", "requested_bytes", "inactive_bytes",
           "inactive_split_bytes", "device_free_bytes", "total_free_bytes", "largest_free_block",
           "largest_allocatable", "fragmentation_ratio", "reserved_fragmentation_ratio",
           "num_segments", "num_free_blocks")


class _Server:
    """The event loop; owns the allocator model, the live tensors and the records."""

    def __init__(self, w: ServingWorkload, dims: ModelDims) -> None:
        self.w, self.dims = w, dims
        self.model = CachingAllocatorModel(
            w.device_bytes, max_split_size_mb=w.max_split_size_mb,
            expandable_segments=w.expandable_segments, roundup_power2_divisions=w.roundup_power2_divisions,
        )
        self.addr: dict[int, int] = {}
        self.next_tid = 0
        self.ops: list[tuple[Any, ...]] = []
        self.rows: list[tuple[Any, ...]] = []
        self.oom_rows: list[dict[str, Any]] = []
        self.first_paradox_holes: dict[str, Any] | None = None
        self.now = 0.0
        self.running: list[_Request] = []
        self.waiting: deque[_Request] = deque()
        self.counts = dict.fromkeys(("arrived", "admitted", "completed", "failed"), 0)

    # tensors ------------------------------------------------------------------

    def malloc(self, size: int, tag: str) -> int | None:
        addr = self.model.malloc(size, tag)
        if self.w.record_ops:
            self.ops.append(("malloc", None if addr is None else self.next_tid, size))
        if addr is None:
            event = self.model.oom_events[-1]
            self.oom_rows.append({"time_s": self.now, **event})
            if event["enough_total_free"] and self.first_paradox_holes is None:
                from fragsim.caching.snapshot import analyze

                snap = analyze(self.model.snapshot())
                self.first_paradox_holes = {"num_free_blocks": snap.num_free_blocks,
                                            "free_blocks_by_size": snap.free_blocks_by_size}
            return None
        tid = self.next_tid
        self.next_tid += 1
        self.addr[tid] = addr
        return tid

    def free(self, tid: int) -> None:
        self.model.free(self.addr.pop(tid))
        if self.w.record_ops:
            self.ops.append(("free", tid))

    def kv_sizes(self, capacity: int) -> list[int]:
        d = self.dims
        if self.w.kv_layout == "stacked":
            return [capacity * d.kv_bytes_per_token]
        return [capacity * d.num_kv_heads * d.head_dim * d.dtype_bytes] * (2 * d.num_layers)

    def allocate_kv(self, r: _Request, capacity: int) -> bool:
        """KV tensors of ``capacity`` tokens; on growth each old tensor is freed right
        after its replacement is allocated (torch.cat, then the old one drops)."""
        new: list[int] = []
        for i, size in enumerate(self.kv_sizes(capacity)):
            tid = self.malloc(size, f"r{r.rid}:kv")
            if tid is None:
                for t in new:
                    self.free(t)
                r.kv = r.kv[len(new):]  # the old tensors already replaced are freed
                return False
            new.append(tid)
            if r.kv:
                self.free(r.kv[i])
        r.kv, r.capacity = new, capacity
        return True

    def run_pass(self, ops: list[tuple[str, str, int]], who: str, kv: Callable[[], bool] | None) -> bool:
        """Allocate and free one forward pass's temporaries; on OOM free what it holds."""
        live: dict[str, int] = {}
        for kind, name, size in ops:
            if kind == "f":
                self.free(live.pop(name))
            elif kind == "kv":
                if kv is not None and not kv():
                    break
            else:
                tid = self.malloc(size, f"{who}:{name}")
                if tid is None:
                    break
                live[name] = tid
        else:
            return True
        for tid in live.values():
            self.free(tid)
        return False

    # phases -----------------------------------------------------------------

    def fail(self, r: _Request) -> None:
        for tid in r.kv:
            self.free(tid)
        r.kv = []
        self.counts["failed"] += 1

    def chunk(self, tokens: int) -> int:
        c = self.w.kv_chunk_tokens
        return min(self.w.max_seq_len, -(-tokens // c) * c)

    def prefill(self, r: _Request) -> None:
        w = self.w
        self.counts["admitted"] += 1
        capacity = w.max_seq_len if w.kv_alloc == "max" else self.chunk(r.prompt + 1)
        rows = r.prompt if w.logits == "all" else 1
        ops = _forward_temporaries(self.dims, r.prompt, r.prompt, rows, w)
        ok = self.run_pass(ops, f"r{r.rid}", lambda: self.allocate_kv(r, capacity))
        self.now += r.prompt / w.prefill_tokens_per_s
        if ok:
            self.running.append(r)
        else:
            self.fail(r)

    def decode(self, next_arrival: float) -> None:
        w = self.w
        for r in list(self.running):
            if r.context + 1 > r.capacity and not self.allocate_kv(r, self.chunk(r.context + 1)):
                self.running.remove(r)
                self.fail(r)
        if not self.running:
            return
        steps = min(min(r.capacity - r.context, r.output - r.generated) for r in self.running)
        if len(self.running) < w.max_batch and next_arrival != float("inf"):
            steps = min(steps, int(np.ceil((next_arrival - self.now) / w.decode_step_s)))
        steps = max(1, steps)
        batch = len(self.running)
        kv_len = max(r.context for r in self.running) + 1
        ops = _forward_temporaries(self.dims, batch, kv_len, batch, w)
        if not self.run_pass(ops, "decode", None):
            for r in self.running:
                self.fail(r)
            self.running = []
            return
        self.now += steps * w.decode_step_s
        for r in list(self.running):
            r.generated += steps
            if r.generated >= r.output:
                for tid in r.kv:
                    self.free(tid)
                r.kv = []
                self.running.remove(r)
                self.counts["completed"] += 1

    def record(self) -> None:
        s = self.model.stats()
        self.rows.append((self.now, *(s[k] for k in _SERIES), len(self.running), len(self.waiting),
                          len(self.oom_rows)))

    def arrivals(self, horizon: float) -> list[_Request]:
        """Requests arriving before ``horizon``. Each quantity has its own random
        stream, so a longer run begins with exactly the requests of a shorter one."""
        w = self.w
        times_rng, long_rng, long_len_rng, prompt_rng, output_rng = (
            np.random.default_rng([w.seed, stream]) for stream in range(5))
        shape = 1.0 / w.arrival_cv**2  # gamma inter-arrivals: mean 1/rate, CV arrival_cv
        times = np.empty(0)
        while not len(times) or times[-1] < horizon:
            gaps = times_rng.gamma(shape, 1.0 / (w.arrival_rate * shape), 4096)
            times = np.concatenate([times, (times[-1] if len(times) else 0.0) + np.cumsum(gaps)])
        n = int(np.searchsorted(times, horizon))
        long = long_rng.random(n) < w.long_fraction
        prompts = np.where(long, long_len_rng.integers(*w.long_prompt_tokens, n, endpoint=True),
                           prompt_rng.integers(*w.prompt_tokens, n, endpoint=True))
        outputs = output_rng.integers(*w.output_tokens, n, endpoint=True)
        return [_Request(i, float(t), int(p), int(o))
                for i, (t, p, o) in enumerate(zip(times[:n], prompts, outputs, strict=True))]

    def run(self, progress: Callable[[float], None] | None) -> None:
        w = self.w
        horizon = w.hours * 3600.0
        pending = deque(self.arrivals(horizon))
        if w.load_weights:
            for name, size in self.dims.weight_tensors():
                if self.malloc(size, f"weights:{name}") is None:
                    raise ValueError(f'"device_gb" {w.device_gb} is too small for the weights of {self.dims.name}')
        self.record()
        loops = 0
        while self.now < horizon:
            while pending and pending[0].arrival <= self.now:
                self.waiting.append(pending.popleft())
                self.counts["arrived"] += 1
            if self.waiting and len(self.running) < w.max_batch:
                self.prefill(self.waiting.popleft())
            elif self.running:
                self.decode(pending[0].arrival if pending else float("inf"))
            elif pending:
                self.now = pending[0].arrival
                continue
            else:
                break
            self.record()
            loops += 1
            if progress is not None and loops % 500 == 0:
                progress(min(1.0, self.now / horizon))


def _summary(server: _Server, ts: Any, ooms: Any) -> dict[str, Any]:
    w, model = server.w, server.model
    t = ts["time_s"].to_numpy()
    dt = np.diff(t, append=max(server.now, t[-1]))
    span = float(dt.sum()) or 1.0

    def weighted(col: str) -> float:
        return float((ts[col].to_numpy() * dt).sum() / span)

    def above(col: str) -> float:
        return float(dt[ts[col].to_numpy() > DANGER_RATIO].sum())

    paradox = ooms[ooms["enough_total_free"]] if len(ooms) else ooms

    def event(i: int) -> dict[str, Any]:
        row = paradox.iloc[i]
        return {k: (row[k].item() if hasattr(row[k], "item") else row[k]) for k in
                ("time_s", "tag", "size", "total_free_bytes", "largest_free_block",
                 "largest_allocatable", "reserved_bytes", "allocated_bytes", "device_free_bytes",
                 "fragmentation_ratio")}

    first = most = None
    if len(paradox):
        first = {**event(0), **(server.first_paradox_holes or {})}
        most = event(int(np.argmax((paradox["total_free_bytes"] / paradox["size"]).to_numpy())))
    final = model.stats()
    return {
        "workload": w.name,
        "model": server.dims.name,
        "device_bytes": w.device_bytes,
        "hours": w.hours,
        "seed": w.seed,
        "max_split_size_mb": w.max_split_size_mb,
        "expandable_segments": w.expandable_segments,
        "simulated_s": float(server.now),
        "num_arrived": server.counts["arrived"],
        "num_admitted": server.counts["admitted"],
        "num_completed": server.counts["completed"],
        "num_failed": server.counts["failed"],
        "num_ooms": len(ooms),
        "num_ooms_enough_total_free": len(paradox),
        "first_enough_free_oom": first,
        "most_free_oom": most,  # the one with the most free memory per requested byte
        "peak_fragmentation_ratio": float(ts["fragmentation_ratio"].max()),
        "mean_fragmentation_ratio": weighted("fragmentation_ratio"),
        "time_above_danger_s": above("fragmentation_ratio"),
        "fraction_time_above_danger": above("fragmentation_ratio") / span,
        "peak_reserved_fragmentation_ratio": float(ts["reserved_fragmentation_ratio"].max()),
        "mean_reserved_fragmentation_ratio": weighted("reserved_fragmentation_ratio"),
        "danger_ratio": DANGER_RATIO,
        "peak_reserved_bytes": int(ts["reserved_bytes"].max()),
        "peak_allocated_bytes": int(ts["allocated_bytes"].max()),
        "final_reserved_bytes": final["reserved_bytes"],
        "final_allocated_bytes": final["allocated_bytes"],
        "final_largest_free_block": final["largest_free_block"],
        "final_num_segments": final["num_segments"],
        "num_allocs": final["num_allocs"],
        "num_alloc_retries": final["num_alloc_retries"],
    }


def run_workload(
    name: str = "rag-longtail",
    *,
    progress: Callable[[float], None] | None = None,
    **params: Any,
) -> WorkloadResult:
    """Run preset ``name`` (:data:`WORKLOADS`) with ``params`` overriding its fields.

    ``progress``, if given, is called now and then with the simulated fraction done.
    Deterministic for a seed.
    """
    import pandas as pd

    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}")
    fields = {f.name for f in dataclasses.fields(ServingWorkload)}
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ValueError(f"unknown workload parameter(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    w = dataclasses.replace(WORKLOADS[name], **params)
    started = time.perf_counter()
    server = _Server(w, ModelDims.from_name(w.model))
    server.run(progress)
    ts = pd.DataFrame(server.rows, columns=["time_s", *_SERIES, "num_running", "num_waiting", "num_ooms"])
    oom_cols = ["time_s", "op_index", "size", "rounded_size", "alloc_size", "pool", "tag", "reserved_bytes",
                "allocated_bytes", "inactive_bytes", "device_free_bytes", "total_free_bytes",
                "largest_free_block", "largest_allocatable", "enough_total_free", "fragmentation_ratio"]
    ooms = pd.DataFrame(server.oom_rows, columns=oom_cols)
    return WorkloadResult(w, ts, ooms, _summary(server, ts, ooms), server.model, server.ops,
                          time.perf_counter() - started)
