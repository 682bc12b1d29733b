"""The GPU backend on CPU tensors (Triton interpreter): device and simulation agree exactly."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fragsim.allocators import BlockTable  # noqa: E402
from fragsim.engine_views import live_sequences  # noqa: E402
from fragsim.simulate import RunSpec  # noqa: E402
from gpu_backend.pool import KVPool, ValidationError  # noqa: E402
from gpu_backend.validate import ModelShape, run_validation  # noqa: E402

SHAPE = ModelShape(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32")


@pytest.mark.parametrize("allocator", ["vllm", "orca-max", "orca-pow2", "orca-oracle", "ft-static",
                                       "contiguous"])
def test_validate_agrees_for_every_allocator(allocator: str) -> None:
    spec = RunSpec(trace="azure-conv", num_requests=24)
    report = run_validation(spec, allocator, shape=SHAPE, scale=0.04, attention_every=7)
    assert report.error is None
    assert report.ok
    assert report.steps_checked > 20
    assert report.attention_checks > 0 and report.content_checks > 0
    assert {row["quantity"] for row in report.table} >= {"mean token_states (slots)", "peak running"}


def test_validate_under_memory_pressure_with_preemption() -> None:
    spec = RunSpec(trace="azure-code", num_requests=20, kv_slots=160)
    report = run_validation(spec, "vllm", shape=SHAPE, scale=0.03, attention_every=5)
    assert report.ok, report.error


def test_corrupted_block_table_is_caught() -> None:
    """Point one sequence's block at another's: the device sees two owners for one slot."""
    done = []

    def corrupt(backend, engine) -> None:
        live = [s.req for s in live_sequences(engine)]
        if done or len(live) < 2:
            return
        done.append(backend._step)
        alloc = engine.kv.alloc
        a, b = live[0], live[1]
        stolen = alloc.placement(b).block_ids[0]
        table = alloc.placement(a)
        alloc._seqs[a][1] = BlockTable(table.block_size, (stolen, *table.block_ids[1:]))

    spec = RunSpec(trace="azure-conv", num_requests=12, rate=50.0)
    report = run_validation(spec, "vllm", shape=SHAPE, scale=0.04, attention_every=3, corrupt=corrupt)
    assert done and not report.ok
    # Caught by whichever check reads the bad table first: the attention kernel reading
    # another request's K/V, or the ownership sync finding a slot with two owners.
    assert report.error is not None
    assert "attention of request" in report.error or "already owned by request" in report.error


def test_lost_write_is_caught_with_request_and_position() -> None:
    def corrupt(backend, engine) -> None:
        if backend._step == 6:
            req = live_sequences(engine)[0].req
            slot = int(backend._tracked[req].slots[2])
            backend.pool.k[0, slot] = 0.0

    spec = RunSpec(trace="azure-conv", num_requests=8)
    report = run_validation(spec, "orca-oracle", shape=SHAPE, scale=0.04, corrupt=corrupt)
    assert report.error is not None
    assert "position 2" in report.error and "wrong K/V" in report.error


def test_pool_measures_split_from_tensors() -> None:
    pool = KVPool(1, 32, 1, 4, dtype=torch.float32)
    slots = torch.arange(8, 16)
    pool.assign(slots, req=3, positions=torch.arange(8), final=6)
    pool.write(slots[:4], 3, torch.arange(4))
    m = pool.measure()
    # 8 owned: 4 written, positions 6 and 7 are beyond the final length 6 -> internal 2
    assert (m.token_states, m.reservation, m.internal_fragmentation, m.free) == (4, 2, 2, 24)
    assert pool.largest_free_run() == 16
    assert pool.free_blocks(8, 4) == 3
    assert pool.largest_aligned_free([(0, 32)]) == 16
    with pytest.raises(ValidationError, match="already owned"):
        pool.assign(torch.tensor([9]), req=4, positions=torch.tensor([0]), final=1)
    assert isinstance(BlockTable(4, (1, 2)).slot(5), int)
