"""The public surface: create() and its presets, option errors, reservation policies,
and the misuse every allocator must refuse the same way."""

from __future__ import annotations

import pickle

import pytest

from fragsim.allocators import (
    PLACEMENTS,
    PRESETS,
    RESERVE_POLICIES,
    Allocator,
    create,
    reserve_slots,
)
from fragsim.allocators.base import BlockTable, Extent, new_block_table, new_extent
from fragsim.errors import FragsimError

# -- errors every allocator shares -----------------------------------------------


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_misuse_raises_value_error(placement: str) -> None:
    pool = create(placement, 256, max_seq_len=64)
    pool.allocate(0, 4)
    with pytest.raises(ValueError, match="already allocated"):
        pool.allocate(0, 4)
    with pytest.raises(ValueError, match=">= 1"):
        pool.allocate(1, 0)
    with pytest.raises(ValueError, match=">= 1"):
        pool.extend(0, 0)
    with pytest.raises(ValueError, match="unknown sequence 7"):
        pool.extend(7, 1)
    with pytest.raises(ValueError, match="unknown sequence 7"):
        pool.free(7)
    with pytest.raises(ValueError, match="unknown sequence 7"):
        pool.placement(7)
    pool.check()


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_failed_allocate_changes_nothing(placement: str) -> None:
    pool = create(placement, 64, max_seq_len=64)
    assert pool.allocate(0, 40) is not None
    before = (pool.num_free(), pool.largest_allocatable(), pool.placement(0))
    assert pool.allocate(1, 64) is None
    assert not pool.can_allocate(64)
    assert (pool.num_free(), pool.largest_allocatable(), pool.placement(0)) == before
    assert pool.seq_ids() == [0]
    pool.check()


# -- create() ----------------------------------------------------------------------


def test_presets_pair_a_placement_with_a_policy() -> None:
    expected = {
        "ft-static": ("static", "max", False),
        "orca-max": ("buddy", "max", False),
        "orca-pow2": ("buddy", "pow2", False),
        "orca-oracle": ("buddy", "oracle", False),
        "vllm": ("paged", "demand", True),
        "vattention": ("vmm", "demand", True),
    }
    assert set(PRESETS) == set(expected)
    for name, (placement, reserve, grows) in expected.items():
        pool = create(name, 4096)
        assert isinstance(pool, PLACEMENTS[placement])
        assert isinstance(pool, Allocator)
        assert (pool.name, pool.placement_name, pool.reserve, pool.grows_on_demand) == (
            name,
            placement,
            reserve,
            grows,
        )
        assert pool.max_seq_len == 2048
    assert create("vllm", 4096).block_size == 16  # type: ignore[attr-defined]
    assert create("vllm", 4096, block_size=32).block_size == 32  # type: ignore[attr-defined]


def test_plain_placements_default_and_override_reserve() -> None:
    assert [create(p, 4096).reserve for p in ("static", "contiguous", "buddy", "paged")] == [
        "max",
        "max",
        "max",
        "demand",
    ]
    assert create("contiguous", 4096, reserve="oracle").reserve == "oracle"


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("nope", {}, "unknown allocator 'nope'; placements: static, contiguous, buddy, paged"),
        ("static", {"capacity": 0}, "capacity must be an integer >= 1, got 0"),
        ("paged", {"block_size": 0}, "block_size must be an integer >= 1, got 0"),
        ("contiguous", {"fit": "worst"}, "fit must be one of 'first', 'best', got 'worst'"),
        ("static", {"max_seq_len": 0}, "max_seq_len must be an integer >= 1, got 0"),
        ("buddy", {"min_block": 3}, "min_block must be a power of two, got 3"),
        (
            "buddy",
            {"block_size": 16},
            "has no option 'block_size'; allowed: min_block, max_seq_len, reserve",
        ),
        ("paged", {"reserve": "max"}, "reserve must be one of 'demand', got 'max'"),
        ("static", {"reserve": "demand"}, "reserve must be one of 'max', 'pow2', 'oracle'"),
        ("vllm", {"reserve": "max"}, "preset 'vllm' reserves 'demand'"),
        ("static", {"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1"),
    ],
)
def test_create_rejects_bad_names_and_options(
    name: str, options: dict[str, object], message: str
) -> None:
    capacity = options.pop("capacity", 4096)
    with pytest.raises(
        ValueError, match="^.*" + message.replace("(", r"\(").replace(")", r"\)")
    ) as info:
        create(name, capacity, **options)  # type: ignore[arg-type]
    assert isinstance(info.value, FragsimError)  # the CLI prints it as one line


# -- reservation policies -----------------------------------------------------------


def test_reservation_policies_for_a_prompt_of_100() -> None:
    assert RESERVE_POLICIES == ("max", "pow2", "oracle", "demand")
    # the vLLM paper's Pow2: a true output of 25 reserves 32 positions
    assert reserve_slots("pow2", 100, 25, 2048) == 100 + 32
    assert reserve_slots("pow2", 100, 32, 2048) == 100 + 32
    assert reserve_slots("pow2", 100, 33, 2048) == 100 + 64
    assert reserve_slots("pow2", 100, 1, 2048) == 100 + 1
    assert reserve_slots("max", 100, 25, 2048) == 2048
    assert reserve_slots("oracle", 100, 25, 2048) == 125
    assert reserve_slots("demand", 100, 25, 2048) == 101


def test_reservation_never_exceeds_max_seq_len() -> None:
    # 1500 + next_pow2(600) = 1500 + 1024 = 2524 -> capped
    assert reserve_slots("pow2", 1500, 600, 2048) == 2048
    assert reserve_slots("oracle", 2000, 100, 2048) == 2048  # the engine refuses it anyway
    assert reserve_slots("max", 10, 10, 512) == 512
    assert reserve_slots("demand", 2048, 0, 2048) == 2048
    for policy in RESERVE_POLICIES:
        for prompt_len, output_len in [(1, 0), (1, 1), (2047, 1), (1000, 1049), (3000, 3000)]:
            assert 1 <= reserve_slots(policy, prompt_len, output_len, 2048) <= 2048


def test_reservation_rejects_unknown_policy_and_bad_lengths() -> None:
    with pytest.raises(
        ValueError,
        match="unknown reservation policy 'pow3'; allowed: 'max', 'pow2', 'oracle', 'demand'",
    ):
        reserve_slots("pow3", 100, 25, 2048)
    with pytest.raises(ValueError, match="prompt_len must be an integer >= 1, got 0"):
        reserve_slots("max", 0, 25, 2048)
    with pytest.raises(ValueError, match="output_len must be an integer >= 0, got -1"):
        reserve_slots("max", 10, -1, 2048)


def test_fast_constructors_build_the_same_immutable_objects() -> None:
    """The allocators' hot paths skip the generated __new__; nothing may tell the difference."""
    pairs: list[tuple[Extent | BlockTable, Extent | BlockTable]] = [
        (new_extent(3, 4), Extent(3, 4)),
        (new_block_table(16, (5, 1)), BlockTable(16, (5, 1))),
    ]
    for fast, plain in pairs:
        assert type(fast) is type(plain)
        assert fast == plain and hash(fast) == hash(plain) and repr(fast) == repr(plain)
        assert pickle.loads(pickle.dumps(fast)) == plain
        assert fast._asdict() == plain._asdict()
        with pytest.raises(AttributeError):
            setattr(fast, fast._fields[0], 1)  # noqa: B010 (a named tuple's fields are read-only)
    assert Extent(3, 4) != BlockTable(3, (4,)) and BlockTable(4, (1, 2)).length == 8
