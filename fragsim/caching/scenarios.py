"""What a serving workload is: the model, the traffic, the server's settings.

:class:`ModelDims` holds the dimensions that size a transformer's tensors (from
the project catalog), :class:`ServingWorkload` one scenario with every field
validated at construction, and :data:`WORKLOADS` the presets. The server that
runs a scenario lives in :mod:`fragsim.caching.server`; running one and
summarising it in :mod:`fragsim.caching.workloads`.

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

from dataclasses import dataclass

from fragsim.caching.model import GiB


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
