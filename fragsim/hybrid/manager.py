"""The request-facing hybrid KV manager: what each sequence holds per group.

A hybrid model's layers come in kinds (:mod:`fragsim.layers`); its KV manager
shares memory among its groups (:mod:`fragsim.hybrid.groups`). What a sequence holds
in a group follows from its kind's rule (:mod:`fragsim.kinds`), kept for all live
sequences as arrays (:mod:`fragsim.hybrid.state`); a stretch's moves come from the
same rule (:mod:`fragsim.hybrid.walk`). Where the blocks are is the pool's
(:mod:`fragsim.hybrid.pools`): the managers differ only in their pool, and prefix
caching is a caching pool with a :class:`~fragsim.hybrid.coordinator.Coordinator`.
The byte split is a linear map of a few sums (:mod:`fragsim.hybrid.basis`).

Free memory is per group where a group owns it (a static partition, Jenga's partly
used large pages) and in the ``pool`` row where any group may take it; the pool row
also holds padding no group owns (vLLM's null block, the remainder of the memory
that makes no whole block). At every instant::

    Σ over groups and categories == kv_pool_bytes                    (exact, always)

Sizes are bytes (``capacity``, ``num_free``, ``rounded``); a sequence's *room*
(:meth:`HybridManager.num_owned`) is the longest requested length that moves no
block, so the engine meets the manager exactly where a block is taken or freed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fragsim.hybrid import steps
from fragsim.hybrid.basis import SplitBasis
from fragsim.hybrid.coordinator import Coordinator, Hit
from fragsim.hybrid.groups import POOL, Group
from fragsim.hybrid.pools.base import Pool
from fragsim.hybrid.pools.caching import CachingBlockPool
from fragsim.hybrid.state import Move, SeqState
from fragsim.kinds import cdiv

__all__ = ["HybridManager", "kind_of_groups"]


class HybridManager:
    """Blocks per group per sequence over a pool: allocate, extend, grow a batch,
    free, stretch, split, check."""

    reserve = "demand"
    grows_on_demand = True
    #: called after each request-facing operation as ``on_op(op, ok, seq)``, ``op`` one of
    #: ``["a", seq, tokens, final]`` (with prefix caching, then ``prompt_len``), ``["e", seq, requested]``, ``["f", seq]``
    #: (and, with prefix caching, ``["l", keys, max_len, hit]``, ``["c", seq, tokens]``):
    #: the vLLM cross-check records a run's operations through it
    on_op: Callable[[list, bool, int], None] | None = None

    def __init__(self, *, name: str, placement: str, pool: Pool, max_seq_len: int,
                 prefix_caching: bool = False) -> None:
        rows = pool.groups
        if not rows:
            raise ValueError("a hybrid KV manager needs at least one group of layers")
        self.name = name
        self.placement_name = placement
        self.rows = rows
        self.pool = pool
        self.capacity = pool.capacity
        self.max_seq_len = max_seq_len
        attention = [r.block_tokens for r in rows if not r.is_state]
        #: positions per block of the attention groups (the engine's growth unit)
        self.block_size = min(attention) if attention else max_seq_len
        self._finals: np.ndarray | None = None
        self.state = SeqState(rows, max_seq_len)
        self.basis = SplitBasis(rows, self.state)
        self.reads_windows = self.basis.reads_windows
        #: whether the split is the basis map of the sums (False: shared blocks correct it)
        self.split_is_linear = not pool.shares_blocks
        self.largest_is_free = pool.largest_is_free
        st = self.state
        #: prefix hits across kinds (None: no prefix caching)
        self.prefix: Coordinator | None = None
        if prefix_caching:
            if not isinstance(pool, CachingBlockPool):
                raise ValueError(f"prefix caching needs a caching pool, not {type(pool).__name__}")
            self.prefix = Coordinator(rows, pool, st.shape_of)
        # the fresh sequence's moves per group, for the tokens last asked for
        self._fresh_of: tuple[int, Move, list[int], list[int]] = (-1, Move([], [], [], []), [], [])

    # ---------------------------------------------------------------- lengths

    def bind_finals(self, finals: np.ndarray) -> None:
        """Final lengths by sequence id (the engine's ``prompt + output``): the
        internal-fragmentation term needs them. Unbound, a sequence's final length is
        taken as ``max_seq_len``."""
        self._finals = np.asarray(finals, dtype=np.int64)

    def _final(self, seq: int) -> int:
        if self._finals is not None and seq < len(self._finals):
            return int(self._finals[seq])
        return self.max_seq_len

    @property
    def held_blocks(self) -> list[int]:
        """Blocks held per group, over the live sequences."""
        return self.state.per_group(self.state.held, len(self.state.live))

    def _fresh(self, q: int) -> tuple[Move, list[int], list[int]]:
        """A fresh sequence of ``q`` tokens: its move, and the blocks each group frees
        and takes (cached: a blocked queue head asks again every step; not to be changed)."""
        if self._fresh_of[0] != q:
            move = self.state.fresh(q)
            st = self.state
            self._fresh_of = (q, move, st.per_group(move.frees), st.per_group(move.takes, move.state))
        return self._fresh_of[1], self._fresh_of[2], self._fresh_of[3]

    # --------------------------------------------------------------- requests

    def allocate(self, seq_id: int, num_slots: int, hit: Hit | None = None,
                 prompt_len: int | None = None) -> Any:
        """Room for ``num_slots`` tokens of a new sequence, none computed yet but the
        first ``hit.tokens`` (a prefix-cache hit's blocks); None: no room, nothing
        changed. ``prompt_len`` (default ``num_slots − 1``) fixes where a caching pool
        keeps its sliding-window blocks. Returns the placement (block ids per group)
        where the pool keeps ids, else the blocks per group."""
        if self._allocate(seq_id, num_slots, hit, prompt_len) is None:
            return None
        return self.placement(seq_id) if self.pool.keeps_ids else tuple(self.blocks_held(seq_id))

    def _allocate(self, seq_id: int, num_slots: int, hit: Hit | None = None,
                  prompt_len: int | None = None, external: int = 0) -> int | None:
        """:meth:`allocate` without building the placement: the new sequence's room
        (:meth:`num_owned`), or None when there was no room. ``external``: its first
        tokens whose KV arrives from elsewhere (a prefill instance): only the blocks
        reading past them need are taken, as vLLM 0.33's ``allocate_slots`` does with
        ``num_external_computed_tokens`` (a window's blocks, one state)."""
        if seq_id in self.state.live:
            raise ValueError(f"sequence {seq_id} is already allocated")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if not 0 <= external < num_slots:
            raise ValueError(f"external must be in [0, {num_slots}), got {external}")
        if external and self.prefix is not None:
            raise ValueError(f"{self.name} with prefix caching takes no external tokens")
        if self.prefix is None:
            if hit is not None:
                raise ValueError(f"{self.name} has no prefix cache to hit")
            if external:
                st = self.state
                zero = [0] * len(st.shapes)
                move = st.target(num_slots, external, zero, zero, 1 if st.state_groups else 0)
                frees, takes = st.per_group(move.frees), st.per_group(move.takes, move.state)
            else:
                move, frees, takes = self._fresh(num_slots)
            ok = self.pool.place(seq_id, frees, takes)
        else:
            move, ok = self._allocate_hit(seq_id, num_slots, hit, prompt_len)
        if ok:
            self.state.start(seq_id, self._final(seq_id), num_slots, move)
        if self.on_op is not None:
            op = ["a", seq_id, num_slots, self._final(seq_id)]
            self.on_op(op if self.prefix is None else op + [prompt_len], ok, seq_id)
        return self.state.room_of(move.lo, move.hi) if ok else None

    def _allocate_hit(self, seq_id: int, num_slots: int, hit: Hit | None,
                      prompt_len: int | None) -> tuple[Move, bool]:
        """A new sequence over a caching pool, holding the hit's blocks (one block size)."""
        assert self.prefix is not None
        h = hit.tokens if hit is not None else 0
        if h >= num_slots:
            raise ValueError(f"a hit of {h} tokens leaves nothing to compute of {num_slots}")
        b = self.block_size
        move = Move([sh.rule.skipped_blocks(h, b) for sh in self.state.shapes],
                    [cdiv(num_slots, b)] * len(self.state.shapes), [], [])
        takes = [cdiv(num_slots, b) - h // b] * len(self.rows)
        hits = hit.blocks if hit is not None else ((),) * len(self.rows)
        ok = self.pool.place_hit(seq_id, hits, takes)  # type: ignore[attr-defined]
        if ok:
            prompt = num_slots - 1 if prompt_len is None else prompt_len
            self.prefix.started(seq_id, h, prompt, hit.junction if hit is not None else 0)
        return move, ok

    def lookup(self, keys: list[int], max_len: int) -> Hit:
        """The prefix-cache hit of a prompt whose blocks have ``keys``, within ``max_len``
        tokens (vLLM's ``get_computed_blocks``; nothing changes)."""
        if self.prefix is None:
            raise ValueError(f"{self.name} has no prefix cache")
        hit = self.prefix.lookup(keys, max_len)
        if self.on_op is not None:
            self.on_op(["l", list(keys), max_len, hit.tokens], True, -1)
        return hit

    def cache_blocks(self, seq_id: int, keys: list[int]) -> None:
        """Give the sequence's blocks of the positions of ``keys`` their keys (the end of
        the step that computed them)."""
        if self.prefix is None:
            raise ValueError(f"{self.name} has no prefix cache")
        self.prefix.cache_blocks(seq_id, keys, [self.first_block(seq_id, i) for i in range(len(self.rows))])
        if self.on_op is not None:
            self.on_op(["c", seq_id, len(keys) * self.block_size], True, seq_id)

    def extend(self, seq_id: int, num_slots: int) -> bool:
        """Raise the request to ``q + num_slots`` tokens with ``q + num_slots − 1`` of them
        computed (a decode step): blocks out of the window go back first, then the new
        ones are taken; False if they cannot all be had (the sequence as it was, or,
        where the pool frees first as vLLM does, without its out-of-window blocks)."""
        return self._extend_owned(seq_id, num_slots) is not None

    def _extend_owned(self, seq_id: int, num_slots: int) -> int | None:
        """:meth:`extend`, then :meth:`num_owned` (None: the blocks could not be had)."""
        st = self.state
        if seq_id not in st.live:
            raise ValueError(f"extend of unknown sequence {seq_id}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        q = int(st.q[seq_id]) + num_slots
        move = st.move_of(seq_id, q, q - 1)
        if any(move.frees) or any(move.takes):
            if not self.pool.place(seq_id, st.per_group(move.frees), st.per_group(move.takes, move.state)):
                if self.pool.frees_on_failure:   # the window's blocks went back before the check
                    st.commit(seq_id, int(st.q[seq_id]), Move(move.lo, st.hi[:, seq_id].tolist(), [], []))
                if self.on_op is not None:
                    self.on_op(["e", seq_id, q], False, seq_id)
                return None
        st.commit(seq_id, q, move)
        if self.on_op is not None:
            self.on_op(["e", seq_id, q], True, seq_id)
        return st.room_of(move.lo, move.hi)

    def release_skipped(self, seq_id: int, computed: int) -> None:
        """Give back the blocks a sequence no longer reads with ``computed`` tokens
        computed, its length unchanged (a finished request whose KV waits to be read
        elsewhere keeps its window's blocks only, as vLLM frees out-of-window blocks
        before ``request_finished``)."""
        st = self.state
        st.require(seq_id)
        q = int(st.q[seq_id])
        move = st.move_of(seq_id, q, computed)
        if any(move.frees):
            ok = self.pool.place(seq_id, st.per_group(move.frees), [0] * len(self.rows))
            assert ok, "freeing blocks cannot fail"
            st.commit(seq_id, q, move)

    def grow_many(self, seqs: np.ndarray | list[int], targets: np.ndarray | list[int]) -> list[int] | None:
        """:meth:`extend` of decoding sequences to ``targets`` (``targets − 1`` computed),
        in the order given, when the free memory is known to hold every block taken;
        returns each one's room then (:meth:`num_owned`), or None, with nothing
        changed, when the blocks might not all be had."""
        st = self.state
        seq_list = seqs.tolist() if isinstance(seqs, np.ndarray) else list(seqs)
        target_list = targets.tolist() if isinstance(targets, np.ndarray) else list(targets)
        rooms, per_shape = st.grow_moves(seq_list, target_list)
        zero = [0] * len(seq_list)
        frees = [per_shape[s][4] if s >= 0 else zero for s in st.shape_of]
        takes = [per_shape[s][5] if s >= 0 else zero for s in st.shape_of]
        if not self.pool.fits_batch(takes, frees):
            return None
        if self.on_op is not None:   # the batch as the extends it stands for, each one seen
            rooms = []
            for seq, t in zip(seq_list, target_list, strict=True):
                room = self._extend_owned(seq, t - int(st.q[seq]))
                if room is None:
                    raise AssertionError("a move ran out of blocks it was told were free")
                rooms.append(room)
            return rooms
        self.pool.place_batch(seq_list, frees, takes)
        st.commit_grown(np.asarray(seqs, dtype=np.int64), target_list, per_shape)
        return rooms

    def free(self, seq_id: int) -> list[int]:
        """End a sequence; the blocks each group held for it."""
        if seq_id not in self.state.live:
            raise ValueError(f"free of unknown sequence {seq_id}")
        held = self.state.blocks_held(seq_id)
        self.pool.release(seq_id, held)
        if self.prefix is not None:
            self.prefix.forget(seq_id)
        self.state.end(seq_id)
        if self.on_op is not None:
            self.on_op(["f", seq_id], True, seq_id)
        return held

    # -------------------------------------------------------------- stretches

    def stretch(self, seqs: np.ndarray, reqs: np.ndarray, filled0: np.ndarray, k: int,
                head_tokens: int | None, first_step_first: bool = False, owned: np.ndarray | None = None
                ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Up to ``k`` decode steps of the sequences ``seqs`` (all that hold memory), the
        sequence at ``filled0`` tokens computing token ``filled0 + j`` in step ``j``
        (:func:`fragsim.hybrid.steps.stretch`): the steps taken, the split of each
        ``[k, groups + 1, categories]``, the largest allocatable bytes and used blocks
        of each, and each sequence's last requested length (−1: no block moved)."""
        head = None if head_tokens is None else (lambda: self._fresh(head_tokens)[2])
        return steps.stretch(self.state, self.pool, self.basis, seqs, reqs, filled0, k, head, first_step_first, owned)

    # ------------------------------------------------------------------ sizes

    def owned_many(self, seqs: np.ndarray) -> np.ndarray:
        """:meth:`num_owned` of many sequences."""
        return self.state.rooms(seqs)

    def can_allocate(self, num_slots: int) -> bool:
        return self.pool.fits(self._fresh(num_slots)[2])

    def num_free(self) -> int:
        return int(sum(self.pool.free_bytes()))

    def largest_allocatable(self) -> int:
        """Free bytes a new sequence can be placed in (no more than ``num_free``)."""
        return self.pool.largest_allocatable()

    def num_used_blocks(self) -> int:
        """Block ids (or small pages) held by sequences."""
        return self.pool.used_blocks()

    def rounded(self, num_slots: int) -> int:
        """Bytes a fresh sequence of ``num_slots`` tokens holds."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        takes = self._fresh(num_slots)[2]
        return sum(t * r.block_bytes for t, r in zip(takes, self.rows, strict=True))

    def fits_empty(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` tokens, all allocated at once, fits the
        empty pool (recompute re-admits a preempted sequence that way)."""
        return self.pool.fits_empty(self._fresh(num_tokens)[2])

    def num_owned(self, seq_id: int) -> int:
        """The largest requested length that moves no block of the sequence."""
        self.state.require(seq_id)
        return self.state.room(seq_id)

    def num_requested(self, seq_id: int) -> int:
        self.state.require(seq_id)
        return int(self.state.q[seq_id])

    def seq_ids(self) -> list[int]:
        return list(self.state.live)

    def placement(self, seq_id: int) -> tuple[tuple[int, ...], ...]:
        """Block ids per group, in logical order (freed leading blocks left out)."""
        self.state.require(seq_id)
        return tuple(tuple(self.pool.block_ids(seq_id, i)) for i in range(len(self.rows)))

    def blocks_held(self, seq_id: int) -> list[int]:
        """Blocks each group holds for the sequence."""
        return self.state.blocks_held(seq_id)

    def first_block(self, seq_id: int, group: int) -> int:
        """The sequence's first held block of a group (blocks before it were skipped)."""
        s = self.state.shape_of[group]
        return int(self.state.lo[s, seq_id]) if s >= 0 else 0

    @property
    def unit_kinds(self) -> list[str]:
        """What each group index of :meth:`unit_rows` holds."""
        return self.pool.unit_kinds

    def unit_rows(self) -> np.ndarray:
        """The pool's address space in its own units (blocks, slots, large pages), each
        marked with the group that holds it, −1 where free (for address maps)."""
        return self.pool.unit_rows()

    # -------------------------------------------------------------- the split

    @property
    def labels(self) -> list[str]:
        """Group labels, then the pool's."""
        return [r.label for r in self.rows] + [POOL]

    def split(self, seqs: np.ndarray, computed: np.ndarray,
              receiving: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """Bytes per group (and the pool, last) per category, for the live sequences
        ``seqs`` that have ``computed`` tokens stored now: :meth:`split_basis` of
        :meth:`sums`, shared blocks counted once (``receiving``: :meth:`sums`)."""
        out = self.basis.split_of(self.sums(computed, int(computed.sum()), check=False, receiving=receiving)[0])
        if self.pool.shares_blocks:
            self.pool.correct_split(out, self.state, seqs, computed)  # type: ignore[attr-defined]
        return out

    def split_basis(self) -> np.ndarray:
        """The split as a linear map of :meth:`sums`: ``[sums, (groups + 1) · categories]``
        (:class:`~fragsim.hybrid.basis.SplitBasis`)."""
        return self.basis.matrix

    def sums(self, computed: np.ndarray | None, stored: int, check: bool = True,
             receiving: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[list[int], int, int, int]:
        """The sums :meth:`split_basis` maps to the split now, and the split's token
        states, free and everything else held (:meth:`SplitBasis.sums`; ``receiving``:
        the sequences placed ahead of KV still arriving, and their computed lengths)."""
        return self.basis.sums(computed, stored, self.pool.free_bytes(), self.pool.fixed_padding(),
                               self.capacity, check, receiving)

    def token_state_bytes(self, seqs: list[int], computed: list[int]) -> int:
        """Bytes of token states the sequences ``seqs`` hold with ``computed`` tokens
        stored (each read again; a state group's whole state)."""
        return self.basis.token_bytes(np.asarray(seqs, dtype=np.int64), np.asarray(computed, dtype=np.int64))

    def held_only_bytes(self, held: dict[int, int], seqs: np.ndarray, computed: np.ndarray) -> int:
        """Bytes of token states that go with the sequences ``held`` (kept past their
        requests, with their stored lengths) among the live ``seqs``: a block they share
        with a sequence still running is that one's."""
        if not self.pool.shares_blocks:
            return self.token_state_bytes(list(held), list(held.values()))
        return self.pool.held_only_bytes(self.state, held, seqs, computed)  # type: ignore[attr-defined]

    def moved_bytes(self, seq_id: int, first: int, last: int) -> dict[str, int]:
        """The data bytes, per layer kind, of the blocks the sequence holds for positions
        ``[first, last)`` (each state group's state): what a transfer of those tokens
        moves into it (padding stays behind)."""
        st = self.state
        st.require(seq_id)
        out: dict[str, int] = {}
        for i, row in enumerate(self.rows):
            s = st.shape_of[i]
            if s < 0:
                size = row.state_bytes
            else:
                b = row.block_tokens
                lo, hi = max(int(st.lo[s, seq_id]), first // b), min(int(st.hi[s, seq_id]), -(-last // b))
                size = max(hi - lo, 0) * b * row.token_bytes
            out[row.kind] = out.get(row.kind, 0) + size
        return out

    def check(self) -> None:
        """The kept sums against the per-sequence arrays, and the pool's own invariants."""
        self.state.check()
        self.pool.check(self.held_blocks)


def kind_of_groups(rows: tuple[Group, ...]) -> list[str]:
    """The kind of each group, then the pool's (for the per-kind split)."""
    return [r.kind for r in rows] + [POOL]
