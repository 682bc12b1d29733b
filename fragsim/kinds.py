"""What a sequence holds in one layer kind: the rule, written once per kind.

Everything that needs to know which blocks a sequence holds asks these classes:
the vLLM planner, every hybrid KV manager, stretches, the split, the static
partition's sizing, and the GPU layouts and references. Two numbers fix what a
sequence holds in a layer kind, ``B`` tokens a block, once ``computed`` tokens are
computed and ``requested`` tokens are asked for::

    blocks up to       cdiv(requested, B)
    blocks skipped     skipped(computed) // B      (vLLM's get_num_skipped_tokens)

    kind              skipped(f)               reads
    full, mla         0                        every position
    sliding W         max(0, f − W + 1)        [f − W + 1, f]: the new token is the window's last
    chunked C         f // C · C               its own chunk
    state (mamba)     one state per sequence, whatever its length (two or three blocks
                      for a step under prefix caching: :class:`State`)

    W = 8, B = 4, f = 19: skipped 12, blocks 0..2 skipped, the sequence holds [12, 20)

Each rule also says the next computed length at which its skipped blocks change
(:meth:`Kind.next_skip`) and the most blocks a sequence can hold
(:meth:`Kind.max_blocks`, vLLM's ``max_memory_usage_bytes`` in blocks).

The arithmetic is written so that Python ints, numpy arrays and torch tensors all
evaluate it (``//`` is floor division on all three, :func:`clip0` their ``max(0, x)``);
a test holds the three forms against each other. A new kind is one class here and
an entry in :func:`rule_of`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")


def cdiv(a: Any, b: Any) -> Any:
    """Ceiling division of ints, numpy arrays or torch tensors (positive ``b``)."""
    return -(-a // b)


def clip0(x: T) -> T:
    """``max(0, x)`` of an int, a numpy array or a torch tensor."""
    if isinstance(x, int):
        return x if x > 0 else 0  # type: ignore[return-value]
    if isinstance(x, np.ndarray):   # NOTE: np.maximum is ~3x faster than .clip on small arrays
        return np.maximum(x, 0)  # type: ignore[return-value]
    return x.clip(min=0)  # type: ignore[attr-defined,no-any-return]


@dataclass(frozen=True)
class Kind:
    """A layer kind's rule. ``frees`` says whether any block is ever skipped (a rule
    that frees nothing has no :meth:`next_skip`)."""

    name = "kind"
    frees = False
    #: whether the kind keeps a token's KV (False: a fixed state per sequence)
    per_token = True

    def skipped(self, computed: T) -> T:
        """Leading tokens the next token no longer reads, with ``computed`` computed."""
        return computed * 0  # type: ignore[operator,no-any-return,return-value]

    def skipped_blocks(self, computed: T, block_size: int) -> T:
        """Leading blocks wholly skipped, with ``computed`` computed."""
        return self.skipped(computed) // block_size  # type: ignore[operator,no-any-return,return-value]

    def next_skip(self, skipped_blocks: T, block_size: int) -> T:
        """The computed length at which block ``skipped_blocks`` is skipped too."""
        raise ValueError(f"a {self.name} layer skips no block")

    def held_blocks(self, stored: Any, max_len: int, block_size: int) -> Any:
        """Blocks held by a sequence that has stored ``stored`` tokens and computes the
        next one (at most ``max_len`` tokens), as vLLM's ``allocate_slots`` leaves them."""
        n = stored + 1
        if isinstance(n, int):
            n = min(n, max_len)
        else:
            n = n.clip(max=max_len)
        return cdiv(n, block_size) - self.skipped_blocks(stored, block_size)

    def prompt_blocks(self, prompt_len: Any, max_len: int, block_size: int) -> Any:
        """Blocks held by a sequence whose whole ``prompt_len``-token prompt is computed
        in one step from nothing, once ``allocate_slots`` has allocated that step. Nothing
        is computed yet, so no kind has skipped a block: every position has one."""
        n = min(prompt_len, max_len) if isinstance(prompt_len, int) else prompt_len.clip(max=max_len)
        return cdiv(n, block_size)

    def max_blocks(self, max_len: int, block_size: int, in_flight: int) -> int:
        """The most blocks one request of ``max_len`` tokens holds at once, with up to
        ``in_flight`` tokens computed in the steps in flight."""
        return cdiv(max_len, block_size)  # type: ignore[no-any-return]

    def label(self) -> str:
        return self.name


@dataclass(frozen=True)
class Full(Kind):
    """Full attention (and MLA's latent): every position is read again."""

    name = "full"


@dataclass(frozen=True)
class Sliding(Kind):
    """A sliding window of ``window`` tokens: the new token and the ``window − 1``
    before it are read."""

    window: int
    name = "sliding"
    frees = True

    def skipped(self, computed: T) -> T:
        return clip0(computed - (self.window - 1))  # type: ignore[operator,return-value]

    def next_skip(self, skipped_blocks: T, block_size: int) -> T:
        # the least f with (f − W + 1) // B >= skipped_blocks + 1
        return (skipped_blocks + 1) * block_size + (self.window - 1)  # type: ignore[operator,no-any-return,return-value]

    def max_blocks(self, max_len: int, block_size: int, in_flight: int) -> int:
        # vLLM's SlidingWindowSpec: the window less one, the tokens in flight, and one
        # block for a window that straddles a block boundary
        return cdiv(min(self.window - 1 + in_flight, max_len), block_size) + 1  # type: ignore[no-any-return]

    def label(self) -> str:
        return f"sliding {self.window}"


@dataclass(frozen=True)
class Chunked(Kind):
    """Chunked local attention over chunks of ``chunk`` tokens (Llama 4)."""

    chunk: int
    name = "chunked"
    frees = True

    def skipped(self, computed: T) -> T:
        return computed // self.chunk * self.chunk  # type: ignore[operator,no-any-return,return-value]

    def next_skip(self, skipped_blocks: T, block_size: int) -> T:
        # the least f with f // C · C >= (skipped_blocks + 1) · B
        return cdiv((skipped_blocks + 1) * block_size, self.chunk) * self.chunk  # type: ignore[operator,no-any-return,return-value]

    def max_blocks(self, max_len: int, block_size: int, in_flight: int) -> int:
        return cdiv(min(self.chunk + in_flight, max_len), block_size)  # type: ignore[no-any-return]

    def label(self) -> str:
        return f"chunked {self.chunk}"


@dataclass(frozen=True)
class State(Kind):
    """A fixed state per sequence (Mamba, linear attention): one block from admission
    on, vLLM's "none" mode. Under prefix caching vLLM runs state layers in its
    ``align`` mode, where blocks are positions on the token axis (B tokens each) and
    a sequence keeps only the states it still needs::

        decode step, L stored      1 block; 2 when L % B == 0 (the state of block L/B − 1
                                   is read and copied into the fresh block L/B)
        prompt step, L tokens      1 block; 1 + checkpoints when L > B (the state at the
                                   last block boundary before L, kept for prefix caching)
        most at once               2 + checkpoints

    ``checkpoints`` is what the layer's spec asks for (vLLM's
    ``num_prefill_checkpoint_blocks``): 1 for Mamba-2 mixers, which export the
    boundary state from inside the prefill, and for Gated DeltaNet under FlashInfer's
    prefill kernel; 0 for Mamba-1 (:func:`fragsim.vllm_plan_pages._prefill_checkpoint`)::

        B = 16, align, checkpoints 1: prompt of 40 → 2 blocks (the state at 32 and at 40);
        decode with 40 stored → 1; with 48 stored → 2; most 3"""

    align: bool = False
    checkpoints: int = 0
    name = "state"
    per_token = False

    def held_blocks(self, stored: Any, max_len: int, block_size: int) -> Any:
        if not self.align:
            return stored * 0 + 1
        return (stored % block_size == 0) + 1

    def prompt_blocks(self, prompt_len: Any, max_len: int, block_size: int) -> Any:
        if not self.align:
            return prompt_len * 0 + 1
        return (prompt_len > block_size) * self.checkpoints + 1

    def max_blocks(self, max_len: int, block_size: int, in_flight: int) -> int:
        return 2 + self.checkpoints if self.align else 1


FULL = Full()
STATE = State()


def rule_of(kind: str, window: int | None = None, chunk: int | None = None) -> Kind:
    """The rule of a layer kind name (:data:`fragsim.layers.KINDS`)."""
    if kind in ("full", "mla"):
        return FULL
    if kind == "sliding":
        if window is None:
            raise ValueError("a sliding layer needs its window")
        return Sliding(window)
    if kind == "chunked":
        if chunk is None:
            raise ValueError("a chunked layer needs its chunk")
        return Chunked(chunk)
    if kind in ("mamba", "linear"):
        return STATE
    raise ValueError(f"no memory rule for layer kind {kind!r} (a shared layer holds nothing)")
