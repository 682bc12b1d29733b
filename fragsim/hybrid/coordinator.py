"""Prefix hits across layer kinds: vLLM's ``HybridKVCacheCoordinator``.

Each kind finds its own hit (vLLM's ``find_longest_cache_hit`` of the single-type
managers in ``single_type_kv_cache_manager.py``), ``B`` tokens a block, looking at
most ``max_len`` tokens (``context − 1``: one token is always computed)::

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

The kinds' answers are then reconciled: groups of one spec look up together (a
block is a hit only if every group of the spec has it cached), full attention
first; each kind may only shorten the candidate length; repeat until no kind
shortens it (one pass when the model has two kinds, full and one other).
Full-attention hits are then cut to the agreed length. The hit of each kind on its
own is kept as well (the per-kind hit rates).

The blocks found are the pool's (:class:`~fragsim.hybrid.pools.caching.CachingBlockPool`);
this module only says which, and which of a sequence's blocks get keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from fragsim.hybrid.groups import Group
from fragsim.hybrid.pools.caching import CachingBlockPool
from fragsim.kinds import cdiv

_FULL_KINDS = ("full", "mla")


@dataclass(frozen=True)
class Hit:
    """A prefix-cache hit: ``tokens`` reused, the blocks of each group for positions
    ``[lo, tokens // B)`` (lo: the group's first held block), and each kind's own hit."""

    tokens: int
    blocks: tuple[tuple[int, ...], ...]
    by_kind: dict[str, int]
    #: the longest hit any kind found past the agreed one (0: none): the request's
    #: shared-prefix junction, where its sliding-window blocks will be kept
    junction: int = 0


class Coordinator:
    """Looks up hits in a caching pool and says which blocks get keys."""

    def __init__(self, groups: tuple[Group, ...], pool: CachingBlockPool, shape_of: list[int]) -> None:
        if any(g.is_state for g in groups):
            raise ValueError("prefix caching with state (Mamba, linear attention) layers is not "
                             "modelled: vLLM 0.33 runs them in its 'align' mode, with checkpoint blocks")
        if len({g.block_tokens for g in groups}) != 1:
            raise ValueError("prefix caching needs one block size for every group")
        self.groups, self.pool = groups, pool
        self.block_size = groups[0].block_tokens
        self._cached_upto: dict[int, int] = {}                  # seq -> blocks registered
        self._bounds: dict[int, tuple[int, int]] = {}           # seq -> (replay boundary, junction)
        # Spec groups (vLLM's attention_groups): groups of one shape look up together,
        # full attention first.
        specs: dict[int, list[int]] = {}
        for i, shape in enumerate(shape_of):
            specs.setdefault(shape, []).append(i)
        self._specs = sorted(specs.values(), key=lambda gs: groups[gs[0]].kind not in _FULL_KINDS)

    def _cached(self, groups: list[int], key: int) -> bool:
        return all(self.pool.cached(g, key) is not None for g in groups)

    def _find(self, groups: list[int], keys: list[int], max_len: int) -> tuple[int, int]:
        """One spec's hit within ``max_len`` tokens: (first block of the hit, end block)."""
        group = self.groups[groups[0]]
        b = group.block_tokens
        n = min(max_len // b, len(keys))
        if group.kind == "sliding":
            assert group.window is not None
            need = cdiv(group.window - 1, b)
            run = 0
            for i in range(n - 1, -1, -1):
                if not self._cached(groups, keys[i]):
                    run = 0
                    continue
                run += 1
                if run >= need:
                    return i, i + run
            return 0, run
        start = 0
        if group.kind == "chunked" and max_len > 0:
            assert group.chunk is not None
            start = max_len // group.chunk * group.chunk // b
        end = start
        while end < n and self._cached(groups, keys[end]):
            end += 1
        return start, end

    def lookup(self, keys: list[int], max_len: int) -> Hit:
        """The hit of a request whose prompt blocks have ``keys``, within ``max_len``
        tokens (vLLM's ``get_computed_blocks``); nothing changes."""
        b = self.block_size
        by_kind: dict[str, int] = {}
        for gs in self._specs:
            kind = self.groups[gs[0]].kind
            by_kind[kind] = max(by_kind.get(kind, 0), self._find(gs, keys, max_len)[1] * b)
        hit = max_len
        longest = 0
        ends: dict[int, int] = {}
        simple = len(self._specs) == 2 and self.groups[self._specs[0][0]].kind in _FULL_KINDS
        while True:
            curr = hit
            for s, gs in enumerate(self._specs):
                if self.groups[gs[0]].kind in _FULL_KINDS and s in ends:
                    curr = min(curr, ends[s])   # full attention is downward-closed
                    continue
                ends[s] = curr = self._find(gs, keys, curr)[1] * b
                longest = max(longest, curr)
            if curr >= hit:
                break
            hit = curr
            if simple:
                break
        hit = curr
        blocks: list[tuple[int, ...]] = [()] * len(self.groups)
        for gs in self._specs:
            group = self.groups[gs[0]]
            lo = group.holds.skipped_blocks(hit, group.block_tokens)
            for g in gs:
                blocks[g] = tuple(self.pool.cached(g, k) for k in keys[lo:hit // b])  # type: ignore[misc]
        return Hit(hit, tuple(blocks), by_kind, longest if longest > hit else 0)

    def started(self, seq: int, hit_tokens: int, prompt: int, junction: int) -> None:
        """A sequence placed over a hit of ``hit_tokens``, its prompt ``prompt`` tokens."""
        self._cached_upto[seq] = hit_tokens // self.block_size
        self._bounds[seq] = (prompt - 1, junction)

    def forget(self, seq: int) -> None:
        self._cached_upto.pop(seq, None)
        self._bounds.pop(seq, None)

    def _kept(self, seq: int, group: int, start: int, end: int) -> list[int]:
        """Block positions in ``[start, end)`` that ``group`` keys. A sliding window
        keys only the ceil((W − 1) / B) blocks before the request's replay boundary
        (prompt − 1) and before its shared-prefix junction, the runs a later hit can
        end on (vLLM's ``reachable_block_mask`` at its default
        ``prefix_cache_retention_interval = 0``); other kinds key every block."""
        g = self.groups[group]
        if g.kind != "sliding":
            return list(range(start, end))
        assert g.window is not None
        need = cdiv(g.window - 1, g.block_tokens)
        kept: set[int] = set()
        for boundary in self._bounds[seq]:
            if boundary > 0:
                top = boundary // g.block_tokens
                kept.update(range(max(start, top - need), min(end, top)))
        return sorted(kept)

    def cache_blocks(self, seq: int, keys: list[int], first_blocks: list[int]) -> None:
        """Give the sequence's blocks of the positions of ``keys`` their keys (the end
        of the step that computed them; ``first_blocks``: its first held block per
        group); blocks already keyed, and positions it no longer holds, are left alone."""
        start = self._cached_upto.get(seq, 0)
        if start >= len(keys):
            return
        for i, lo in enumerate(first_blocks):
            table = self.pool.block_ids(seq, i)
            for k in self._kept(seq, i, max(start, lo), len(keys)):
                self.pool.set_key(i, table[k - lo], keys[k])
        self._cached_upto[seq] = len(keys)
