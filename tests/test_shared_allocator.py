"""The shared paged allocator: ref counts, copy-on-write, prefix cache, against a content model.

The state machine keeps a *device*: what every slot of every block holds, as
labels. Every position a sequence asks for is written with its own label; a fork
shares the parent's positions; a cache hit must find the positions of the
prompt it was keyed by. After every rule each live sequence must read back,
through its block table, exactly the labels it expects: a write into a shared
block without a copy, a wrong copy, or a stale cache hit after an eviction all
show up as a wrong label. The free queue is shadowed independently from the
policy (FIFO, freed tables tail first, hits taken out of the middle, eviction
at the head).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fragsim.allocators import BlockTable, SharedPagedAllocator, create


def test_fork_and_copy_on_write_as_the_docstring_draws() -> None:
    pool = create("paged-shared", 8 * 4, block_size=4)
    pool.log_copies = True
    pool.allocate(0, 6)
    pool.fork(0, 1, 6)
    pool.fork(0, 2, 4)
    assert [pool.placement(s).block_ids for s in (0, 1, 2)] == [(0, 1), (0, 1), (0,)]
    assert [pool.ref_cnt(b) for b in (0, 1)] == [3, 2]
    assert pool.num_shared_slots() == 4 * 3  # block 0 twice too often, block 1 once
    assert pool.num_free() == 6 * 4
    assert pool.extend(1, 1)  # position 6 lies in block 1, shared with 0: copy first
    assert pool.placement(1) == BlockTable(4, (0, 2))
    assert pool.take_copies() == [(1, 2)]
    assert [pool.ref_cnt(b) for b in (0, 1, 2)] == [3, 1, 1]
    assert pool.extend(0, 1)  # 0 is block 1's last holder: writes in place
    assert pool.placement(0) == BlockTable(4, (0, 1)) and pool.take_copies() == []
    assert pool.extend(2, 1)  # 2's 4 slots end on a block boundary: a new block, no copy
    assert pool.placement(2) == BlockTable(4, (0, 3)) and pool.take_copies() == []
    pool.check()
    for seq in (0, 1, 2):
        pool.free(seq)
    assert pool.num_free() == pool.capacity and pool.num_shared_slots() == 0
    pool.check()


def test_copy_on_write_needs_a_free_block() -> None:
    pool = create("paged-shared", 2 * 4, block_size=4)
    pool.allocate(0, 3)
    pool.fork(0, 1)
    assert pool.allocate(2, 4) is not None  # the last free block
    assert not pool.extend(1, 1)  # must copy block 0, nothing free: refused, nothing changed
    assert pool.placement(1).block_ids == (0,) and pool.num_requested(1) == 3
    pool.check()


def test_prefix_cache_lru_order_hits_and_eviction() -> None:
    """Free queue after each step (head first); ``*`` marks a free block that is still cached."""
    pool = SharedPagedAllocator(6 * 2, block_size=2)
    a_keys = ["a0", "a1"]
    pool.allocate(0, 5)                       # blocks 0 1 2; queue 3 4 5
    pool.cache_blocks(0, a_keys)              # 0 = a0, 1 = a1
    pool.allocate(1, 2)                       # block 3; queue 4 5
    pool.free(0)                              # tail first: queue 4 5 2 1* 0*
    assert pool.free_block_ids() == [4, 5, 2, 1, 0]
    assert pool.num_evictable_blocks() == 2 and pool.num_free() == 5 * 2
    assert pool.cache_hits(["a0", "a1", "a2"]) == (2, 2)
    assert pool.cache_hits(["a9", "a1"]) == (0, 0)  # hits count as a prefix only
    pool.allocate(2, 5, cached=a_keys)        # hits 0 1 out of the middle, fresh 4
    assert pool.placement(2).block_ids == (0, 1, 4)
    assert pool.free_block_ids() == [5, 2]
    assert pool.num_shared_slots() == 0 and pool.num_evictable_blocks() == 0
    pool.fork(2, 3, 4)                        # a second holder of the cached blocks
    assert pool.cache_hits(a_keys) == (2, 0) and pool.num_shared_slots() == 4
    for seq in (2, 1, 3):
        pool.free(seq)                        # queue 5 2 4 3 1* 0*  (0, 1 freed by 3, last holder)
    assert pool.free_block_ids() == [5, 2, 4, 3, 1, 0]
    assert pool.allocate(4, 10) is not None   # five blocks: evicts a1, the older
    assert pool.cache_hits(a_keys) == (1, 1) and pool.num_evictions == 1
    pool.free(4)
    assert pool.allocate(5, 12) is not None   # all six: a0 goes too
    assert pool.cache_hits(a_keys) == (0, 0) and pool.num_evictions == 2
    assert pool.num_cached_blocks() == 0
    pool.check()


def test_a_key_stays_with_the_first_block_cached_under_it() -> None:
    pool = SharedPagedAllocator(8 * 2, block_size=2)
    pool.allocate(0, 3)
    pool.allocate(1, 3)                       # the same prompt computed twice (one step)
    pool.cache_blocks(0, ["p0"])
    pool.cache_blocks(1, ["p0"])              # already cached for block 0: block 2 stays private
    assert pool.cache_hits(["p0"]) == (1, 0)
    pool.free(0)
    assert pool.allocate(2, 3, cached=["p0"]).block_ids[0] == 0
    with pytest.raises(KeyError):
        pool.allocate(3, 3, cached=["nope"])
    pool.check()


class SharedMachine(RuleBasedStateMachine):
    """Allocate (maybe from the cache), fork, extend, free, register: content must survive."""

    @initialize(num_blocks=st.integers(2, 12), block_size=st.integers(1, 4))
    def start(self, num_blocks: int, block_size: int) -> None:
        self.B = block_size
        self.pool = SharedPagedAllocator(num_blocks * block_size + block_size - 1, block_size=block_size)
        self.pool.log_copies = True
        self.device: dict[int, list[Any]] = {b: [None] * block_size for b in range(num_blocks)}
        self.expect: dict[int, list[Any]] = {}     # seq -> label per requested position
        self.prompt: dict[int, tuple[int, int]] = {}  # seq -> (prompt id, prompt length)
        self.tables: dict[int, list[int]] = {}
        self.queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cache: dict[Any, int] = {}
        self.key_of: dict[int, Any] = {}
        self.next_id = 0

    # -- shadow helpers --------------------------------------------------------------

    def refs(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for ids in self.tables.values():
            for b in ids:
                out[b] = out.get(b, 0) + 1
        return out

    def take(self) -> int:
        block, _ = self.queue.popitem(last=False)
        key = self.key_of.pop(block, None)
        if key is not None:
            del self.cache[key]
        return block

    def write(self, seq: int, start: int, end: int) -> None:
        for q in range(start, end):
            label = self.expect[seq][q]
            self.device[self.tables[seq][q // self.B]][q % self.B] = label

    # -- rules ---------------------------------------------------------------------

    @rule(n=st.integers(1, 14), prompt_id=st.integers(0, 2), use_cache=st.booleans())
    def allocate(self, n: int, prompt_id: int, use_cache: bool) -> None:
        seq = self.next_id
        self.next_id += 1
        B = self.B
        keys = [("p", prompt_id, k) for k in range((n - 1) // B)] if use_cache else []
        hits = 0
        while hits < len(keys) and keys[hits] in self.cache:
            hits += 1
        refs = self.refs()
        from_free = sum(1 for k in keys[:hits] if refs.get(self.cache[k], 0) == 0)
        assert self.pool.cache_hits(keys) == (hits, from_free)
        blocks = -(-n // B)
        fits = blocks - hits + from_free <= len(self.queue)
        table = self.pool.allocate(seq, n, cached=keys[:hits])
        if not fits:
            assert table is None
            return
        hit_blocks = [self.cache[k] for k in keys[:hits]]
        for b in hit_blocks:
            self.queue.pop(b, None)
        want = hit_blocks + [self.take() for _ in range(blocks - hits)]
        assert table is not None and table.block_ids == tuple(want)
        self.tables[seq] = want
        self.expect[seq] = [("p", prompt_id, q) for q in range(n)]
        self.prompt[seq] = (prompt_id, n)
        self.write(seq, hits * B, n)  # the cached positions must already be there

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tables)))
        num_slots = data.draw(st.integers(1, len(self.expect[parent])))
        child = self.next_id
        self.next_id += 1
        table = self.pool.fork(parent, child, num_slots)
        self.tables[child] = self.tables[parent][: -(-num_slots // self.B)]
        assert table.block_ids == tuple(self.tables[child])
        self.expect[child] = self.expect[parent][:num_slots]

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), k=st.integers(1, 6))
    def extend(self, data: st.DataObject, k: int) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tables)))
        B, ids = self.B, self.tables[seq]
        requested = len(self.expect[seq])
        missing = -(-(requested + k) // B) - len(ids)
        cow = requested % B != 0 and self.refs()[ids[-1]] > 1
        ok = missing + cow <= len(self.queue)
        assert self.pool.extend(seq, k) == ok
        if not ok:
            assert self.pool.take_copies() == []
            return
        if cow:
            src, dst = ids[-1], self.take()
            assert self.pool.take_copies() == [(src, dst)]
            self.device[dst] = list(self.device[src])
            ids[-1] = dst
        else:
            assert self.pool.take_copies() == []
            if requested % B and ids[-1] in self.key_of:  # written in place: no longer cached
                del self.cache[self.key_of.pop(ids[-1])]
        ids += [self.take() for _ in range(missing)]
        self.expect[seq] += [("s", seq, q) for q in range(requested, requested + k)]
        self.write(seq, requested, requested + k)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tables)))
        self.pool.free(seq)
        ids = self.tables.pop(seq)
        del self.expect[seq]
        self.prompt.pop(seq, None)
        refs = self.refs()
        for b in reversed(ids):
            if refs.get(b, 0) == 0:
                self.queue[b] = None

    @precondition(lambda self: self.prompt)
    @rule(data=st.data())
    def register(self, data: st.DataObject) -> None:
        """Cache the full blocks of a prompt (as the engine does once they are computed)."""
        seq = data.draw(st.sampled_from(sorted(self.prompt)))
        prompt_id, n = self.prompt[seq]
        keys = [("p", prompt_id, k) for k in range(n // self.B)]
        self.pool.cache_blocks(seq, keys)
        for block, key in zip(self.tables[seq], keys, strict=False):
            if block not in self.key_of and key not in self.cache:
                self.cache[key], self.key_of[block] = block, key

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def agrees(self) -> None:
        pool, B = self.pool, self.B
        pool.check()
        refs = self.refs()
        for seq, ids in self.tables.items():
            assert pool.placement(seq).block_ids == tuple(ids)
            for q, label in enumerate(self.expect[seq]):
                assert self.device[ids[q // B]][q % B] == label, f"seq {seq} position {q}"
        assert all(pool.ref_cnt(b) == r for b, r in refs.items())
        assert pool.num_shared_slots() == B * sum(r - 1 for r in refs.values())
        assert pool.free_block_ids() == list(self.queue)
        assert pool.num_free() == len(self.queue) * B == pool.largest_allocatable()
        assert pool.num_evictable_blocks() == sum(1 for b in self.queue if b in self.key_of)
        for key, block in self.cache.items():
            assert pool.cache_hits([key]) == (1, int(block in self.queue))
            _, prompt_id, k = key
            assert self.device[block] == [("p", prompt_id, k * B + i) for i in range(B)]


def test_shared_allocator_state_machine() -> None:
    SharedMachine.TestCase.settings = settings(max_examples=250, stateful_step_count=50, deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow])
    SharedMachine.TestCase().runTest()
