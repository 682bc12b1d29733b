"""The per-kind memory rule: its three forms (ints, numpy, torch) agree, and each
kind's next change is where its skipped blocks really change."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fragsim.kinds import FULL, Chunked, Full, Kind, Sliding, State, rule_of

kinds = st.one_of(
    st.just(FULL),
    st.integers(1, 5000).map(Sliding),
    st.integers(1, 9000).map(Chunked),
    st.builds(State, align=st.booleans(), checkpoints=st.integers(0, 1)),
)
lengths = st.lists(st.integers(0, 200_000), min_size=1, max_size=40)
block_sizes = st.sampled_from([1, 4, 16, 64, 80, 528, 1040])


def _three(fn, values: list[int]) -> tuple[list[int], list[int], list[int]]:
    ints = [int(fn(v)) for v in values]
    arrays = np.asarray(fn(np.array(values, dtype=np.int64))).tolist()
    tensors = fn(torch.tensor(values, dtype=torch.int64)).tolist()
    return ints, arrays, tensors


@settings(max_examples=300, deadline=None)
@given(kind=kinds, computed=lengths, block_size=block_sizes)
def test_ints_arrays_and_tensors_agree(kind: Kind, computed: list[int], block_size: int) -> None:
    forms = [
        lambda c: kind.skipped(c),
        lambda c: kind.skipped_blocks(c, block_size),
        lambda c: kind.held_blocks(c, 131_072, block_size),
        lambda c: kind.prompt_blocks(c + 1, 131_072, block_size),
    ]
    if kind.frees:
        forms.append(lambda c: kind.next_skip(c // block_size, block_size))
    for fn in forms:
        ints, arrays, tensors = _three(fn, computed)
        assert ints == arrays == tensors


@settings(max_examples=200, deadline=None)
@given(kind=kinds, block_size=block_sizes, lo=st.integers(0, 300))
def test_next_skip_is_where_the_skipped_blocks_change(kind: Kind, block_size: int, lo: int) -> None:
    if not kind.frees:
        with pytest.raises(ValueError):
            kind.next_skip(lo, block_size)
        return
    at = kind.next_skip(lo, block_size)
    assert kind.skipped_blocks(at, block_size) >= lo + 1
    assert at == 0 or kind.skipped_blocks(at - 1, block_size) <= lo


@settings(max_examples=200, deadline=None)
@given(kind=kinds, computed=st.integers(0, 100_000))
def test_skipped_never_passes_what_is_computed(kind: Kind, computed: int) -> None:
    assert 0 <= kind.skipped(computed) <= computed
    assert kind.skipped(computed) <= kind.skipped(computed + 1)


def test_worked_example() -> None:
    """The module docstring's: W = 8, B = 4, f = 19."""
    w = Sliding(8)
    assert w.skipped(19) == 12 and w.skipped_blocks(19, 4) == 3
    assert w.next_skip(3, 4) == 23          # position 15 leaves the window at f = 23
    c = Chunked(8)
    assert c.skipped(19) == 16 and c.next_skip(4, 4) == 24
    assert Full().skipped(19) == 0 and FULL.max_blocks(8192, 16, 4096) == 512
    assert w.max_blocks(8192, 4, 12) == 6   # ceil((7 + 12) / 4) + 1
    assert State(align=True).held_blocks(np.array([15, 16, 17]), 8192, 16).tolist() == [1, 2, 1]


def test_state_blocks_by_mode() -> None:
    """vLLM's MambaSpec: 1 block in "none" mode; in "align" mode (prefix caching) 2, and
    the prefill checkpoint block a Mamba-2 or FlashInfer-GDN spec adds. The State
    docstring's example: B = 16, a prompt of 40 keeps the states at 32 and at 40."""
    none, mamba1, mamba2 = State(), State(align=True), State(align=True, checkpoints=1)
    assert [k.max_blocks(8192, 16, 16384) for k in (none, mamba1, mamba2)] == [1, 2, 3]
    prompts = np.array([1, 16, 17, 40])
    assert none.prompt_blocks(prompts, 8192, 16).tolist() == [1, 1, 1, 1]
    assert mamba1.prompt_blocks(prompts, 8192, 16).tolist() == [1, 1, 1, 1]
    assert mamba2.prompt_blocks(prompts, 8192, 16).tolist() == [1, 1, 2, 2]
    assert mamba2.held_blocks(40, 8192, 16) == 1 and mamba2.held_blocks(48, 8192, 16) == 2


def test_a_prompt_step_skips_nothing_yet() -> None:
    """Nothing is computed when a prompt's step is allocated: every kind holds every
    position (vLLM's allocate_slots for gpt-oss at 1,000 tokens: 63 blocks in both groups)."""
    for kind in (FULL, Sliding(128), Chunked(256)):
        assert kind.prompt_blocks(1000, 131_072, 16) == 63
        assert kind.prompt_blocks(1000, 512, 16) == 32      # at most max_len


def test_rule_of_every_kind() -> None:
    assert rule_of("mla") is FULL and rule_of("mamba") == rule_of("linear") == State()
    assert rule_of("sliding", window=128) == Sliding(128)
    with pytest.raises(ValueError, match="shared"):
        rule_of("shared")
