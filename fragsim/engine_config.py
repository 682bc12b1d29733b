"""Scheduler limits and modes of the serving engine (:class:`fragsim.engine.Engine`)."""

from __future__ import annotations

from dataclasses import dataclass

BATCHING = ("continuous", "static")
PREEMPTION = ("recompute", "swap")
#: how continuous batching builds a step (:mod:`fragsim.engine`'s docstring has the rules)
SCHEDULERS = ("vllm-v1", "vllm-v0", "orca")
#: vLLM 0.1's ``--max-num-batched-tokens`` default (``vllm/engine/arg_utils.py``, 0.1.x)
VLLM_V0_BATCHED_TOKENS = 2560


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler limits and modes. Validated at construction."""

    max_seq_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: max(max_seq_len, 2048), at most 8192
    batching: str = "continuous"
    scheduler: str = "vllm-v1"
    preemption: str = "recompute"
    swap_space_slots: int = 0
    swap_bandwidth: float = 25e9         # bytes/s over PCIe
    kv_bytes_per_token: int = 0          # only for swap transfer times
    queue_timeout_s: float | None = None
    truncate_prompts: bool = False
    exact_steps: bool = False
    check: bool = False                  # recompute the split from per-sequence state each step
    timeseries_resolution_s: float | None = 1.0
    max_jump_steps: int = 4096
    address_map_interval_s: float | None = None  # sample slot owners this often (figures)
    address_map_bins: int = 512
    # Block sharing (a KV manager whose allocator can fork: fragsim.kv.sharing):
    num_samples: int = 1                 # parallel sampling: sequences decoded per prompt
    beam_width: int = 1                  # beam search width
    prefix_caching: bool = False
    beam_theta: float = 0.1              # next-token concentration θ of the beam model (fragsim.beams)
    sharing_seed: int = 0                # which beams survive each step

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)
        need(self.max_seq_len >= 1, f"max_seq_len must be >= 1, got {self.max_seq_len}")
        need(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        need(self.batching in BATCHING, f"batching must be one of {', '.join(BATCHING)}, got {self.batching!r}")
        need(self.preemption in PREEMPTION, f"preemption must be one of {', '.join(PREEMPTION)}, got {self.preemption!r}")
        need(self.scheduler in SCHEDULERS,
             f"scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}")
        need(self.scheduler == "vllm-v1" or self.batching == "continuous",
             f"--scheduler {self.scheduler} builds iteration-level steps: it needs continuous batching")
        need(self.swap_space_slots >= 0, f"swap space must be >= 0, got {self.swap_space_slots}")
        need(self.swap_bandwidth > 0, f"swap bandwidth must be > 0, got {self.swap_bandwidth}")
        need(self.queue_timeout_s is None or self.queue_timeout_s > 0,
             f"queue_timeout must be > 0 seconds, got {self.queue_timeout_s}")
        need(self.max_jump_steps >= 1, f"max_jump_steps must be >= 1, got {self.max_jump_steps}")
        need(self.num_samples >= 1, f"num_samples must be >= 1, got {self.num_samples}")
        need(self.beam_width >= 1, f"beam_width must be >= 1, got {self.beam_width}")
        need(self.beam_theta > 0, f"beam_theta must be > 0, got {self.beam_theta}")
        need(self.num_samples == 1 or self.beam_width == 1,
             f"choose parallel sampling or beam search, got num_samples={self.num_samples} "
             f"and beam_width={self.beam_width}")
        need(self.width <= self.max_num_seqs,
             f"a request decodes {self.width} sequences, more than max_num_seqs ({self.max_num_seqs})")
        need(not self.sharing or self.batching == "continuous",
             "block sharing (samples, beams, prefix caching) needs continuous batching")
        tokens = self.num_batched_tokens
        need(tokens >= self.max_num_seqs,
             f"max_num_batched_tokens ({tokens}) must be >= max_num_seqs ({self.max_num_seqs}): "
             "every running sequence decodes one token per step")

    @property
    def width(self) -> int:
        """Sequences each request decodes: its samples or beams (1 without either)."""
        return max(self.num_samples, self.beam_width)

    @property
    def sharing(self) -> bool:
        return self.width > 1 or self.prefix_caching

    @property
    def whole_prompts(self) -> bool:
        """Whether a prompt runs in one step, never chunked (``vllm-v0``, ``orca``)."""
        return self.scheduler != "vllm-v1"

    @property
    def num_batched_tokens(self) -> int:
        """The step's token budget. By default a whole prompt fits one step up to 8,192
        tokens (vLLM without chunking uses max(max_model_len, 2048)); longer prompts
        are chunked rather than making one step of a 128K prompt. The schedulers of the
        vLLM paper's engine (``vllm-v0``, ``orca``) take vLLM 0.1's 2,560, or the context
        where it is longer (a prompt is never chunked there, so a step must hold one)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.whole_prompts:
            return max(VLLM_V0_BATCHED_TOKENS, self.max_seq_len)
        return min(max(self.max_seq_len, 2048), 8192)
