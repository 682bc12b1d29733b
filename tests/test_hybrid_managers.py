"""The hybrid KV managers: blocks held against vLLM's own figures, the byte split's
identity under random operation sequences, and each manager's pool invariants."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from oracles import hybrid_split_by_position

from fragsim.catalog import get_gpu, get_model
from fragsim.hybrid import (
    CATEGORIES,
    MANAGERS,
    Group,
    HybridManager,
    JengaManager,
    PagedUniformManager,
    StaticPartitionManager,
    VllmHybridManager,
    create_manager,
    kind_groups,
)
from fragsim.hybrid.jenga import large_page
from fragsim.hybrid.pools import Bin, BlockQueue, Ledger
from fragsim.vllm_plan import plan_vllm

H100 = get_gpu("h100-80gb")


@pytest.mark.parametrize("model_name, hybrid_chunked", [
    ("gpt-oss-20b", False), ("gemma-3-27b", False), ("jamba-mini-1.5", False),
    ("nemotron-h-8b", False), ("qwen3-next-80b-a3b", False), ("llama-4-scout", True),
    ("deepseek-v3", False),
])
def test_blocks_held_match_vllm_plan(model_name: str, hybrid_chunked: bool) -> None:
    """Growing one token at a time, each group holds what vLLM's allocate_slots leaves
    (VllmPlan.blocks_per_seq, itself checked against vLLM 0.33's KVCacheManager)."""
    model = get_model(model_name)
    tp = 8 if model_name in ("deepseek-v3", "qwen3-next-80b-a3b") else 1
    plan = plan_vllm(model, H100, 40 << 30, tp=tp, max_model_len=20000, prefix_caching=False,
                     hybrid_manager=True if hybrid_chunked else None)
    m = VllmHybridManager(plan, max_seq_len=20000)
    assert m.allocate(0, 1) is not None
    lengths = set(range(1, 3000)) | {8191, 8192, 8193, 16383, 16384, 16385, 19998}
    for length in range(1, 19999):
        assert m.extend(0, 1)
        if length in lengths:
            assert m.blocks_held(0) == plan.blocks_per_seq(length), length
    m.check()


def test_vllm_hybrid_pool_is_vllms() -> None:
    model = get_model("gemma-3-27b")
    plan = plan_vllm(model, H100, 30 << 30, max_model_len=8192, prefix_caching=False)
    m = VllmHybridManager(plan, max_seq_len=8192)
    assert m.num_free_blocks() == plan.num_gpu_blocks - 1          # block 0 is the null block
    assert len(m.rows) == len(plan.groups) == 7
    assert all(r.block_bytes == plan.bytes_per_block for r in m.rows)
    # The padding a block carries is the plan's: 8 phantom pages over the 7 groups.
    assert sum(r.padding_per_block for r in m.rows) == plan.padding_bytes_per_block


def test_split_categories_by_hand() -> None:
    """One sliding row (W = 8, blocks of 4) and one full row; numbers worked on paper."""
    rows = (Group(kind="sliding", label="sliding 8", num_layers=1, block_bytes=4 * 10, block_tokens=4,
                token_bytes=10, window=8),
            Group(kind="full", label="full", num_layers=1, block_bytes=4 * 10, block_tokens=4,
                token_bytes=10))
    m = StaticPartitionManager(rows, 10_000, max_seq_len=64, step_tokens=64)
    m.bind_finals(np.array([22]))
    m.allocate(0, 1)
    for _ in range(19):
        m.extend(0, 1)                     # q = 20, computed 19
    # sliding: window starts at 19 - 8 + 1 = 12 -> blocks 0..2 freed, holds 3, 4 = [12, 20)
    assert m.blocks_held(0) == [2, 5]
    split = m.split(np.array([0]), np.array([19]))
    sl, full = split[0], split[1]
    assert sl[CATEGORIES.index("token_states")] == 7 * 10       # positions 12..18
    assert sl[CATEGORIES.index("out_of_window")] == 0
    assert sl[CATEGORIES.index("reservation")] == 1 * 10        # position 19
    assert full[CATEGORIES.index("token_states")] == 19 * 10
    assert full[CATEGORIES.index("reservation")] == 1 * 10
    assert full[CATEGORIES.index("internal_fragmentation")] == 0  # 20 held, final 22
    assert (split == hybrid_split_by_position(m, np.array([0]), np.array([19]))).all()
    assert split.sum() == m.capacity
    # Paged-uniform keeps the window's blocks: out-of-window shows instead.
    rows_u = tuple(Group(**{**r.__dict__, "frees_window": False}) for r in rows)
    u = PagedUniformManager(rows_u, 10_000, max_seq_len=64, max_num_seqs=4)
    u.bind_finals(np.array([22]))
    u.allocate(0, 20)
    split = u.split(np.array([0]), np.array([19]))
    assert split[0, CATEGORIES.index("out_of_window")] == 12 * 10
    assert split[0, CATEGORIES.index("token_states")] == 7 * 10


def test_jenga_large_page_is_the_lcm() -> None:
    rows = (Group(kind="full", label="a", num_layers=1, block_bytes=2048, block_tokens=16, token_bytes=128),
            Group(kind="sliding", label="b", num_layers=1, block_bytes=3072, block_tokens=16,
                token_bytes=192, window=64))
    lcm, padded = large_page(rows)
    assert lcm == 6144 and [r.block_bytes for r in padded] == [2048, 3072]
    m = JengaManager(rows, 10 * 6144, max_seq_len=4096)
    assert m.per_large == [3, 2]


def test_jenga_places_a_request_in_its_own_large_pages() -> None:
    rows = (Group(kind="full", label="full", num_layers=1, block_bytes=64, block_tokens=4, token_bytes=16),)
    m = JengaManager(rows, 64 * 4 * 3, max_seq_len=64)  # large page = 64: one small page each
    assert m.large_page_bytes == 64
    big = (Group(kind="full", label="a", num_layers=1, block_bytes=64, block_tokens=4, token_bytes=16),
           Group(kind="mamba", label="m", num_layers=1, block_bytes=256, state_bytes=200))
    m = JengaManager(big, 256 * 4, max_seq_len=64)
    assert m.large_page_bytes == 256 and m.per_large == [4, 1]
    m.allocate(0, 4)
    m.allocate(1, 4)
    # each request's attention page opened its own large page; states take two more
    assert m.num_free_large() == 0
    m.free(0)
    assert m.num_free_large() == 2       # its attention large page and its state page
    m.check()


@pytest.mark.parametrize("name", MANAGERS)
@pytest.mark.parametrize("model_name", ["gpt-oss-20b", "gemma-3-27b", "jamba-mini-1.5", "llama-3.1-8b"])
def test_every_manager_builds_and_splits_exactly(name: str, model_name: str) -> None:
    model = get_model(model_name)
    m = create_manager(name, model, H100, pool_bytes=30 << 30, max_seq_len=4096, max_num_seqs=64)
    m.bind_finals(np.full(40, 4000))
    for s in range(8):
        assert m.allocate(s, 100 + 211 * s) is not None
    for _ in range(300):
        for s in range(8):
            assert m.extend(s, 1)
    seqs = np.arange(8)
    computed = np.array([m.num_requested(s) - 1 for s in seqs])
    split = m.split(seqs, computed)
    assert (split == hybrid_split_by_position(m, seqs, computed)).all()
    assert split.sum() == m.capacity and split.min() >= 0
    m.check()


# ------------------------------------------------------------ state machines

def _rows(kind: str) -> tuple[Group, ...]:
    full = Group(kind="full", label="full", num_layers=2, block_bytes=4 * 24, block_tokens=4, token_bytes=24)
    sliding = Group(kind="sliding", label="sliding 6", num_layers=3, block_bytes=4 * 36, block_tokens=4,
                  token_bytes=36, window=6)
    chunked = Group(kind="chunked", label="chunked 8", num_layers=1, block_bytes=4 * 12, block_tokens=4,
                  token_bytes=12, chunk=8)
    state = Group(kind="mamba", label="mamba", num_layers=2, block_bytes=100, state_bytes=100)
    if kind == "uniform":
        return tuple(Group(**{**r.__dict__, "frees_window": False}) for r in (full, sliding, chunked)) + (state,)
    return full, sliding, chunked, state


def _padded_plan_rows(rows: tuple[Group, ...]) -> tuple[Group, ...]:
    """Rows as vLLM would pad them: one page for all, blocks of 4 tokens."""
    page = max(r.block_bytes for r in rows)
    return tuple(Group(**{**r.__dict__, "block_bytes": page}) for r in rows)


def _make(kind: str, capacity: int, track_ids: bool = True) -> object:
    """A manager of ``kind``; ``track_ids=False``: its counts-only twin (a Ledger pool)."""
    if kind == "uniform":
        return PagedUniformManager(_rows(kind), capacity, max_seq_len=64, max_num_seqs=6, track_ids=track_ids)
    if kind == "static":
        return StaticPartitionManager(_rows(kind), capacity, max_seq_len=64, step_tokens=64, track_ids=track_ids)
    if kind == "jenga":
        return JengaManager(_rows(kind), capacity, max_seq_len=64, track_ids=track_ids)
    if kind == "jenga_carved":  # a few large pages, each of 3 full or 2 sliding small pages
        return JengaManager(_rows("jenga")[:2], capacity, max_seq_len=64, track_ids=track_ids)
    if kind == "jenga_equal":  # equal pages: a small page is a whole large page
        equal = tuple(Group(**{**r.__dict__, "block_bytes": 144}) for r in _rows("jenga"))
        return JengaManager(equal, capacity, max_seq_len=64, track_ids=track_ids)
    # the vLLM manager over hand-made rows (no plan needed for the pool logic)
    rows = _padded_plan_rows(_rows(kind))
    page = rows[0].block_bytes
    pool = (BlockQueue(rows, capacity, num_blocks=capacity // page, block_bytes=page) if track_ids
            else Ledger(rows, capacity, [Bin(capacity // page - 1, page, tuple(range(len(rows))))]))
    return HybridManager(name="vllm-hybrid", placement="vllm-hybrid", pool=pool, max_seq_len=64)


def _machine(kind: str) -> type:
    class Machine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.m = _make(kind, 2000 if kind == "jenga_carved" else 6000)
            # the counts-only twin makes every decision alike (jenga_carved keeps ids)
            self.twin = _make(kind, 2000 if kind == "jenga_carved" else 6000, track_ids=False)
            self.finals = np.full(64, 0)
            self.m.bind_finals(self.finals)
            self.twin.bind_finals(self.finals)
            self.computed: dict[int, int] = {}
            # what the engine asked for: after a stretch a sequence that moved no block
            # is further on than the manager's own count
            self.requested: dict[int, int] = {}
            self.next_id = 0

        @rule(length=st.integers(1, 40), extra=st.integers(0, 20))
        def allocate(self, length: int, extra: int) -> None:
            if self.next_id >= 64:
                return
            seq = self.next_id
            self.finals[seq] = min(64, length + extra)
            before = self.m.split(*self._live())
            ok = self.m.allocate(seq, min(length, 64)) is not None
            assert ok == (self.twin.allocate(seq, min(length, 64)) is not None)
            if ok:
                self.computed[seq] = 0
                self.requested[seq] = min(length, 64)
                self.next_id += 1
            else:
                assert (self.m.split(*self._live()) == before).all(), "failed allocate changed state"

        @precondition(lambda self: self.computed)
        @rule(data=st.data())
        def extend(self, data: st.DataObject) -> None:
            seq = data.draw(st.sampled_from(sorted(self.computed)))
            q = self.requested[seq]
            if q >= self.finals[seq]:
                return
            ok = self.m.extend(seq, q + 1 - self.m.num_requested(seq))
            assert ok == self.twin.extend(seq, q + 1 - self.twin.num_requested(seq))
            if ok:
                self.computed[seq] = q
                self.requested[seq] = q + 1

        @precondition(lambda self: self.computed)
        @rule(data=st.data())
        def grow_some(self, data: st.DataObject) -> None:
            """One decode step of some sequences at once: grow_many declines (nothing
            changes) or every block it moves is had."""
            seqs = [s for s in data.draw(st.lists(st.sampled_from(sorted(self.computed)), min_size=1,
                                                  unique=True))
                    if self.requested[s] < self.finals[s]]
            if not seqs:
                return
            targets = np.array([self.requested[s] + 1 for s in seqs], dtype=np.int64)
            before = self.m.split(*self._live())
            owned = self.m.grow_many(np.array(seqs, dtype=np.int64), targets)
            assert owned == self.twin.grow_many(np.array(seqs, dtype=np.int64), targets)
            if owned is None:
                assert (self.m.split(*self._live()) == before).all(), "declined growth changed state"
                return
            for s, t, o in zip(seqs, targets.tolist(), owned, strict=True):
                self.computed[s], self.requested[s] = t - 1, t
                assert o == self.m.num_owned(s)

        @precondition(lambda self: self.computed)
        @rule(k=st.integers(1, 12), head=st.none() | st.integers(1, 40))
        def stretch(self, k: int, head: int | None) -> None:
            """Up to k decode steps of every live sequence: the stretch stops before any
            step whose blocks might not be had, and its last split is the state's."""
            seqs = np.array(sorted(self.computed), dtype=np.int64)
            f0 = np.array([self.requested[s] for s in seqs.tolist()], dtype=np.int64)
            k = min(k, int((self.finals[seqs] - f0).min()))
            if k < 1:
                return
            taken, splits, largest, used, _ = self.m.stretch(seqs, seqs.copy(), f0, k, head)
            # The twin's steps are the same (its stretch may stop elsewhere: its limits
            # know the counts better, or less; the head is asked of the first part only).
            done = 0
            while done < taken:
                t, tw_splits, tw_largest, tw_used, _ = self.twin.stretch(seqs, seqs.copy(), f0 + done, taken - done,
                                                                         head if done == 0 else None)
                assert t > 0 or done == 0, "the counts-only twin stalls where the pool with ids went on"
                if t == 0:   # stopped before a step that might admit the head: go on without it
                    head = None
                    continue
                for mine, twins in ((splits, tw_splits), (largest, tw_largest), (used, tw_used)):
                    assert np.array_equal(mine[done:done + t], twins), "the counts-only twin's steps differ"
                done += t
            if not taken:
                return
            assert (splits[-1] == hybrid_split_by_position(self.m, seqs, f0 + taken - 1)).all(), "stretch's last split"
            for s, f in zip(seqs.tolist(), f0.tolist(), strict=True):
                self.computed[s], self.requested[s] = f + taken - 1, f + taken

        @precondition(lambda self: self.computed)
        @rule(data=st.data())
        def free(self, data: st.DataObject) -> None:
            seq = data.draw(st.sampled_from(sorted(self.computed)))
            self.m.free(seq)
            self.twin.free(seq)
            del self.computed[seq], self.requested[seq]

        def _live(self) -> tuple[np.ndarray, np.ndarray]:
            seqs = np.array(sorted(self.computed), dtype=np.int64)
            return seqs, np.array([self.computed[s] for s in seqs], dtype=np.int64)

        @invariant()
        def split_is_exact(self) -> None:
            seqs, computed = self._live()
            fast = self.m.split(seqs, computed)
            assert (fast == hybrid_split_by_position(self.m, seqs, computed)).all()
            assert fast.sum() == self.m.capacity and fast.min() >= 0
            assert self.m.num_free() == fast[:, CATEGORIES.index("free")].sum()
            assert 0 <= self.m.largest_allocatable() <= self.m.num_free()
            self.m.check()
            assert np.array_equal(self.twin.split(seqs, computed), fast)
            assert self.twin.largest_allocatable() == self.m.largest_allocatable()
            assert self.twin.num_used_blocks() == self.m.num_used_blocks()
            self.twin.check()

    Machine.__name__ = f"Machine_{kind}"
    return Machine


for _kind in ("uniform", "vllm", "jenga", "jenga_carved", "jenga_equal", "static"):
    _cls = _machine(_kind)
    _cls.TestCase.settings = settings(max_examples=40, stateful_step_count=60, deadline=None)
    globals()[f"TestStateMachine_{_kind}"] = _cls.TestCase


def test_kind_groups_of_gpt_oss() -> None:
    rows = kind_groups(get_model("gpt-oss-120b"))
    assert [r.label for r in rows] == ["sliding 128", "full"]
    assert rows[0].num_layers == rows[1].num_layers == 18


def test_jenga_moves_never_run_out_of_pages() -> None:
    """Many short sequences on a few carved large pages, grown a step at a time and in
    stretches: every move a fit check lets through finds its small pages. (A check that
    counted free slots without the frees that empty a large page, turning its slots into a
    whole page another kind then takes, let moves through that ran out: 5 of these seeds.)"""
    full, sliding = _rows("jenga")[:2]
    for trial in range(650):
        rnd = random.Random(trial)
        m = JengaManager((full, sliding), 288 * rnd.randint(3, 10), max_seq_len=64)
        m.bind_finals(np.full(400, 64))
        requested: dict[int, int] = {}
        for seq in range(200):
            r = rnd.random()
            if r < 0.3:
                n = rnd.randint(1, 12)
                if m.allocate(seq, n) is not None:
                    requested[seq] = n
            elif r < 0.4 and requested:
                gone = rnd.choice(sorted(requested))
                m.free(gone)
                del requested[gone]
            elif r < 0.8 and requested:
                seqs = [s for s in rnd.sample(sorted(requested), rnd.randint(1, len(requested)))
                        if requested[s] < 64]
                if seqs and m.grow_many(np.array(seqs), np.array([requested[s] + 1 for s in seqs])) is not None:
                    for s in seqs:
                        requested[s] += 1
            elif requested:
                seqs = np.array(sorted(requested))
                f0 = np.array([requested[s] for s in seqs.tolist()])
                k = min(rnd.randint(1, 12), int((64 - f0).min()))
                if k >= 1:
                    taken = m.stretch(seqs, seqs.copy(), f0, k, None)[0]
                    for s in seqs.tolist():
                        requested[s] += taken
        m.check()


@pytest.mark.parametrize("kind", ["vllm", "jenga", "static", "uniform"])
def test_recorded_sums_refuse_a_broken_split(kind: str) -> None:
    """A step records the sums its split is linear in (mapping back to the split exactly);
    a lost block or a negative part is refused there, as the full split would be."""
    m = _make(kind, 60_000)
    m.bind_finals(np.full(64, 64))
    assert m.allocate(0, 9) is not None and m.allocate(1, 5) is not None
    assert m.extend(0, 1)
    seqs, computed = np.array([0, 1]), np.array([9, 0])
    sums, token, free, elsewhere = m.sums(computed, int(computed.sum()))
    split = m.split(seqs, computed)
    assert np.array_equal(split, hybrid_split_by_position(m, seqs, computed))   # the sums' map, against every block
    assert np.array_equal((np.array(sums, dtype=np.float64) @ m.split_basis()).reshape(split.shape), split)
    assert (token, free) == (split[:, CATEGORIES.index("token_states")].sum(), split[:, CATEGORIES.index("free")].sum())
    assert elsewhere == split[:, [CATEGORIES.index(c) for c in ("internal_fragmentation", "padding",
                                                                "out_of_window")]].sum()
    m.state.held[0] += 1   # a block held that no sequence has
    with pytest.raises(AssertionError, match="sums to"):
        m.sums(computed, int(computed.sum()))
    m.state.held[0] -= 1
    m.state.tail[0] = -4
    with pytest.raises(AssertionError, match="negative"):
        m.sums(computed, int(computed.sum()))
