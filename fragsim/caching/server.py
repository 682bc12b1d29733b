"""The HF-style server whose allocations drive the caching-allocator model.

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

:class:`_Server` is that event loop; it owns the allocator model, the live
tensors and the records, which :mod:`fragsim.caching.workloads` turns into a
result. The scenario it runs is a :class:`~fragsim.caching.scenarios.ServingWorkload`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from fragsim.caching.model import CachingAllocatorModel
from fragsim.caching.scenarios import ModelDims, ServingWorkload


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
