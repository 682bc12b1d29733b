"""KV cache groups: layers that allocate together, and what one of their blocks costs.

A group is one of vLLM's KV cache groups, one of Jenga's layer kinds, one pool of
the static partition: its layers take their blocks together, one block table per
sequence. For each live sequence a group holds the blocks ``[lo, hi)`` of its token
positions, ``block_tokens`` a block, as its kind's rule (:mod:`fragsim.kinds`) says;
a state group one block from admission on: the sequence's state.

The split of the pool has one *row* per group, and one more, ``pool``, for memory
no group owns (the summary keys ``by_row`` name them).
"""

from __future__ import annotations

from dataclasses import dataclass

from fragsim.catalog import ModelConfig
from fragsim.kinds import FULL, STATE, Kind, rule_of
from fragsim.layers import STATE_KINDS

#: where every byte of the pool goes, in this order in every array
CATEGORIES = ("token_states", "reservation", "internal_fragmentation", "padding",
              "out_of_window", "free")
TOKEN, RESERVATION, INTERNAL, PADDING, OUT_OF_WINDOW, FREE = range(len(CATEGORIES))
#: the split's row of memory no single group owns
POOL = "pool"


@dataclass(frozen=True)
class Group:
    """Layers that allocate together, and what one of their blocks costs."""

    kind: str                  # full, sliding, chunked, mla, mamba, linear
    label: str                 # "sliding 128 (group 2)", ...
    num_layers: int
    block_bytes: int           # one block's bytes in the pool, padding included
    block_tokens: int = 0      # attention: positions per block
    token_bytes: int = 0       # attention: KV bytes one position costs the group's real layers
    state_bytes: int = 0       # state: the real state bytes of one sequence
    window: int | None = None
    chunk: int | None = None
    frees_window: bool = True  # False: blocks out of the window stay held (paged-uniform)

    def __post_init__(self) -> None:
        real = self.state_bytes if self.is_state else self.block_tokens * self.token_bytes
        if self.block_bytes < real or (not self.is_state and self.block_tokens < 1):
            raise ValueError(f"group {self.label!r}: a block of {self.block_bytes} bytes cannot hold "
                             f"{real} bytes of real KV or state")

    @property
    def is_state(self) -> bool:
        return self.kind in STATE_KINDS

    @property
    def rule(self) -> Kind:
        """What the next token reads (:mod:`fragsim.kinds`)."""
        return rule_of(self.kind, self.window, self.chunk)

    @property
    def holds(self) -> Kind:
        """The rule its blocks follow: its kind's, or every position kept (``frees_window``
        off: a window's old blocks stay held)."""
        if self.is_state:
            return STATE
        return self.rule if self.frees_window else FULL

    @property
    def padding_per_block(self) -> int:
        real = self.state_bytes if self.is_state else self.block_tokens * self.token_bytes
        return self.block_bytes - real


def kind_groups(model: ModelConfig, *, tp: int = 1, block_size: int = 16,
                frees_window: bool = True) -> tuple[Group, ...]:
    """One group per layer kind (sliding windows and chunk sizes apart), in order of first
    appearance; a block is ``block_size`` tokens of the group's layers, a state group's
    block one sequence's states."""
    by_label: dict[str, list] = {}
    for layer in model.layer_specs:
        if layer.kind != "shared":
            by_label.setdefault(layer.label(), []).append(layer)
    groups = []
    for label, layers in by_label.items():
        first = layers[0]
        if first.kind in STATE_KINDS:
            state = sum(la.state_bytes(model.dtype_bytes, tp) for la in layers)
            groups.append(Group(kind=first.kind, label=label, num_layers=len(layers),
                                block_bytes=state, state_bytes=state))
        else:
            per_token = sum(la.bytes_per_token(model.kv_dtype_bytes, tp) for la in layers)
            groups.append(Group(kind=first.kind, label=label, num_layers=len(layers),
                                block_bytes=block_size * per_token, block_tokens=block_size,
                                token_bytes=per_token, window=first.window, chunk=first.chunk,
                                frees_window=frees_window))
    return tuple(groups)


def groups_of_plan(plan: object) -> tuple[Group, ...]:
    """One group per vLLM KV cache group (:class:`fragsim.vllm_plan.VllmPlan`); labels carry
    the group index where a kind repeats. Every block costs ``bytes_per_block``."""
    from fragsim.vllm_plan import VllmPlan

    assert isinstance(plan, VllmPlan)
    labels = [g.kind if g.page.window is None else f"{g.kind} {g.page.window}" for g in plan.groups]
    out = []
    for i, g in enumerate(plan.groups):
        label = labels[i] if labels.count(labels[i]) == 1 else f"{labels[i]} (group {i})"
        page = g.page
        out.append(Group(kind=g.kind, label=label, num_layers=g.num_layers,
                         block_bytes=plan.bytes_per_block, block_tokens=page.block_size,
                         token_bytes=g.num_layers * page.bytes_per_token,
                         state_bytes=g.num_layers * page.state_bytes,
                         window=page.window, chunk=page.chunk))
    return tuple(out)
