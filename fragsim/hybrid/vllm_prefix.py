"""vLLM 0.33's hybrid KV cache manager with prefix caching.

:class:`VllmPrefixManager` is :class:`~fragsim.hybrid.vllm_hybrid.VllmHybridManager`
with vLLM's block pool under ``enable_caching``: blocks carry a reference count
and, once the step that computed them ends, the content key of the prompt block
they hold (:mod:`fragsim.prefix`); a block may be held by several sequences.

Each kind finds its own hit (vLLM's ``find_longest_cache_hit`` of the
single-type managers in ``single_type_kv_cache_manager.py``), ``B`` tokens a
block, looking at most ``max_len`` tokens (``context − 1``: one token is always
computed)::

    full, MLA   left to right: the longest run of cached blocks from block 0
    sliding W   right to left: the rightmost run of ceil((W − 1) / B) cached
                blocks ending at or before max_len; the blocks before it are the
                null block (nothing to hold: out of the window). With no such
                run, the run that starts at block 0, however short.
    chunked C   from the chunk that max_len falls in, left to right; the
                blocks of earlier chunks count as computed

    W = 4 tokens, B = 2 (2 blocks a hit), cached: [x . x x . ]
    full: 1 block (block 1 is missing)
    sliding: 4 blocks (blocks 2-3 end the run; blocks 0-1 are null)

The kinds' answers are then reconciled as ``HybridKVCacheCoordinator`` does:
groups of one spec look up together (a block is a hit only if every group of
the spec has it cached), full attention first; each kind may only shorten the
candidate length; repeat until no kind shortens it (one pass when the model
has two kinds, full and one other). Full-attention hits are then cut to the
agreed length. The hit of each kind on its own is kept as well (the per-kind
hit rates).

The free queue is vLLM's ``FreeKVCacheBlockQueue`` under caching
(``BlockPool.free_blocks``): a freed block without a key goes to the *front*
(reused first), one with a key to the *back*, so it stays findable until every
block freed before it is handed out; the blocks of one free are given last block
first, so a request's tail is evicted before its head. Taking a block evicts its
key; a hit on a free block takes it out of the queue. A sequence's window frees
(vLLM's ``remove_skipped_blocks``) are frees of the same kind. When an extension
cannot get its blocks, the blocks that fell out of the window are freed anyway
(vLLM frees them before it checks), the rest stays.

Where the bytes go
------------------
Every holder of a shared block has stored all of it (a hit is of full, computed
blocks; a block gets its key at the end of the step that computed it), so the
per-sequence sums of :mod:`~fragsim.hybrid.manager` count a block with ``ref``
holders ``ref − 1`` times too often. With ``dup`` = Σ max(0, ref − 1) over a
row's blocks, the row's padding is ``dup × padding_per_block`` too high and its
token states plus out-of-window ``dup × B`` positions too high. A position of a
shared block is out of the window only if it is out of every holder's window,
so for a sliding row, with ``o_h`` the positions of the block before holder
``h``'s window start, the out-of-window excess of the block is
``Σ_h o_h − min_h o_h``. Freed blocks that keep a key are free memory
(``num_evictable_blocks`` counts them). State layers are not modelled here (vLLM
0.33 switches Mamba to its ``align`` mode under prefix caching, which holds
extra checkpoint blocks and hits at checkpoints).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from fragsim.hybrid.manager import (
    CATEGORIES,
    FREE,
    INTERNAL,
    OUT_OF_WINDOW,
    PADDING,
    RESERVATION,
    TOKEN,
    HybridManager,
)
from fragsim.hybrid.state import Move
from fragsim.hybrid.vllm_hybrid import VllmHybridManager
from fragsim.kinds import cdiv
from fragsim.vllm_plan import VllmPlan

_FULL_KINDS = ("full", "mla")


@dataclass(frozen=True)
class Hit:
    """A prefix-cache hit: ``tokens`` reused, the blocks of each row for positions
    ``[lo, tokens // B)`` (lo: the row's first held block), and each kind's own hit."""

    tokens: int
    blocks: tuple[tuple[int, ...], ...]
    by_kind: dict[str, int]
    #: the longest hit any kind found past the agreed one (0: none): the request's
    #: shared-prefix junction, where its sliding-window blocks will be kept
    junction: int = 0


class VllmPrefixManager(VllmHybridManager):
    """vLLM's hybrid groups over a block pool with prefix caching (always keeps ids)."""

    prefix_caching = True
    split_is_linear = False   # shared blocks counted once: split() corrects the sums

    def __init__(self, plan: VllmPlan, *, max_seq_len: int, name: str = "vllm-hybrid") -> None:
        super().__init__(plan, max_seq_len=max_seq_len, name=name, track_ids=True)
        if any(r.is_state for r in self.rows):
            raise ValueError("prefix caching with state (Mamba, linear attention) layers is not "
                             "modelled: vLLM 0.33 runs them in its 'align' mode, with checkpoint blocks")
        if len({r.block_tokens for r in self.rows}) != 1:
            raise ValueError("prefix caching needs one block size for every group")
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, self.num_blocks))
        self._ref = np.zeros(self.num_blocks, dtype=np.int64)
        self._row_of = np.full(self.num_blocks, -1, dtype=np.int64)
        self._key_of: dict[int, int] = {}                              # block -> its key
        self._cache: list[dict[int, list[int]]] = [{} for _ in self.rows]  # key -> blocks, first found
        self._cached_upto: dict[int, int] = {}                         # seq -> blocks registered
        self._bounds: dict[int, tuple[int, int]] = {}                  # seq -> (replay boundary, junction)
        self.dup = [0] * len(self.rows)
        self.num_evictions = 0
        # Spec groups (vLLM's attention_groups): rows of one shape look up together,
        # full attention first.
        specs: dict[int, list[int]] = {}
        for i, shape in enumerate(self.state.shape_of):
            specs.setdefault(shape, []).append(i)
        self._specs = sorted(specs.values(), key=lambda rows: self.rows[rows[0]].kind not in _FULL_KINDS)

    # ------------------------------------------------------------- the pool

    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_evictable_blocks(self) -> int:
        """Free blocks that still hold a key (a hit can take them back)."""
        return sum(1 for b in self._key_of if self._ref[b] == 0)

    def _pop(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            key = self._key_of.pop(block, None)
            if key is not None:
                found = self._cache[int(self._row_of[block])][key]
                found.remove(block)
                if not found:
                    del self._cache[int(self._row_of[block])][key]
                self.num_evictions += 1
            out.append(block)
        return out

    def _take_blocks(self, row: int, n: int) -> list[int]:
        ids = self._pop(n)
        self._ref[ids] = 1
        self._row_of[ids] = row
        return ids

    def _free_blocks(self, row: int, ordered: list[int]) -> None:
        """``BlockPool.free_blocks``: the first of ``ordered`` is evicted first."""
        first: list[int] = []
        last: list[int] = []
        for b in ordered:
            ref = int(self._ref[b])
            if ref >= 2:
                self.dup[row] -= 1
            self._ref[b] = ref - 1
            if ref == 1:
                (last if b in self._key_of else first).append(b)
        free = self._free
        for b in reversed(first):
            free[b] = None
            free.move_to_end(b, last=False)
        for b in last:
            free[b] = None

    def _touch(self, row: int, blocks: tuple[int, ...]) -> None:
        for b in blocks:
            ref = int(self._ref[b])
            if ref == 0:
                del self._free[b]
            else:
                self.dup[row] += 1
            self._ref[b] = ref + 1

    def _place(self, seq: int, frees: list[int], takes: list[int]) -> bool:
        tables = self._tables.setdefault(seq, [[] for _ in self.rows])
        gain = sum(int((self._ref[t[:n]] == 1).sum()) for t, n in zip(tables, frees, strict=True) if n)
        ok = sum(takes) <= len(self._free) + gain
        for i, (table, n) in enumerate(zip(tables, frees, strict=True)):
            if n:
                gone = table[:n]
                del table[:n]
                self._free_blocks(i, gone[::-1])
        if not ok:
            return False
        for i, (table, n) in enumerate(zip(tables, takes, strict=True)):
            if n:
                table.extend(self._take_blocks(i, n))
        return True

    def _place_moves(self, seqs: list[int], frees: list[list[int]], takes: list[list[int]]) -> None:
        HybridManager._place_moves(self, seqs, frees, takes)

    def _fits_moves(self, takes: list[list[int]], frees: list[list[int]]) -> bool:
        return HybridManager._fits_moves(self, takes, frees)

    def _release(self, seq: int, held: list[int]) -> None:
        for i, table in enumerate(self._tables.pop(seq, [])):
            self._free_blocks(i, table[::-1])
        self._cached_upto.pop(seq, None)
        self._bounds.pop(seq, None)

    def _can_take(self, takes: list[int]) -> bool:
        return sum(takes) <= len(self._free)

    # Frees of shared blocks free nothing: the base class's safe bounds (frees ignored).
    def _stretch_fits(self, takes: np.ndarray, frees: np.ndarray, per_seq: np.ndarray) -> int:
        return HybridManager._stretch_fits(self, takes, frees, per_seq)

    def _stretch_admits(self, takes: np.ndarray, frees: np.ndarray, head: list[int]) -> int:
        return HybridManager._stretch_admits(self, takes, frees, head)

    # ------------------------------------------------------- lookups and hits

    def _cached(self, rows: list[int], key: int) -> list[int] | None:
        out = []
        for r in rows:
            found = self._cache[r].get(key)
            if not found:
                return None
            out.append(found[0])
        return out

    def _find(self, rows: list[int], keys: list[int], max_len: int) -> tuple[int, int]:
        """One spec's hit within ``max_len`` tokens: (first block of the hit, end block)."""
        row = self.rows[rows[0]]
        b = row.block_tokens
        n = min(max_len // b, len(keys))
        if row.kind == "sliding":
            assert row.window is not None
            need = cdiv(row.window - 1, b)
            run = 0
            for i in range(n - 1, -1, -1):
                if self._cached(rows, keys[i]) is None:
                    run = 0
                    continue
                run += 1
                if run >= need:
                    return i, i + run
            return 0, run
        start = 0
        if row.kind == "chunked" and max_len > 0:
            assert row.chunk is not None
            start = max_len // row.chunk * row.chunk // b
        end = start
        while end < n and self._cached(rows, keys[end]) is not None:
            end += 1
        return start, end

    def lookup(self, keys: list[int], max_len: int) -> Hit:
        """The hit of a request whose prompt blocks have ``keys``, within ``max_len``
        tokens (vLLM's ``get_computed_blocks``; ``context − 1``: one token is always
        computed); nothing changes."""
        b = self.block_size
        by_kind: dict[str, int] = {}
        for rows in self._specs:
            kind = self.rows[rows[0]].kind
            by_kind[kind] = max(by_kind.get(kind, 0), self._find(rows, keys, max_len)[1] * b)
        hit = max_len
        longest = 0
        ends: dict[int, int] = {}
        simple = len(self._specs) == 2 and self.rows[self._specs[0][0]].kind in _FULL_KINDS
        while True:
            curr = hit
            for s, rows in enumerate(self._specs):
                if self.rows[rows[0]].kind in _FULL_KINDS and s in ends:
                    curr = min(curr, ends[s])   # full attention is downward-closed
                    continue
                ends[s] = curr = self._find(rows, keys, curr)[1] * b
                longest = max(longest, curr)
            if curr >= hit:
                break
            hit = curr
            if simple:
                break
        hit = curr
        blocks: list[tuple[int, ...]] = [()] * len(self.rows)
        for rows in self._specs:
            row = self.rows[rows[0]]
            lo = row.holds.skipped_blocks(hit, row.block_tokens)
            for r in rows:
                blocks[r] = tuple(self._cache[r][k][0] for k in keys[lo:hit // b])
        if self.on_op is not None:
            self.on_op(["l", list(keys), max_len, hit], True, -1)
        return Hit(hit, tuple(blocks), by_kind, longest if longest > hit else 0)

    def allocate(self, seq_id: int, num_slots: int, hit: Hit | None = None,
                 prompt_len: int | None = None) -> object:
        """Room for ``num_slots`` tokens of a new sequence whose first ``hit.tokens``
        are the hit's blocks (None: no room, nothing changed). ``prompt_len`` (default
        ``num_slots − 1``) fixes where its sliding-window blocks are kept."""
        if seq_id in self._live:
            raise ValueError(f"sequence {seq_id} is already allocated")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        h = hit.tokens if hit is not None else 0
        if h >= num_slots:
            raise ValueError(f"a hit of {h} tokens leaves nothing to compute of {num_slots}")
        b = self.block_size
        move = Move([sh.rule.skipped_blocks(h, b) for sh in self.state.shapes],
                    [cdiv(num_slots, b)] * len(self.state.shapes), [], [])
        new_hi = [cdiv(num_slots, b)] * len(self.rows)
        takes = [hi - h // b for hi in new_hi]
        hits = hit.blocks if hit is not None else ((),) * len(self.rows)
        evictable = sum(int((self._ref[list(blocks)] == 0).sum()) for blocks in hits if blocks)
        if sum(takes) + evictable > len(self._free):
            if self.on_op is not None:
                self.on_op(["a", seq_id, num_slots, self._final(seq_id), prompt_len], False, seq_id)
            return None
        tables = self._tables[seq_id] = [list(blocks) for blocks in hits]
        for i, blocks in enumerate(hits):
            self._touch(i, blocks)
        for i, (table, n) in enumerate(zip(tables, takes, strict=True)):
            table.extend(self._take_blocks(i, n))
        self._cached_upto[seq_id] = h // b
        prompt = num_slots - 1 if prompt_len is None else prompt_len
        self._bounds[seq_id] = (prompt - 1, hit.junction if hit is not None else 0)
        self.state.start(seq_id, self._final(seq_id), num_slots, move)
        if self.on_op is not None:
            self.on_op(["a", seq_id, num_slots, self._final(seq_id), prompt_len], True, seq_id)
        return self.placement(seq_id)

    def _extend_failed(self, seq_id: int, move: Move) -> None:
        """The window's blocks went back before the check failed, as in vLLM."""
        st = self.state
        st.commit(seq_id, int(st.q[seq_id]), Move(move.lo, st.hi[:, seq_id].tolist(), [], []))

    def _kept(self, seq_id: int, row: int, start: int, end: int) -> list[int]:
        """Block positions in ``[start, end)`` that row ``row`` keys. A sliding window
        keys only the ceil((W − 1) / B) blocks before the request's replay boundary
        (prompt − 1) and before its shared-prefix junction, the runs a later hit can
        end on (vLLM's ``reachable_block_mask`` at its default
        ``prefix_cache_retention_interval = 0``); other kinds key every block."""
        r = self.rows[row]
        if r.kind != "sliding":
            return list(range(start, end))
        assert r.window is not None
        need = cdiv(r.window - 1, r.block_tokens)
        kept: set[int] = set()
        for boundary in self._bounds[seq_id]:
            if boundary > 0:
                top = boundary // r.block_tokens
                kept.update(range(max(start, top - need), min(end, top)))
        return sorted(kept)

    def cache_blocks(self, seq_id: int, keys: list[int]) -> None:
        """Give the sequence's blocks of the positions of ``keys`` their keys (the end
        of the step that computed them); blocks already keyed, and positions the
        sequence no longer holds, are left alone."""
        self._cache_blocks(seq_id, keys)
        if self.on_op is not None:
            self.on_op(["c", seq_id, len(keys) * self.block_size], True, seq_id)

    def _cache_blocks(self, seq_id: int, keys: list[int]) -> None:
        start = self._cached_upto.get(seq_id, 0)
        if start >= len(keys):
            return
        tables = self._tables[seq_id]
        for i, table in enumerate(tables):
            lo = self.first_block(seq_id, i)
            cache = self._cache[i]
            for k in self._kept(seq_id, i, max(start, lo), len(keys)):
                block = table[k - lo]
                if block in self._key_of:
                    continue
                key = keys[k]
                self._key_of[block] = key
                cache.setdefault(key, []).append(block)
        self._cached_upto[seq_id] = len(keys)

    # --------------------------------------------------------------- the split

    def _oow_excess(self, i: int, seqs: np.ndarray, computed: np.ndarray) -> int:
        """Out-of-window positions row ``i`` counts more than once: per shared block,
        Σ over holders of its positions before their window, less the least of them."""
        row, b = self.rows[i], self.rows[i].block_tokens
        start = row.rule.skipped(computed)
        lo = self.state.lo[self.state.shape_of[i], seqs]
        has = np.flatnonzero(start > lo * b)
        if not len(has):
            return 0
        tables, ref = self._tables, self._ref
        found: dict[int, list[int]] = {}                     # block -> [Σ o, min o, holders]
        for col in has.tolist():
            seq, st, l0 = int(seqs[col]), int(start[col]), int(lo[col])
            table = tables[seq][i]
            for t in range(min(cdiv(st, b) - l0, len(table))):
                block = table[t]
                if ref[block] < 2:
                    continue
                o = min(b, st - (l0 + t) * b)
                rec = found.get(block)
                if rec is None:
                    found[block] = [o, o, 1]
                else:
                    rec[0] += o
                    rec[1] = min(rec[1], o)
                    rec[2] += 1
        return sum(s - (m if n == ref[block] else 0) for block, (s, m, n) in found.items())

    def split(self, seqs: np.ndarray, computed: np.ndarray) -> np.ndarray:
        out = super().split(seqs, computed)
        for i, row in enumerate(self.rows):
            dup = self.dup[i]
            if not dup:
                continue
            out[i, PADDING] -= dup * row.padding_per_block
            excess = self._oow_excess(i, seqs, computed) if row.rule.frees else 0
            out[i, TOKEN] -= (dup * row.block_tokens - excess) * row.token_bytes
            out[i, OUT_OF_WINDOW] -= excess * row.token_bytes
        return out

    def split_slow(self, seqs: np.ndarray, computed: np.ndarray) -> np.ndarray:
        """The split from the block tables, position by position: a position of a block
        is stored if any holder stored it, out of the window if it is out of every
        storing holder's window, reserved if below some holder's final length."""
        assert sorted(int(s) for s in seqs) == sorted(self._live), "live sequences differ"
        out = np.zeros((len(self.rows) + 1, len(CATEGORIES)), dtype=np.int64)
        for i, row in enumerate(self.rows):
            b, tb = row.block_tokens, row.token_bytes
            holders: dict[int, list[tuple[int, int, int, int]]] = {}   # block -> (pos, f, start, final)
            for seq, f in zip(seqs.tolist(), computed.tolist(), strict=True):
                lo = self.first_block(seq, i)
                hi = lo + self.blocks_held(seq)[i]
                table = self._tables[seq][i]
                assert len(table) == hi - lo, (seq, row.label)
                start = row.rule.skipped(f)
                final = self._final(seq)
                assert f <= hi * b and 0 <= f <= final, (seq, f, hi, final)
                for t, block in enumerate(table):
                    holders.setdefault(block, []).append(((lo + t) * b, f, start, final))
            for block, hs in holders.items():
                assert self._ref[block] == len(hs), (row.label, block, int(self._ref[block]), len(hs))
                assert len({p for p, _, _, _ in hs}) == 1, f"block {block} held at two positions"
                p0 = hs[0][0]
                pos = np.arange(p0, p0 + b)
                stored = np.zeros(b, dtype=bool)
                read = np.zeros(b, dtype=bool)
                wanted = np.zeros(b, dtype=bool)
                for _, f, start, final in hs:
                    mine = pos < f
                    stored |= mine
                    read |= mine & (pos >= start)
                    wanted |= pos < final
                out[i, TOKEN] += int(read.sum()) * tb
                out[i, OUT_OF_WINDOW] += int((stored & ~read).sum()) * tb
                out[i, RESERVATION] += int((~stored & wanted).sum()) * tb
                out[i, INTERNAL] += int((~stored & ~wanted).sum()) * tb
                out[i, PADDING] += row.padding_per_block
        out[:, FREE] = self._free_bytes()
        out[-1, PADDING] = self._fixed_padding()
        return out

    def stretch(self, seqs: np.ndarray, reqs: np.ndarray, filled0: np.ndarray, k: int,
                head_tokens: int | None, first_step_first: bool = False, owned: np.ndarray | None = None
                ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The base stretch, cut before the first step where a window reaches a shared
        block (its out-of-window excess, or its sharing, would change); the shared
        blocks then stay put, and the split's excess is a constant."""
        k = min(k, self._shared_limit(seqs, filled0, k))
        if k <= 0:
            R = len(self.rows)
            return (0, np.zeros((0, R + 1, len(CATEGORIES)), dtype=np.int64), np.zeros(0, dtype=np.int64),
                    np.zeros(0, dtype=np.int64), np.full(len(seqs), -1))
        out = super().stretch(seqs, reqs, filled0, k, head_tokens, first_step_first, owned)
        split = out[1]
        for i, row in enumerate(self.rows):
            if self.dup[i]:
                split[:, i, PADDING] -= self.dup[i] * row.padding_per_block
                split[:, i, TOKEN] -= self.dup[i] * row.block_tokens * row.token_bytes
        return out

    def _shared_limit(self, seqs: np.ndarray, filled0: np.ndarray, k: int) -> int:
        limit = k
        for i, row in enumerate(self.rows):
            if not self.dup[i] or not row.rule.frees:
                continue
            for seq, f0 in zip(seqs.tolist(), filled0.tolist(), strict=True):
                table = self._tables[seq][i]
                if not table:
                    continue
                shared = np.flatnonzero(self._ref[table] > 1)
                if not len(shared):
                    continue
                t = int(shared[0])
                if t == 0:
                    return 0
                at = row.holds.next_skip(self.first_block(seq, i) + t - 1, row.block_tokens)
                limit = min(limit, max(0, at - f0))
                if limit == 0:
                    return 0
        return limit

    def _check_pool(self) -> None:
        free = list(self._free)
        held: dict[int, int] = {}
        for tables in self._tables.values():
            for i, table in enumerate(tables):
                for b in table:
                    held[b] = held.get(b, 0) + 1
                    assert self._row_of[b] == i, f"block {b} in two rows"
        assert not set(free) & set(held), "a held block is in the free queue"
        assert set(free) | set(held) == set(range(1, self.num_blocks)), "blocks lost"
        for b in range(1, self.num_blocks):
            assert self._ref[b] == held.get(b, 0), f"block {b}: ref_cnt {self._ref[b]} != {held.get(b, 0)}"
        for i in range(len(self.rows)):
            dup = sum(max(0, n - 1) for b, n in held.items() if self._row_of[b] == i)
            assert self.dup[i] == dup, (self.rows[i].label, self.dup[i], dup)
        for i, cache in enumerate(self._cache):
            for key, blocks in cache.items():
                assert blocks and all(self._key_of.get(b) == key and self._row_of[b] == i for b in blocks)
        assert sum(len(v) for c in self._cache for v in c.values()) == len(self._key_of)
        assert set(self._tables) <= set(self._live)
