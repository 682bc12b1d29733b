"""Paged allocation with shared blocks: reference counts, copy-on-write, prefix caching.

PagedAttention's second promise. A physical block may sit in several block
tables at once; ``ref_cnt[b]`` is the number of tables holding it::

    block_size 4: allocate(a, 6); fork(a, b, 6); fork(a, c, 4)
    block     0        1
    holds     a b c    a b          ref_cnt [3, 2]
    a.block_table = [0, 1]   b.block_table = [0, 1]   c.block_table = [0]

    extend(b, 1): b writes position 6, inside block 1, which a shares: copy first
    block     0        1      2
    holds     a b c    a      b     ref_cnt [3, 1, 1]   copies [(1, 2)]

A shared block is never written: ``extend`` copies it to a fresh block first
(copy-on-write) when the new positions land in it, and records ``(src, dst)``
for the GPU side (``log_copies = True``; :meth:`take_copies` drains the log).
The last sharer to write keeps the original, its ref count having dropped to 1
(and if that block is cached, it leaves the cache: its content is changing).
``fork(parent, child, num_slots)`` shares the blocks covering the parent's first
``num_slots`` positions (parallel sampling forks the prompt, beam search a
whole beam).

Prefix caching (vLLM's automatic prefix caching). A full block may carry a
*key*, the identity of its content (the engine derives it from the hash chain of
the prompt, :mod:`fragsim.prefix`); ``cache_blocks`` registers computed blocks,
``allocate(..., cached=keys)`` starts a new table with the cached blocks of
those keys (ref + 1) instead of fresh ones. A block whose ref count drops to 0
goes to the tail of the free queue *with its key*: it is free (it counts in
``num_free``) but still a cache hit until it is taken from the head of the
queue for someone else, which evicts the key. One FIFO queue for free and cached
blocks is vLLM v1's ``FreeKVCacheBlockQueue``: eviction is least recently freed
first, and a hit pulls the block out of the middle of the queue (an OrderedDict,
so that is O(1)). ``free`` appends a table's blocks tail first, as vLLM does,
so that a prompt's shared head outlives its private tail.

Two counts the metrics need are kept as the tables change:

    num_shared_slots()   = block_size × Σ_b max(0, ref_cnt[b] − 1)
                           slots that Σ num_owned counts more than once
    num_free()           = block_size × (blocks with ref_cnt 0, cached or not)

so physical slots in use = Σ_seq num_owned(seq) − num_shared_slots().
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from fragsim.allocators.base import AllocatorCore, BlockTable, new_block_table, whole_blocks


class SharedPagedAllocator(AllocatorCore):
    """Reference-counted blocks with fork, copy-on-write and a prefix cache."""

    def __init__(
        self,
        capacity: int,
        *,
        block_size: int = 16,
        max_seq_len: int = 2048,
        reserve: str = "demand",
        name: str = "paged-shared",
    ) -> None:
        self.num_blocks = whole_blocks(capacity, block_size)
        self.block_size = block_size
        # "paged": the engine, the metrics and the GPU backend read it as any block table.
        self._init_contract(name=name, placement="paged", capacity=self.num_blocks * block_size,
                            max_seq_len=max_seq_len, reserve=reserve, reserves=("demand",),
                            grows_on_demand=True)
        self.log_copies = False
        self.num_evictions = 0
        self._ref = [0] * self.num_blocks
        # NOTE: only these methods may touch _free: head = next block handed out.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))
        self._tables: dict[int, BlockTable] = {}
        self._requested: dict[int, int] = {}
        self._cache: dict[Hashable, int] = {}
        self._key_of: dict[int, Hashable] = {}
        self._num_dup = 0
        self._num_evictable = 0
        self._copies: list[tuple[int, int]] = []
        #: called with the keys of cached blocks as they are evicted (an offload tier's lazy
        #: stores); None: nobody listens
        self.on_evict: Callable[[list[Hashable]], None] | None = None
        #: KV events, as vLLM publishes them: (stored, keys) when blocks join the prefix
        #: cache (True) or leave it (False); None: no subscriber
        self.kv_events: Callable[[bool, list[Hashable]], None] | None = None

    # -- the free queue ------------------------------------------------------------

    def _take(self, count: int) -> list[int]:
        """``count`` blocks from the head of the free queue, evicting their keys."""
        free, key_of, ref = self._free, self._key_of, self._ref
        out = []
        listening = self.on_evict is not None or self.kv_events is not None
        evicted: list[Hashable] | None = [] if listening else None
        for _ in range(count):
            block, _ = free.popitem(last=False)
            key = key_of.pop(block, None)
            if key is not None:
                del self._cache[key]
                self._num_evictable -= 1
                self.num_evictions += 1
                if evicted is not None:
                    evicted.append(key)
            ref[block] = 1
            out.append(block)
        if evicted:
            if self.on_evict is not None:
                self.on_evict(evicted)
            if self.kv_events is not None:
                self.kv_events(False, evicted)
        return out

    def _acquire(self, block: int) -> None:
        """One more reference to ``block`` (a cache hit or a fork)."""
        ref = self._ref[block]
        if ref == 0:
            del self._free[block]
            if block in self._key_of:
                self._num_evictable -= 1
        else:
            self._num_dup += 1
        self._ref[block] = ref + 1

    def _release(self, block: int) -> None:
        ref = self._ref[block] - 1
        self._ref[block] = ref
        if ref:
            self._num_dup -= 1
        else:
            self._free[block] = None
            if block in self._key_of:
                self._num_evictable += 1

    # -- the contract ----------------------------------------------------------------

    def rounded(self, num_slots: int) -> int:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        return -(-num_slots // self.block_size) * self.block_size

    def can_allocate(self, num_slots: int) -> bool:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        return -(-num_slots // self.block_size) <= len(self._free)

    def allocate(self, seq_id: int, num_slots: int,
                 cached: Sequence[Hashable] = ()) -> BlockTable | None:
        """A new table for ``num_slots`` slots whose first ``len(cached)`` blocks are the
        cached blocks of those keys (all must be cached: see :meth:`cache_hits`)."""
        if seq_id in self._requested:
            raise ValueError(f"sequence {seq_id} is already allocated")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        blocks = -(-num_slots // self.block_size)
        hits = [self._cache[key] for key in cached]
        if len(hits) > blocks:
            raise ValueError(f"{len(hits)} cached blocks for a sequence of {blocks} blocks")
        from_free = sum(1 for b in hits if self._ref[b] == 0)
        if blocks - len(hits) + from_free > len(self._free):
            return None
        for block in hits:
            self._acquire(block)
        ids = tuple(hits) + tuple(self._take(blocks - len(hits)))
        self._requested[seq_id] = num_slots
        table = self._tables[seq_id] = new_block_table(self.block_size, ids)
        return table

    def extend(self, seq_id: int, num_slots: int) -> bool:
        requested = self._requested.get(seq_id)
        if requested is None:
            raise ValueError(f"extend of unknown sequence {seq_id}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        B = self.block_size
        total = requested + num_slots
        table = self._tables[seq_id]
        ids = table.block_ids
        missing = -(-total // B) - len(ids)
        # The first new position lands in the last block when it is partly requested.
        partial = requested % B != 0
        cow = partial and self._ref[ids[-1]] > 1
        if missing + cow > len(self._free):
            return False
        if partial and not cow and ids[-1] in self._key_of:
            # A cached block this sequence holds only in part (a fork inside it) is about
            # to change: it no longer has the content its key names.
            del self._cache[self._key_of.pop(ids[-1])]
        if cow:
            src = ids[-1]
            (dst,) = self._take(1)
            self._release(src)
            ids = ids[:-1] + (dst,)
            if self.log_copies:
                self._copies.append((src, dst))
        if missing > 0:
            ids = ids + tuple(self._take(missing))
        if ids is not table.block_ids:
            self._tables[seq_id] = new_block_table(B, ids)
        self._requested[seq_id] = total
        return True

    def free(self, seq_id: int) -> None:
        table = self._tables.pop(seq_id, None)
        if table is None:
            raise ValueError(f"free of unknown sequence {seq_id}")
        del self._requested[seq_id]
        for block in reversed(table.block_ids):
            self._release(block)

    # -- sharing ---------------------------------------------------------------------

    def fork(self, parent_id: int, child_id: int, num_slots: int | None = None) -> BlockTable:
        """``child`` shares the blocks holding the parent's first ``num_slots`` positions
        (default: all it asked for); it never fails, since nothing new is taken."""
        requested = self._requested.get(parent_id)
        if requested is None:
            raise ValueError(f"fork of unknown sequence {parent_id}")
        if child_id in self._requested:
            raise ValueError(f"sequence {child_id} is already allocated")
        num_slots = requested if num_slots is None else num_slots
        if not 1 <= num_slots <= requested:
            raise ValueError(f"fork of {num_slots} slots from a sequence of {requested}")
        ids = self._tables[parent_id].block_ids[: -(-num_slots // self.block_size)]
        for block in ids:
            self._acquire(block)
        self._requested[child_id] = num_slots
        table = self._tables[child_id] = new_block_table(self.block_size, ids)
        return table

    def take_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write ``(src, dst)`` block pairs since the last call, in order."""
        out, self._copies = self._copies, []
        return out

    def num_shared_slots(self) -> int:
        """Slots counted more than once in Σ num_owned: ``B × Σ max(0, ref_cnt − 1)``."""
        return self._num_dup * self.block_size

    def ref_cnt(self, block_id: int) -> int:
        return self._ref[block_id]

    # -- prefix cache ----------------------------------------------------------------

    def cache_hits(self, keys: Sequence[Hashable]) -> tuple[int, int]:
        """(leading keys that are cached, how many of those blocks are free now)."""
        cache, ref = self._cache, self._ref
        hits = from_free = 0
        for key in keys:
            block = cache.get(key)
            if block is None:
                break
            hits += 1
            from_free += ref[block] == 0
        return hits, from_free

    def cache_blocks(self, seq_id: int, keys: Sequence[Hashable]) -> None:
        """Register the sequence's first ``len(keys)`` blocks (full, computed) under ``keys``.

        A key already cached for another block stays with that block (vLLM keeps the
        first copy); a block that already has a key keeps it.
        """
        ids = self.placement(seq_id).block_ids
        if len(keys) > len(ids):
            raise ValueError(f"{len(keys)} keys for a table of {len(ids)} blocks")
        cache, key_of = self._cache, self._key_of
        stored: list[Hashable] | None = [] if self.kv_events is not None else None
        for block, key in zip(ids, keys, strict=False):
            if block in key_of or key in cache:
                continue
            cache[key] = block
            key_of[block] = key
            if stored is not None:
                stored.append(key)
        if stored and self.kv_events is not None:
            self.kv_events(True, stored)

    def num_cached_blocks(self) -> int:
        return len(self._cache)

    def num_evictable_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (counted in ``num_free``)."""
        return self._num_evictable

    # -- queries ---------------------------------------------------------------------

    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_free(self) -> int:
        return len(self._free) * self.block_size

    def largest_allocatable(self) -> int:
        return len(self._free) * self.block_size

    def block_table(self, seq_id: int) -> list[int]:
        return list(self.placement(seq_id).block_ids)

    def free_block_ids(self) -> list[int]:
        """Free blocks (cached ones included) in the order they will be handed out."""
        return list(self._free)

    def placement(self, seq_id: int) -> BlockTable:
        table = self._tables.get(seq_id)
        if table is None:
            raise ValueError(f"unknown sequence {seq_id}")
        return table

    def num_owned(self, seq_id: int) -> int:
        return len(self.placement(seq_id).block_ids) * self.block_size

    def num_requested(self, seq_id: int) -> int:
        self.placement(seq_id)
        return self._requested[seq_id]

    def room(self, seq_id: int) -> int:
        """Slots the sequence can fill before it must extend again: what it owns, or
        only what it asked for while its last block is shared (the next position
        copies the block first)."""
        ids = self.placement(seq_id).block_ids
        if ids and self._ref[ids[-1]] > 1:
            return self._requested[seq_id]
        return len(ids) * self.block_size

    def seq_ids(self) -> list[int]:
        return list(self._requested)

    def check(self) -> None:
        B = self.block_size
        ref = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            ids = table.block_ids
            assert table.block_size == B, f"seq {seq_id}: table of block size {table.block_size}"
            assert len(set(ids)) == len(ids), f"seq {seq_id} holds a block twice: {ids}"
            requested = self._requested.get(seq_id)
            assert requested is not None, f"seq {seq_id} has a table but no requested count"
            assert len(ids) == -(-requested // B), (
                f"seq {seq_id}: {len(ids)} blocks for {requested} slots")
            for block in ids:
                ref[block] += 1
        assert self._requested.keys() == self._tables.keys(), "requested and tables disagree"
        assert ref == self._ref, "ref counts disagree with the block tables"
        free = list(self._free)
        assert sorted(free) == [b for b in range(self.num_blocks) if ref[b] == 0], (
            "free queue is not exactly the blocks with ref_cnt 0")
        assert self._num_dup == sum(max(0, r - 1) for r in ref), "shared count drifted"
        for key, block in self._cache.items():
            assert self._key_of.get(block) == key, f"cache key {key!r} -> block {block} not mirrored"
        assert len(self._key_of) == len(self._cache), "a block carries a key the cache lost"
        assert self._num_evictable == sum(1 for b in free if b in self._key_of), "evictable drifted"
        owned = sum(len(t.block_ids) for t in self._tables.values()) * B
        assert self.num_free() + owned - self.num_shared_slots() == self.capacity, (
            "free + owned − shared != capacity")
