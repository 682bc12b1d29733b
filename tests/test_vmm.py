"""The vmm allocator (vAttention): worked examples, a state machine, the engine and the CLI."""

from __future__ import annotations

import heapq
import json
import math
from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fragsim.allocators import BlockTable, Extent, VMMAllocator, create
from fragsim.catalog import get_model
from fragsim.cli import main as cli_main
from fragsim.costmodel import FixedCostModel
from fragsim.engine import Engine, EngineConfig
from fragsim.simulate import RunSpec, load_workload, make_allocator, simulate

KiB, MiB = 1024, 1024 * 1024


# -- worked examples ---------------------------------------------------------------


def test_opt13b_on_2mib_pages_wastes_a_tail_per_page() -> None:
    """OPT-13B at tp=1: one token of one layer's K is 40 heads × 128 × 2 B = 10,240 B.

    2 MiB = 2,097,152 B holds 204 tokens (2,088,960 B) and 8,192 B of nothing.
    A pool offered as 1,000 slots is 10,240,000 B per buffer: 4 whole pages
    (8,388,608 B), i.e. 816 usable slots; 184 slots are lost, 4 × 8,192 B of them
    to page tails and the rest to the part of a page that does not exist.
    """
    token_bytes = get_model("opt-13b").kv_heads_per_gpu(1) * 128 * 2
    assert token_bytes == 10_240
    pool = create("vattention", 1000, token_bytes=token_bytes)
    assert isinstance(pool, VMMAllocator)
    assert (pool.tokens_per_page, pool.block_size, pool.num_pages) == (204, 204, 4)
    assert pool.capacity == 816 and pool.lost_slots == 184
    assert pool.page_tail_bytes == 4 * 8_192
    assert pool.virtual_len == 11 * 204  # max_seq_len 2048 rounded up to whole pages
    # internal fragmentation of one short request: the unfilled tail of its page
    assert pool.allocate(0, 150) == BlockTable(204, (0,))
    assert pool.num_owned(0) - 150 == 54
    pool.check()


def test_pages_map_on_demand_under_virtual_ranges() -> None:
    """64 KiB pages of 4 KiB tokens: 16 tokens a page; max_seq_len 40 -> 48-token ranges."""
    pool = VMMAllocator(8 * 16, page_bytes=64 * KiB, token_bytes=4 * KiB, max_seq_len=40)
    assert (pool.tokens_per_page, pool.num_pages, pool.virtual_len) == (16, 8, 48)
    assert pool.allocate(0, 20) == BlockTable(16, (0, 1))
    assert pool.allocate(1, 5) == BlockTable(16, (2,))
    # virtual   0: [0, 48)   1: [48, 96)        mapped   0: pages 0, 1   1: page 2
    assert pool.virtual_extent(0) == Extent(0, 48) and pool.virtual_extent(1) == Extent(48, 48)
    assert pool.extend(1, 12)  # 17 tokens: a second page
    assert pool.placement(1) == BlockTable(16, (2, 3))
    assert pool.num_mapped_pages() == 4 and pool.num_free() == 4 * 16
    pool.free(0)
    assert pool.allocate(2, 1) == BlockTable(16, (4,))  # FIFO: pages 0, 1 went to the tail
    assert pool.virtual_extent(2) == Extent(0, 48)  # the lowest virtual range is reused
    with pytest.raises(ValueError, match="exceed its virtual range of 48"):
        pool.extend(2, 48)
    with pytest.raises(ValueError, match="virtual range"):
        pool.allocate(3, 49)
    assert pool.extend(2, 47)  # exactly the range: fine
    pool.check()


def test_page_smaller_than_a_token_and_a_pool_smaller_than_a_page_are_refused() -> None:
    with pytest.raises(ValueError, match="page_bytes must be >= token_bytes=8192"):
        create("vmm", 100, page_bytes=4 * KiB, token_bytes=8 * KiB)
    with pytest.raises(ValueError, match="capacity must be >= one page"):
        create("vmm", 10, page_bytes=64 * KiB, token_bytes=4 * KiB)
    with pytest.raises(ValueError, match="reserve must be one of 'demand'"):
        create("vmm", 100, reserve="max")


def test_make_allocator_cuts_pages_from_the_models_token_bytes() -> None:
    spec = RunSpec(model="llama-3-8b", page_kb=64)
    pool = make_allocator("vmm", 100_000, spec)
    # 8 KV heads × 128 × 2 B = 2 KiB a token: 32 tokens in 64 KiB, no tail
    assert (pool.token_bytes, pool.tokens_per_page, pool.page_tail_bytes) == (2048, 32, 0)
    assert make_allocator("vattention", 100_000, RunSpec(model="llama-3-8b")).tokens_per_page == 1024
    # --page-kb overrides the preset's 2 MiB, as --block-size does vllm's 16
    assert make_allocator("vattention", 100_000, spec).tokens_per_page == 32


# -- state machine ------------------------------------------------------------------


class VMMMachine(RuleBasedStateMachine):
    """Against a shadow: a FIFO queue of page ids and a heap of virtual range indices."""

    @initialize(pages=st.integers(1, 12), tokens_per_page=st.integers(1, 6),
                tail=st.integers(0, 2), max_seq_len=st.integers(1, 30))
    def start(self, pages: int, tokens_per_page: int, tail: int, max_seq_len: int) -> None:
        token_bytes = 3
        page_bytes = tokens_per_page * token_bytes + tail  # tail < token_bytes: wasted
        # offer a little more than the pages: the part of a page short is lost
        offered = -(-pages * page_bytes // token_bytes)
        self.pool = VMMAllocator(offered, page_bytes=page_bytes, token_bytes=token_bytes,
                                 max_seq_len=max_seq_len)
        self.tpp, self.pages = tokens_per_page, offered * token_bytes // page_bytes
        assert self.pool.num_pages == self.pages
        assert self.pool.capacity == self.pages * tokens_per_page
        assert self.pool.page_tail_bytes == self.pages * tail
        self.range = -(-max_seq_len // tokens_per_page) * tokens_per_page
        self.queue = deque(range(self.pages))
        self.tables: dict[int, list[int]] = {}
        self.requested: dict[int, int] = {}
        self.virtual: dict[int, int] = {}
        self.free_virtual: list[int] = []
        self.next_virtual = 0
        self.next_id = 0

    @rule(n=st.integers(1, 30))
    def allocate(self, n: int) -> None:
        seq = self.next_id
        self.next_id += 1
        if n > self.range:
            with pytest.raises(ValueError, match="virtual range"):
                self.pool.allocate(seq, n)
            return
        pages = -(-n // self.tpp)
        placement = self.pool.allocate(seq, n)
        if pages > len(self.queue):
            assert placement is None
            return
        want = [self.queue.popleft() for _ in range(pages)]
        assert placement == BlockTable(self.tpp, tuple(want))
        index = heapq.heappop(self.free_virtual) if self.free_virtual else self.next_virtual
        self.next_virtual += index == self.next_virtual
        assert self.pool.virtual_extent(seq) == Extent(index * self.range, self.range)
        self.tables[seq], self.requested[seq], self.virtual[seq] = want, n, index

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), k=st.integers(1, 10))
    def extend(self, data: st.DataObject, k: int) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tables)))
        total = self.requested[seq] + k
        if total > self.range:
            with pytest.raises(ValueError, match="virtual range"):
                self.pool.extend(seq, k)
            return
        missing = -(-total // self.tpp) - len(self.tables[seq])
        ok = missing <= len(self.queue)
        assert self.pool.extend(seq, k) == ok
        if ok:
            self.tables[seq] += [self.queue.popleft() for _ in range(max(0, missing))]
            self.requested[seq] = total

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tables)))
        self.pool.free(seq)
        self.queue.extend(self.tables.pop(seq))
        del self.requested[seq]
        heapq.heappush(self.free_virtual, self.virtual.pop(seq))

    @invariant()
    def agrees(self) -> None:
        pool = self.pool
        pool.check()
        for seq, pages in self.tables.items():
            assert pool.placement(seq).block_ids == tuple(pages)
            assert pool.num_owned(seq) == len(pages) * self.tpp >= pool.num_requested(seq)
        assert pool.num_free() == len(self.queue) * self.tpp == pool.largest_allocatable()
        assert pool.free_block_ids() == list(self.queue)
        extents = sorted(pool.virtual_extent(s).offset for s in self.tables)
        assert len(set(extents)) == len(extents)  # virtual ranges never overlap


def test_vmm_state_machine() -> None:
    VMMMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
    VMMMachine.TestCase().runTest()


# -- the engine ---------------------------------------------------------------------


def test_vmm_with_16_token_pages_is_vllm() -> None:
    """A page of 16 tokens is a 16-slot block: the whole run must come out the same."""
    spec = RunSpec(trace="azure-conv", num_requests=150)
    trace = load_workload(spec)
    summaries = []
    for alloc in (create("vllm", 6000), create("vmm", 6000, page_bytes=64 * KiB, token_bytes=4 * KiB)):
        engine = Engine(trace, alloc, FixedCostModel(0.02), EngineConfig(check=True)).run()
        summaries.append((engine.rec.means(), engine.rec.counters.to_dict(), engine.requests.finish.tolist()))
    assert summaries[0] == summaries[1]


@pytest.mark.parametrize("page_kb", [64, 2048])
def test_vmm_stretches_match_exact_steps(page_kb: int) -> None:
    options = {"num_requests": 120, "kv_slots": 5000, "page_kb": page_kb}
    spec = RunSpec(trace="azure-conv", **options)
    trace = load_workload(spec)
    fast = simulate(trace, "vmm", spec, check=True).summary
    exact = simulate(trace, "vmm", RunSpec(trace="azure-conv", exact_steps=True, **options)).summary
    assert fast["num_events"] < exact["num_events"]
    for key, value in exact.items():
        if key in ("wall_time_s", "num_events"):
            continue
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(fast[key]), key
        elif isinstance(value, float):
            assert fast[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key
        else:
            assert fast[key] == value, key


def test_bigger_pages_waste_more_inside_and_at_the_tails() -> None:
    spec = RunSpec(trace="azure-conv", num_requests=300)
    trace = load_workload(spec)
    small = simulate(trace, "vmm", RunSpec(trace="azure-conv", num_requests=300, page_kb=64)).summary
    big = simulate(trace, "vattention", spec).summary
    # OPT-13B: 64 KiB holds 6 tokens (4 KiB tail), 2 MiB holds 204 (8 KiB tail)
    assert (small["vmm_tokens_per_page"], big["vmm_tokens_per_page"]) == (6, 204)
    assert big["internal_fragmentation_frac"] > 10 * small["internal_fragmentation_frac"]
    pages_small = small["capacity_slots"] // 6
    assert small["page_tail_bytes"] == pages_small * 4096 * 80  # 80 buffers: 2 × 40 layers
    assert big["page_tail_bytes"] == big["capacity_slots"] // 204 * 8192 * 80


def test_cli_runs_vmm_with_a_page_size(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["run", "--model", "opt-13b", "--gpu", "a100-40gb", "--allocator", "vmm,vattention",
                     "--page-kb", "2048", "--num-requests", "60",
                     "--no-save", "--json"])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["allocator"] for r in rows] == ["vmm", "vattention"]
    assert rows[0]["vmm_tokens_per_page"] == rows[1]["vmm_tokens_per_page"] == 204
    assert rows[0]["page_tail_bytes"] > 0 and rows[0]["blocks_saved_frac"] == 0.0
    assert np.isclose(sum(rows[0][f"{q}_frac"] for q in ("token_states", "reservation",
                                                         "internal_fragmentation", "free")), 1.0)
