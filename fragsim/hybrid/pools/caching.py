"""vLLM's block pool under prefix caching (``BlockPool`` with ``enable_caching``).

Blocks carry a reference count and, once the step that computed them ends, the
content key of the prompt block they hold (:mod:`fragsim.prefix`); a block may be
held by several sequences. The free queue is vLLM's ``FreeKVCacheBlockQueue`` under
caching (``BlockPool.free_blocks``): a freed block without a key goes to the *front*
(reused first), one with a key to the *back*, so it stays findable until every block
freed before it is handed out; the blocks of one free are given last block first, so
a request's tail is evicted before its head. Taking a block evicts its key; a hit on
a free block takes it out of the queue. A sequence's window frees (vLLM's
``remove_skipped_blocks``) are frees of the same kind, made before vLLM checks that
the new blocks can be had (``frees_on_failure``).

Where the bytes go
------------------
Every holder of a shared block has stored all of it (a hit is of full, computed
blocks; a block gets its key at the end of the step that computed it), so the
manager's per-sequence sums count a block with ``ref`` holders ``ref − 1`` times too
often. With ``dup`` = Σ max(0, ref − 1) over a group's blocks, the group's padding
is ``dup × padding_per_block`` too high and its token states plus out-of-window
``dup × B`` positions too high. A position of a shared block is out of the window
only if it is out of every holder's window, so for a sliding group, with ``o_h`` the
positions of the block before holder ``h``'s window start, the out-of-window excess
of the block is ``Σ_h o_h − min_h o_h`` (:meth:`CachingBlockPool.correct_split`).
Freed blocks that keep a key are free memory (``num_evictable_blocks`` counts them).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from fragsim.hybrid.groups import OUT_OF_WINDOW, PADDING, TOKEN, Group
from fragsim.hybrid.pools.base import IdPool, rows_of_tables, tables_of
from fragsim.hybrid.state import SeqState
from fragsim.kinds import cdiv


class CachingBlockPool(IdPool):
    """Reference-counted blocks with content keys over vLLM's caching free queue."""

    shares_blocks = True
    frees_on_failure = True

    def __init__(self, groups: tuple[Group, ...], capacity: int, *, num_blocks: int, block_bytes: int) -> None:
        super().__init__(groups, capacity)
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._ref = np.zeros(num_blocks, dtype=np.int64)
        self._group_of = np.full(num_blocks, -1, dtype=np.int64)
        self._key_of: dict[int, int] = {}                                # block -> its key
        self._cache: list[dict[int, list[int]]] = [{} for _ in groups]   # key -> blocks, first found
        self._tables: dict[int, list[list[int]]] = {}
        #: per group, Σ max(0, ref − 1) over its blocks
        self.dup = [0] * len(groups)
        self.num_evictions = 0

    # ----------------------------------------------------------------- the queue

    def num_free_blocks(self) -> int:
        return len(self._free)

    def free_order(self) -> list[int]:
        """The free blocks in the order they are handed out (first: next)."""
        return list(self._free)

    def num_evictable_blocks(self) -> int:
        """Free blocks that still hold a key (a hit can take them back)."""
        return sum(1 for b in self._key_of if self._ref[b] == 0)

    def used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def _take(self, group: int, n: int) -> list[int]:
        """``n`` blocks from the front of the queue for ``group``, their keys evicted."""
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            key = self._key_of.pop(block, None)
            if key is not None:
                found = self._cache[int(self._group_of[block])][key]
                found.remove(block)
                if not found:
                    del self._cache[int(self._group_of[block])][key]
                self.num_evictions += 1
            out.append(block)
        self._ref[out] = 1
        self._group_of[out] = group
        return out

    def _give_back(self, group: int, ordered: list[int]) -> None:
        """``BlockPool.free_blocks``: the first of ``ordered`` is evicted first."""
        first: list[int] = []
        last: list[int] = []
        for b in ordered:
            ref = int(self._ref[b])
            if ref >= 2:
                self.dup[group] -= 1
            self._ref[b] = ref - 1
            if ref == 1:
                (last if b in self._key_of else first).append(b)
        free = self._free
        for b in reversed(first):
            free[b] = None
            free.move_to_end(b, last=False)
        for b in last:
            free[b] = None

    def _touch(self, group: int, blocks: tuple[int, ...]) -> None:
        for b in blocks:
            ref = int(self._ref[b])
            if ref == 0:
                del self._free[b]
            else:
                self.dup[group] += 1
            self._ref[b] = ref + 1

    # ------------------------------------------------------------------ moves

    def place(self, seq: int, frees: list[int], takes: list[int]) -> bool:
        tables = self._tables.setdefault(seq, [[] for _ in self.groups])
        gain = sum(int((self._ref[t[:n]] == 1).sum()) for t, n in zip(tables, frees, strict=True) if n)
        ok = sum(takes) <= len(self._free) + gain
        for i, (table, n) in enumerate(zip(tables, frees, strict=True)):
            if n:
                gone = table[:n]
                del table[:n]
                self._give_back(i, gone[::-1])
        if not ok:
            return False
        for i, (table, n) in enumerate(zip(tables, takes, strict=True)):
            if n:
                table.extend(self._take(i, n))
        return True

    def place_hit(self, seq: int, hit: tuple[tuple[int, ...], ...], takes: list[int]) -> bool:
        """A new sequence holding the hit's blocks per group, then ``takes`` new ones
        (False: they cannot all be had; nothing changed)."""
        evictable = sum(int((self._ref[list(blocks)] == 0).sum()) for blocks in hit if blocks)
        if sum(takes) + evictable > len(self._free):
            return False
        tables = self._tables[seq] = [list(blocks) for blocks in hit]
        for i, blocks in enumerate(hit):
            self._touch(i, blocks)
        for i, (table, n) in enumerate(zip(tables, takes, strict=True)):
            table.extend(self._take(i, n))
        return True

    def release(self, seq: int, held: list[int]) -> None:
        for i, table in enumerate(self._tables.pop(seq, [])):
            self._give_back(i, table[::-1])

    def fits(self, takes: list[int]) -> bool:
        return sum(takes) <= len(self._free)

    def fits_batch(self, takes: list[list[int]], frees: list[list[int]]) -> bool:
        # frees of shared blocks free nothing: they are not counted
        return sum(map(sum, takes)) <= len(self._free)

    def fits_empty(self, takes: list[int]) -> bool:
        return sum(takes) <= self.num_blocks - 1

    # ------------------------------------------------------------------- keys

    def cached(self, group: int, key: int) -> int | None:
        """The first block of ``group`` found under ``key`` (None: not cached)."""
        found = self._cache[group].get(key)
        return found[0] if found else None

    def cached_keys(self, group: int) -> list[int]:
        """The keys ``group`` holds blocks of."""
        return list(self._cache[group])

    def key_of(self, block: int) -> int | None:
        """The block's content key (None: none)."""
        return self._key_of.get(block)

    def set_key(self, group: int, block: int, key: int) -> None:
        """Give ``block`` its content key (a block keeps its first)."""
        if block in self._key_of:
            return
        self._key_of[block] = key
        self._cache[group].setdefault(key, []).append(block)

    # ------------------------------------------------------------------ sizes

    def free_bytes(self) -> list[int]:
        return [0] * len(self.groups) + [len(self._free) * self.block_bytes]

    def fixed_padding(self) -> int:
        return self.capacity - (self.num_blocks - 1) * self.block_bytes

    def block_ids(self, seq: int, group: int) -> list[int]:
        return tables_of(self._tables, seq, group)

    def ref_count(self, block: int) -> int:
        return int(self._ref[block])

    def unit_rows(self) -> np.ndarray:
        return rows_of_tables(self._tables, self.num_blocks)

    # ---------------------------------------------------------- shared blocks

    def _oow_excess(self, i: int, state: SeqState, seqs: np.ndarray, computed: np.ndarray) -> int:
        """Out-of-window positions group ``i`` counts more than once: per shared block,
        Σ over holders of its positions before their window, less the least of them."""
        group, b = self.groups[i], self.groups[i].block_tokens
        start = group.rule.skipped(computed)
        lo = state.lo[state.shape_of[i], seqs]
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

    def correct_split(self, out: np.ndarray, state: SeqState, seqs: np.ndarray, computed: np.ndarray) -> None:
        """The split of the per-sequence sums (``out``), with each shared block once."""
        for i, group in enumerate(self.groups):
            dup = self.dup[i]
            if not dup:
                continue
            out[i, PADDING] -= dup * group.padding_per_block
            excess = self._oow_excess(i, state, seqs, computed) if group.rule.frees else 0
            out[i, TOKEN] -= (dup * group.block_tokens - excess) * group.token_bytes
            out[i, OUT_OF_WINDOW] -= excess * group.token_bytes

    def held_only_bytes(self, state: SeqState, held: dict[int, int], seqs: np.ndarray,
                        computed: np.ndarray) -> int:
        """Bytes of token states that go with the sequences ``held`` (kept past their
        requests, with their stored lengths) among the live ``seqs``: per block one of
        them holds, the positions its holders read less those read by a holder not among
        them (a shared block's token states are the most any one holder reads)."""
        length = dict(zip(seqs.tolist(), computed.tolist(), strict=True))
        length.update(held)
        out = 0
        for i, group in enumerate(self.groups):
            lo_of = state.lo[state.shape_of[i]]
            mine: dict[int, int] = {}                          # block -> the most a held one reads
            holders: dict[int, int] = {}
            for seq in held:
                lo = int(lo_of[seq])
                for t, block in enumerate(self._tables[seq][i]):
                    mine[block] = max(mine.get(block, 0), _reads(group, lo, lo + t, length[seq]))
                    holders[block] = holders.get(block, 0) + 1
            shared = {block for block, n in holders.items() if self._ref[block] > n}
            others: dict[int, int] = {}                        # block -> the most another reads
            for seq in (s for s in length if s not in held and shared):
                lo = int(lo_of[seq])
                for t, block in enumerate(self._tables[seq][i]):
                    if block in shared:
                        others[block] = max(others.get(block, 0), _reads(group, lo, lo + t, length[seq]))
            out += sum(max(0, n - others.get(block, 0)) for block, n in mine.items()) * group.token_bytes
        return out

    def correct_steps(self, splits: np.ndarray) -> None:
        """:meth:`correct_split` of a stretch's steps (``[steps, groups + 1, categories]``),
        which :meth:`shared_limit` stops before any window reaches a shared block."""
        for i, group in enumerate(self.groups):
            if self.dup[i]:
                splits[:, i, PADDING] -= self.dup[i] * group.padding_per_block
                splits[:, i, TOKEN] -= self.dup[i] * group.block_tokens * group.token_bytes

    def shared_limit(self, state: SeqState, seqs: np.ndarray, filled0: np.ndarray, k: int) -> int:
        """Steps before the first one in which a window reaches a shared block (its
        out-of-window excess, or its sharing, would change)."""
        limit = k
        for i, group in enumerate(self.groups):
            if not self.dup[i] or not group.rule.frees:
                continue
            s = state.shape_of[i]
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
                at = group.holds.next_skip(int(state.lo[s, seq]) + t - 1, group.block_tokens)
                limit = min(limit, max(0, at - f0))
                if limit == 0:
                    return 0
        return limit

    def check(self, held: list[int]) -> None:
        free = list(self._free)
        holders: dict[int, int] = {}
        for tables in self._tables.values():
            for i, table in enumerate(tables):
                for b in table:
                    holders[b] = holders.get(b, 0) + 1
                    assert self._group_of[b] == i, f"block {b} in two groups"
        assert not set(free) & set(holders), "a held block is in the free queue"
        assert set(free) | set(holders) == set(range(1, self.num_blocks)), "blocks lost"
        for b in range(1, self.num_blocks):
            assert self._ref[b] == holders.get(b, 0), f"block {b}: ref_cnt {self._ref[b]} != {holders.get(b, 0)}"
        for i in range(len(self.groups)):
            dup = sum(max(0, n - 1) for b, n in holders.items() if self._group_of[b] == i)
            assert self.dup[i] == dup, (self.groups[i].label, self.dup[i], dup)
        for i, cache in enumerate(self._cache):
            for key, blocks in cache.items():
                assert blocks and all(self._key_of.get(b) == key and self._group_of[b] == i for b in blocks)
        assert sum(len(v) for c in self._cache for v in c.values()) == len(self._key_of)


def _reads(group: Group, lo: int, block: int, computed: int) -> int:
    """Positions of block ``block`` a sequence holding blocks from ``lo`` on, with
    ``computed`` tokens stored, reads again (its token states there)."""
    b, rule = group.block_tokens, group.rule
    start = max(rule.skipped(computed), lo * b) if rule.frees else lo * b
    return max(0, min((block + 1) * b, computed) - max(block * b, start))
