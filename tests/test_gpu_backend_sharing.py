"""Shared blocks on the device (Triton interpreter on CPU): samples, beams, prefix caching.

The device must agree with the simulation exactly, and the bugs sharing invites
(a lost copy-on-write, a write into a shared block, a stale prefix-cache hit)
must each be caught.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fragsim.allocators import BlockTable, SharedPagedAllocator  # noqa: E402
from fragsim.simulate import RunSpec  # noqa: E402
from gpu_backend.backend import SharedDeviceBackend  # noqa: E402
from gpu_backend.validate import ModelShape, run_validation  # noqa: E402

SHAPE = ModelShape(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32")


def validate(**options: Any) -> tuple[Any, Any, Any]:
    """Run a 16-request slice at 4% scale; return the report, the backend and the engine."""
    seen: dict[str, Any] = {}

    def grab(backend: Any, engine: Any) -> None:
        seen.update(backend=backend, engine=engine)

    spec = RunSpec(trace="azure-conv", num_requests=16, **options)
    report = run_validation(spec, "vllm", shape=SHAPE, scale=0.04, attention_every=5, corrupt=grab)
    return report, seen.get("backend"), seen.get("engine")


@pytest.mark.parametrize("options", [
    {"num_samples": 3},
    {"beam_width": 3},
    {"prefix_caching": True, "system_prompt_len": 400},
    {"prefix_caching": True, "num_samples": 2, "system_prompt_len": 300, "kv_slots": 200},
], ids=["samples", "beams", "prefix", "prefix+samples+preemption"])
def test_validate_agrees_with_sharing(options: dict[str, Any]) -> None:
    report, backend, engine = validate(**options)
    assert report.ok, report.error
    assert isinstance(backend, SharedDeviceBackend)
    assert report.attention_checks > 0 and report.content_checks > 0
    assert engine.rec.peak_shared() > 0  # blocks really had several holders
    if options.get("num_samples", 1) > 1 or options.get("beam_width", 1) > 1:
        assert backend.copies_done > 0
    if options.get("prefix_caching"):
        assert engine.num_prefix_hits > 0
    if "kv_slots" in options:
        assert engine.rec.counters.num_preemptions > 0


def test_a_lost_copy_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SharedDeviceBackend, "_run_copies", lambda self: setattr(self, "_pending", []))
    report, _, _ = validate(beam_width=3)
    assert report.error is not None and "holds the wrong K/V" in report.error


def replay(trace: Any, capacity: int, **config: Any) -> tuple[SharedDeviceBackend, Any]:
    """A hand-made trace on the device (exact steps, 4-slot blocks, fixed 0.1 s steps)."""
    from fragsim.costmodel import FixedCostModel
    from fragsim.engine import Engine, EngineConfig
    from gpu_backend.pool import KVPool

    alloc = SharedPagedAllocator(capacity, block_size=4)
    engine = Engine(trace, alloc, FixedCostModel(0.1), EngineConfig(exact_steps=True, **config))
    pool = KVPool(SHAPE.num_layers, alloc.capacity, SHAPE.num_kv_heads, SHAPE.head_dim,
                  dtype=torch.float32)
    backend = SharedDeviceBackend(pool, alloc, SHAPE.num_q_heads, attention_layers=(0, 1))
    engine.attach(backend)
    engine.run()
    return backend, engine


def prefix_trace() -> Any:
    """A and C share an 8-token prefix (two blocks of 4); B, between them, needs 11 blocks."""
    import numpy as np

    from fragsim.traces import Trace

    return Trace("t", "t", np.array([0.0, 1.0, 2.0]), np.array([10, 40, 10]), np.array([2, 2, 2]),
                 block_hashes=[(7,), (8,), (7,)], block_hash_size=8)


def test_prefix_hits_by_hand_on_the_device() -> None:
    """16 blocks: A's two cached blocks survive B, C finds both. 12 blocks: B takes 11,
    evicting A's second block (the more recently freed first block stays): C finds one."""
    for capacity, hits in ((64, 8), (48, 4)):
        backend, engine = replay(prefix_trace(), capacity, prefix_caching=True)
        assert engine.num_prefix_hits == hits
        assert backend.attention_checks > 0 and backend.content_checks > 0
        assert all(r.simulated == r.measured for r in backend.records)


def test_a_stale_prefix_cache_hit_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """An allocator that reuses a cached block without evicting its key hands C B's K/V."""
    from gpu_backend.pool import ValidationError

    def take_without_evicting(self: SharedPagedAllocator, count: int) -> list[int]:
        out = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            if block in self._key_of:
                self._num_evictable -= 1
            self._ref[block] = 1
            out.append(block)
        return out

    monkeypatch.setattr(SharedPagedAllocator, "_take", take_without_evicting)
    with pytest.raises(ValidationError, match=r"\(request 2\) position 4 .* holds the wrong K/V"):
        replay(prefix_trace(), 48, prefix_caching=True)


def test_a_write_into_a_shared_block_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """An allocator that forgets copy-on-write once beams decode: a beam writes into the
    last block its sibling reads."""
    extend = SharedPagedAllocator.extend

    def extend_in_place(self: SharedPagedAllocator, seq_id: int, num_slots: int) -> bool:
        requested = self._requested[seq_id]
        if seq_id < 48:  # admission's 16 requests × 3 beams: copies as they should be
            return extend(self, seq_id, num_slots)
        ids = self._tables[seq_id].block_ids
        missing = -(-(requested + num_slots) // self.block_size) - len(ids)
        if missing > len(self._free):
            return False
        if missing > 0:
            self._tables[seq_id] = BlockTable(self.block_size, ids + tuple(self._take(missing)))
        self._requested[seq_id] = requested + num_slots
        return True

    monkeypatch.setattr(SharedPagedAllocator, "extend", extend_in_place)
    try:
        report, _, _ = validate(beam_width=3)
        error = report.error
    except AssertionError as exc:  # or the simulator's own split goes negative first
        error = str(exc)
    assert error is not None
    assert "holds the wrong K/V" in error or "simulated split" in error or "broken split" in error


@pytest.mark.parametrize("page_kb", [64, 2048])
def test_validate_agrees_for_vmm_pages(page_kb: int) -> None:
    """vmm's placement is the physical page table: the block-table kernel reads it as is."""
    spec = RunSpec(trace="azure-conv", num_requests=16, page_kb=page_kb)
    report = run_validation(spec, "vmm", shape=SHAPE, scale=0.04, attention_every=5)
    assert report.ok, report.error
    assert report.attention_checks > 0 and report.steps_checked > 10


def test_cli_validate_with_beams(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from fragsim.cli import main

    code = main(["validate", "--allocator", "vllm", "--num-requests", "12", "--beam-width", "2",
                 "--dtype", "float32", "--json", "--out", str(tmp_path)])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["attention_checks"] > 0


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_preempted_requests_on_the_device(preemption: str) -> None:
    """Three requests with one 8-token prefix in 10 blocks: the latest is preempted twice;
    swapped back in it is written anew, recomputed it finds its own prompt cached."""
    import numpy as np

    from fragsim.traces import Trace

    trace = Trace("t", "t", np.array([0.0, 0.0, 0.05]), np.array([10, 10, 10]), np.array([14, 14, 6]),
                  block_hashes=[(7,), (7,), (7,)], block_hash_size=8)
    backend, engine = replay(trace, 40, prefix_caching=True, preemption=preemption,
                             swap_space_slots=1000, kv_bytes_per_token=1)
    counters = engine.rec.counters
    assert (counters.num_preemptions_swap if preemption == "swap" else counters.num_preemptions_recompute) == 2
    assert engine.num_prefix_hits == (8 if preemption == "swap" else 24)
    assert all(r.simulated == r.measured for r in backend.records) and backend.content_checks > 0
