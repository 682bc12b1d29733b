"""The hybrid KV manager: what each sequence holds per group, and where every byte goes.

A hybrid model's layers come in kinds (:mod:`fragsim.layers`); its KV manager
shares one pool among its groups (:mod:`fragsim.hybrid.groups`). What a sequence
holds in a group follows from its kind's rule (:mod:`fragsim.kinds`), kept for all
live sequences as arrays (:mod:`fragsim.hybrid.state`); a stretch's moves come
from the same rule (:mod:`fragsim.hybrid.walk`). The managers differ only in how
they cut the pool, and a subclass owns that part
(:mod:`fragsim.hybrid.vllm_hybrid`, :mod:`~fragsim.hybrid.jenga`,
:mod:`~fragsim.hybrid.static_partition`, :mod:`~fragsim.hybrid.paged_uniform`).

Where the bytes go
------------------
Per group, with ``F`` the sequence's final length, ``f`` its computed length and
``s(f)`` the first position the next token reads (the kind's ``skipped(f)``), the
held positions ``[lo·B, hi·B)`` split into::

    out_of_window           [lo·B, s(f))     stored, held, never read again
    token_states            [max(s, lo·B), f) stored and read again
    reservation             [f, min(hi·B, F)) held, filled later
    internal_fragmentation  [max(F, lo·B), hi·B) the block tail it never fills

(each in tokens × the group's bytes per token; a state group's whole state is token
states), and each block adds ``padding``: the bytes of its page that hold none of
the group's real layers (vLLM's phantom layers and padded state pages, Jenga's
padding up to its page sizes). Free memory is per group where a group owns it (a
static partition, Jenga's partly used large pages) and in the ``pool`` row where
any group may take it; the pool row also holds padding no group owns (vLLM's null
block, the remainder of the memory that makes no whole block). At every instant::

    Σ over rows and categories == kv_pool_bytes                    (exact, always)

The split is linear in a few sums (:meth:`HybridManager.split_basis`): Σ computed,
per shape the kept sums of :class:`~fragsim.hybrid.state.SeqState` (blocks held,
the ``lo·B`` floor, the tails), per window the window starts Σ s(f), per state
group its states, and the free bytes. Only the window starts are summed over the
sequences per step: as no sequence's ``lo·B`` passes its ``s(f)``, out of the
window is Σ s(f) − Σ lo·B.

Sizes are bytes (``capacity``, ``num_free``, ``rounded``); a sequence's *room*
(:meth:`HybridManager.num_owned`) is the longest requested length that moves no
block, so the engine meets the manager exactly where a block is taken or freed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fragsim.hybrid.groups import (
    CATEGORIES,
    FREE,
    INTERNAL,
    OUT_OF_WINDOW,
    PADDING,
    POOL,
    RESERVATION,
    TOKEN,
    Group,
)
from fragsim.hybrid.state import Move, SeqState
from fragsim.hybrid.walk import walk

__all__ = ["CATEGORIES", "FREE", "INTERNAL", "OUT_OF_WINDOW", "PADDING", "POOL", "RESERVATION", "TOKEN",
           "HybridManager", "kind_of_groups", "one_pool_admits", "one_pool_fits"]


class HybridManager:
    """Blocks per group per sequence, and the byte split; subclasses own the pool.

    A subclass sets ``capacity`` (pool bytes) and implements ``_place(seq, frees,
    takes)`` (free each group's leading ``frees[g]`` blocks, take ``takes[g]`` more,
    all or nothing), ``_release(seq, held)``, ``_free_bytes()`` (free bytes per group,
    then the pool's), ``_fixed_padding()``, ``_can_take(takes)``, ``_fits_empty(takes)``,
    ``_block_ids(seq, group)`` and ``_check_pool()``.
    """

    reserve = "demand"
    grows_on_demand = True
    #: whether block ids are kept (placement(), address maps); a subclass may keep counts only
    tracks_ids = True
    #: a counts-only pool's free blocks (:meth:`_count_one_pool`)
    _free_count: int
    #: whether :meth:`_stretch_fits` reads the takes per sequence (else it gets zeros)
    _needs_per_seq = True
    #: whether :meth:`split` is :meth:`split_basis` of :meth:`_basis` (False: a subclass
    #: corrects it, as for shared blocks)
    split_is_linear = True
    #: whether every free byte is allocatable (False: the subclass says less)
    largest_is_free = True
    #: called after each request-facing operation as ``on_op(op, ok, seq)``, ``op`` one of
    #: ``["a", seq, tokens, final]``, ``["e", seq, requested]``, ``["f", seq]`` (and, with
    #: prefix caching, ``["l", keys, max_len, hit]``, ``["c", seq, tokens]``): the vLLM
    #: cross-check records a run's operations through it
    on_op: Callable[[list, bool, int], None] | None = None

    def __init__(self, *, name: str, placement: str, rows: tuple[Group, ...], capacity: int,
                 max_seq_len: int) -> None:
        if not rows:
            raise ValueError("a hybrid KV manager needs at least one group of layers")
        self.name = name
        self.placement_name = placement
        self.rows = rows
        self.capacity = int(capacity)
        self.max_seq_len = max_seq_len
        attention = [r.block_tokens for r in rows if not r.is_state]
        #: positions per block of the attention groups (the engine's growth unit)
        self.block_size = min(attention) if attention else max_seq_len
        self._finals: np.ndarray | None = None
        self.state = SeqState(rows, max_seq_len)
        #: the live sequences (the state's)
        self._live = self.state.live
        st = self.state
        S = len(st.shapes)
        self._state_rows = st.state_groups
        self._rows_per_shape_arr = np.array([len(sh.groups) for sh in st.shapes], dtype=np.int64)
        # each group's shape as an index into per-shape columns (a state group: 0, zeroed)
        self._shape_of_rows = np.array([max(s, 0) for s in st.shape_of], dtype=np.int64)
        self._rows_are_shapes = st.shape_of == list(range(len(rows)))
        #: whether the split reads every sequence's computed length (a group with a window)
        self.reads_windows = any(r.rule.frees for r in rows if not r.is_state)
        # Split groups: the groups of a shape that read from one window start (their
        # rule): (shape, its groups, rule).
        self._split_groups: list[tuple[int, list[int], Any]] = []
        for s, shape in enumerate(st.shapes):
            by_rule: dict[Any, list[int]] = {}
            for i in shape.groups:
                by_rule.setdefault(rows[i].rule, []).append(i)
            self._split_groups += [(s, members, rule) for rule, members in by_rule.items()]
        # Per split group, for :meth:`_basis`: its shape, rule, block, and the sums over its
        # groups of bytes per token, padding per block and bytes per block.
        self._basis_info = [(s, rule, st.shapes[s].block_tokens,
                             sum(rows[i].token_bytes for i in members),
                             sum(rows[i].padding_per_block for i in members),
                             sum(rows[i].block_bytes for i in members))
                            for s, members, rule in self._split_groups]
        assert S == len(st.shapes)
        self._basis_matrix: np.ndarray | None = None   # split_basis(), once built
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
        return self.state.per_group(self.state.held, len(self._live))

    def _fresh(self, q: int) -> tuple[Move, list[int], list[int]]:
        """A fresh sequence of ``q`` tokens: its move, and the blocks each group frees
        and takes (cached: a blocked queue head asks again every step; not to be changed)."""
        if self._fresh_of[0] != q:
            move = self.state.fresh(q)
            st = self.state
            self._fresh_of = (q, move, st.per_group(move.frees), st.per_group(move.takes, move.state))
        return self._fresh_of[1], self._fresh_of[2], self._fresh_of[3]

    def _moves_of(self, move: Move) -> tuple[list[int], list[int]]:
        """A live sequence's move as frees and takes per group."""
        return self.state.per_group(move.frees), self.state.per_group(move.takes, move.state)

    # ------------------------------------------------------ requests

    def allocate(self, seq_id: int, num_slots: int) -> Any:
        """Room for ``num_slots`` tokens of a new sequence, none computed yet (None: no room)."""
        if not self._allocate(seq_id, num_slots):
            return None
        # Without ids, the blocks per group stand for the placement (the engine only tests it).
        return self.placement(seq_id) if self.tracks_ids else tuple(self.blocks_held(seq_id))

    def _allocate(self, seq_id: int, num_slots: int) -> bool:
        """:meth:`allocate` without building the placement: whether there was room."""
        if seq_id in self._live:
            raise ValueError(f"sequence {seq_id} is already allocated")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        move, frees, takes = self._fresh(num_slots)
        ok = self._place(seq_id, frees, takes)
        if ok:
            self.state.start(seq_id, self._final(seq_id), num_slots, move)
        if self.on_op is not None:
            self.on_op(["a", seq_id, num_slots, self._final(seq_id)], ok, seq_id)
        return ok

    def extend(self, seq_id: int, num_slots: int) -> bool:
        """Raise the request to ``q + num_slots`` tokens with ``q + num_slots − 1`` of them
        computed (a decode step): blocks out of the window go back first, then the new
        ones are taken; False (state unchanged) if they cannot all be had."""
        return self._extend_owned(seq_id, num_slots) is not None

    def _extend_owned(self, seq_id: int, num_slots: int) -> int | None:
        """:meth:`extend`, then :meth:`num_owned` (None: the blocks could not be had)."""
        if seq_id not in self._live:
            raise ValueError(f"extend of unknown sequence {seq_id}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        st = self.state
        q = int(st.q[seq_id]) + num_slots
        move = st.move_of(seq_id, q, q - 1)
        if any(move.frees) or any(move.takes):
            frees, takes = self._moves_of(move)
            if not self._place(seq_id, frees, takes):
                self._extend_failed(seq_id, move)
                if self.on_op is not None:
                    self.on_op(["e", seq_id, q], False, seq_id)
                return None
        st.commit(seq_id, q, move)
        if self.on_op is not None:
            self.on_op(["e", seq_id, q], True, seq_id)
        return st.room_of(move.lo, move.hi)

    def _extend_failed(self, seq_id: int, move: Move) -> None:
        """An extension whose blocks could not be had leaves the sequence as it was."""

    def grow_many(self, seqs: np.ndarray, targets: np.ndarray | list[int]) -> list[int] | None:
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
        if not self._fits_moves(takes, frees):
            return None
        if self.on_op is not None:   # the batch as the extends it stands for, each one seen
            rooms = []
            for seq, t in zip(seq_list, target_list, strict=True):
                room = self._extend_owned(seq, t - int(st.q[seq]))
                if room is None:
                    raise AssertionError("a move ran out of blocks it was told were free")
                rooms.append(room)
            return rooms
        self._place_moves(seq_list, frees, takes)
        st.commit_grown(np.asarray(seqs, dtype=np.int64), target_list, per_shape)
        return rooms

    def _fits_moves(self, takes: list[list[int]], frees: list[list[int]]) -> bool:
        """Whether one step's moves (per group and sequence, ``takes[g][s]``,
        ``frees[g][s]``) surely fit: :meth:`_stretch_fits` of that one step."""
        per_seq = np.array(takes, dtype=np.int64)
        return self._stretch_fits(per_seq.sum(axis=1)[None, :], np.array(frees, dtype=np.int64).sum(axis=1)[None, :],
                                  per_seq[:, None, :]) == 1

    def _place_moves(self, seqs: list[int], frees: list[list[int]], takes: list[list[int]]) -> None:
        """:meth:`_place` of each sequence in turn (``[group][seq]``), known to fit."""
        place = self._place
        for seq, f, t in zip(seqs, zip(*frees, strict=True), zip(*takes, strict=True), strict=True):
            if (any(f) or any(t)) and not place(seq, list(f), list(t)):
                raise AssertionError("a move ran out of blocks it was told were free")

    def free(self, seq_id: int) -> None:
        if seq_id not in self._live:
            raise ValueError(f"free of unknown sequence {seq_id}")
        self._release(seq_id, self.state.blocks_held(seq_id))
        self.state.end(seq_id)
        if self.on_op is not None:
            self.on_op(["f", seq_id], True, seq_id)

    # ------------------------------------------------------------- stretches

    def stretch(self, seqs: np.ndarray, reqs: np.ndarray, filled0: np.ndarray, k: int,
                head_tokens: int | None, first_step_first: bool = False, owned: np.ndarray | None = None
                ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Up to ``k`` decode steps of the sequences ``seqs`` (all that hold memory), the
        sequence at ``filled0`` tokens computing token ``filled0 + j`` in step ``j``.

        Each sequence's blocks over the stretch follow from its rule, so the blocks every
        step takes and frees are known up front (:func:`~fragsim.hybrid.walk.walk`). The
        stretch stops before the first step whose takes might not all fit
        (:meth:`_stretch_fits`) and, when a request of ``head_tokens`` waits at the head
        of the queue, before the first step whose frees might let it in
        (:meth:`_stretch_admits`). Block ids move event by event in the order exact
        steps would move them (step, then ``reqs``).

        Returns the steps taken, the split of each ``[k, groups + 1, categories]``, the
        largest allocatable bytes and used blocks of each, and each sequence's last
        requested length (−1: no block moved).
        """
        st = self.state
        R, n, S = len(self.rows), len(seqs), len(st.shapes)
        # Each sequence's first move: the first step whose target passes its room
        # (``owned``: :meth:`owned_many` of ``seqs``, when the caller keeps it).
        if owned is None:
            owned = self.owned_many(seqs)
        j0 = np.maximum(owned - filled0, 0)   # a prompt just computed may be past its window
        movers = np.flatnonzero(j0 < k)
        # Under memory pressure a stretch often cannot take its first step, and stretches
        # stall in runs: ``first_step_first`` (the caller's last stretch stalled) tries the
        # first step alone first (the limits read no later step to stop there).
        for kk in ((1, k) if first_step_first and k > 1 and (j0[movers] == 0).any() else (k,)):
            w = walk(st, movers, seqs, filled0, j0, kk)
            step_takes = np.array(w.takes, dtype=np.int64).reshape(kk, S)
            step_frees = np.array(w.frees, dtype=np.int64).reshape(kk, S)
            if not self._rows_are_shapes:   # per shape, then per group
                step_takes, step_frees = step_takes[:, self._shape_of_rows], step_frees[:, self._shape_of_rows]
            if self._state_rows:
                step_takes[:, self._state_rows] = 0
                step_frees[:, self._state_rows] = 0
            if w.moves and self._needs_per_seq:
                per_seq = np.zeros((R, kk, n), dtype=np.int64)
                for j, col, _, _, _, _, tks in w.moves:
                    per_seq[:, j, col] = st.per_group(tks)
            else:
                per_seq = np.zeros((R, kk, 0), dtype=np.int64)   # no sequence takes, or not read
            limit = self._stretch_fits(step_takes, step_frees, per_seq)
            if head_tokens is not None and w.moves and step_frees.any():
                limit = min(limit, self._stretch_admits(step_takes, step_frees, self._fresh(head_tokens)[2]))
            if limit == 0:
                break
        k = min(k, limit)
        if k <= 0:
            return (0, np.zeros((0, R + 1, len(CATEGORIES)), dtype=np.int64), np.zeros(0, dtype=np.int64),
                    np.zeros(0, dtype=np.int64), np.full(n, -1))
        moves = [mv for mv in w.moves if mv[0] < k] if k < kk else w.moves
        if not self.tracks_ids:
            # Counts: the moves of a step add up in any order, and the free units after
            # each step are a running sum.
            free_rows, largest, used = self._count_steps(np.array(w.frees[:k], dtype=np.int64).reshape(k, S),
                                                         np.array(w.takes[:k], dtype=np.int64).reshape(k, S))
        else:
            free_rows, largest, used = self._place_stretch(moves, k, seqs, reqs)
        # Commit each sequence's blocks after its last move, and the sums.
        last_target = np.full(n, -1, dtype=np.int64)
        final_state: dict[int, tuple[int, list[int], list[int]]] = {}
        for _, col, t, lo1s, hi1s, _, _ in moves:
            final_state[col] = (t, lo1s, hi1s)
        d_sums = np.array(w.sums, dtype=np.int64).reshape(3, -1, S)[:, :k]
        if final_state:
            cols = np.fromiter(final_state, dtype=np.int64, count=len(final_state))
            touched = seqs[cols]
            states = list(final_state.values())
            last_target[cols] = [x[0] for x in states]
            st.lo[:, touched] = np.array([x[1] for x in states], dtype=np.int64).T   # [S, moved]
            st.hi[:, touched] = np.array([x[2] for x in states], dtype=np.int64).T
            st.q[touched] = last_target[cols]
            sums = np.cumsum(d_sums, axis=1)                          # [3, k, S]
            tot = sums[:, -1].tolist()
        else:
            sums = d_sums
            tot = [[0] * S for _ in range(3)]
        for s, shape in enumerate(st.shapes):
            st.held[s] += tot[0][s]
            st.floor[s] += tot[1][s] * shape.block_tokens
            st.tail[s] += tot[2][s]
        # The split of every step: the sums :meth:`split_basis` maps (the kept sums
        # before the stretch plus their changes), worked out a split group at a time.
        G, n_states = len(self._split_groups), len(self._state_rows)
        step_sums = np.empty((k, 2 + 4 * G + n_states + R + 1), dtype=np.int64)
        step_sums[:, 0] = int(filled0.sum()) + n * np.arange(k, dtype=np.int64)   # Σ computed
        step_sums[:, 1] = self._fixed_padding()
        f: np.ndarray | None = None
        for g, (s, _, rule) in enumerate(self._split_groups):
            b = st.shapes[s].block_tokens
            col = 2 + 4 * g
            step_sums[:, col] = st.held[s] - tot[0][s] + sums[0, :, s]
            step_sums[:, col + 1] = st.floor[s] - tot[1][s] * b + sums[1, :, s] * b
            step_sums[:, col + 2] = st.tail[s] - tot[2][s] + sums[2, :, s]
            if rule.frees:
                if f is None:
                    f = filled0[None, :] + np.arange(k, dtype=np.int64)[:, None]
                step_sums[:, col + 3] = rule.skipped(f).sum(axis=1)
            else:
                step_sums[:, col + 3] = 0
        step_sums[:, 2 + 4 * G: 2 + 4 * G + n_states] = len(self._live)
        step_sums[:, 2 + 4 * G + n_states:] = free_rows
        return k, self._split_of(step_sums), largest, used, last_target

    def _place_stretch(self, moves: list, k: int, seqs: np.ndarray,
                       reqs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Block ids of a stretch's ``k`` steps (``moves``: theirs), move by move in
        exact-mode order (step, then request); per step, the pool's free bytes per group,
        largest allocatable and used blocks after it."""
        R = len(self.rows)
        if moves:
            req_of = reqs.tolist()
            moves = sorted(moves, key=lambda mv: (mv[0], req_of[mv[1]], mv[1]))
        seq_list = seqs.tolist()
        shape_of = self.state.shape_of
        snapshot = (self._free_bytes(), self.largest_allocatable(), self.num_used_blocks())
        snaps, at = [snapshot], [0]
        i = 0
        while i < len(moves):
            j = moves[i][0]
            first = i
            while i < len(moves) and moves[i][0] == j:
                i += 1
            step = moves[first:i]
            zero = [0] * len(step)
            self._place_moves([seq_list[mv[1]] for mv in step],
                              [[mv[5][s] for mv in step] if s >= 0 else zero for s in shape_of],
                              [[mv[6][s] for mv in step] if s >= 0 else zero for s in shape_of])
            snaps.append((self._free_bytes(), self.largest_allocatable(), self.num_used_blocks()))
            at.append(j)
        if len(snaps) == 1:
            return (np.broadcast_to(np.array(snapshot[0], dtype=np.int64), (k, R + 1)),
                    np.full(k, snapshot[1], dtype=np.int64), np.full(k, snapshot[2], dtype=np.int64))
        # Step j holds the state after the last step at or before it that moved.
        which = np.searchsorted(np.array(at[1:], dtype=np.int64), np.arange(k), side="right")
        return (np.array([sn[0] for sn in snaps], dtype=np.int64)[which],
                np.array([sn[1] for sn in snaps], dtype=np.int64)[which],
                np.array([sn[2] for sn in snaps], dtype=np.int64)[which])

    def _count_steps(self, frees: np.ndarray, takes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Steps in which each group of attention shape ``s`` frees ``frees[j, s]`` blocks and
        takes ``takes[j, s]``, applied to a counts-only pool: per step, the free bytes per
        group, largest allocatable and used blocks after it."""
        raise NotImplementedError(f"{self.name} keeps block ids")

    def _count_one_pool(self, frees: np.ndarray, takes: np.ndarray, unit_bytes: int,
                        num_units: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_count_steps` of one pool of ``num_units`` units, one a block of any group,
        counted in ``self._free_count`` (every free byte allocatable)."""
        free = self._free_count + np.cumsum((frees - takes) @ self._rows_per_shape_arr)
        if len(free) and int(free.min()) < 0:
            raise AssertionError("a block move failed inside a stretch that had room for it")
        if len(free):
            self._free_count = int(free[-1])
        free_rows = np.zeros((len(free), len(self.rows) + 1), dtype=np.int64)
        free_rows[:, -1] = free * unit_bytes
        return free_rows, free_rows[:, -1].copy(), num_units - free

    def _stretch_fits(self, takes: np.ndarray, frees: np.ndarray, per_seq: np.ndarray) -> int:
        """The first step whose takes might not fit, given each step's takes and frees
        per group (``[k, groups]``; ``per_seq``: the takes ``[groups, k, seqs]``): frees of
        earlier steps count, a step's own do not.
        This default ignores frees (safe for any pool); pools that know better override."""
        cum = np.cumsum(takes, axis=0)
        for j in range(len(cum)):
            if not self._can_take(cum[j].tolist()):
                return j
        return len(cum)

    def _stretch_admits(self, takes: np.ndarray, frees: np.ndarray, head: list[int]) -> int:
        """The first step after whose moves a fresh sequence taking ``head`` blocks per
        group might fit. This default says the first step that frees anything (safe)."""
        freeing = np.flatnonzero(frees.any(axis=1))
        return int(freeing[0]) if len(freeing) else len(takes)

    # ------------------------------------------------------------------ sizes

    def owned_many(self, seqs: np.ndarray) -> np.ndarray:
        """:meth:`num_owned` of many sequences."""
        return self.state.rooms(seqs)

    def can_allocate(self, num_slots: int) -> bool:
        return self._can_take(self._fresh(num_slots)[2])

    def num_free(self) -> int:
        return int(sum(self._free_bytes()))

    def largest_allocatable(self) -> int:
        """Free bytes a new sequence can be placed in (no more than ``num_free``)."""
        return self.num_free()

    def rounded(self, num_slots: int) -> int:
        """Bytes a fresh sequence of ``num_slots`` tokens holds."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        takes = self._fresh(num_slots)[2]
        return sum(t * r.block_bytes for t, r in zip(takes, self.rows, strict=True))

    def fits_empty(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` tokens, all allocated at once, fits the
        empty pool (recompute re-admits a preempted sequence that way)."""
        return self._fits_empty(self._fresh(num_tokens)[2])

    def num_owned(self, seq_id: int) -> int:
        """The largest requested length that moves no block of the sequence."""
        self.state.require(seq_id)
        return self.state.room(seq_id)

    def num_requested(self, seq_id: int) -> int:
        self.state.require(seq_id)
        return int(self.state.q[seq_id])

    def seq_ids(self) -> list[int]:
        return list(self._live)

    def placement(self, seq_id: int) -> tuple[tuple[int, ...], ...]:
        """Block ids per group, in logical order (freed leading blocks left out)."""
        self.state.require(seq_id)
        return tuple(tuple(self._block_ids(seq_id, i)) for i in range(len(self.rows)))

    def blocks_held(self, seq_id: int) -> list[int]:
        """Blocks each group holds for the sequence."""
        return self.state.blocks_held(seq_id)

    def first_block(self, seq_id: int, group: int) -> int:
        """The sequence's first held block of a group (blocks before it were skipped)."""
        s = self.state.shape_of[group]
        return int(self.state.lo[s, seq_id]) if s >= 0 else 0

    # ------------------------------------------------------------- the split

    @property
    def labels(self) -> list[str]:
        """Group labels, then the pool's."""
        return [r.label for r in self.rows] + [POOL]

    def split(self, seqs: np.ndarray, computed: np.ndarray) -> np.ndarray:
        """Bytes per group (and the pool, last) per category, for the live sequences
        ``seqs`` that have ``computed`` tokens stored now: :meth:`split_basis` of
        :meth:`_basis`'s sums."""
        return self._split_of(self._basis(computed, int(computed.sum()), check=False)[0])

    def _split_of(self, sums: list[int] | np.ndarray) -> np.ndarray:
        """The split ``[..., groups + 1, categories]`` of sums (``[..., sums]``)."""
        sums = np.asarray(sums, dtype=np.int64)
        return (sums @ self.split_basis()).reshape(sums.shape[:-1] + (len(self.rows) + 1, len(CATEGORIES)))

    def split_basis(self) -> np.ndarray:
        """The split as a linear map of a few sums (:meth:`_basis`): ``[sums, (groups + 1)
        · categories]``, so that ``split.ravel() == sums @ split_basis()``. The sums are Σ
        computed, the pool's fixed padding, per split group (a shape's groups of one
        window) the shape's blocks held, kept floor and tails and the group's window
        starts, per state group its states, then the free bytes of every group and the
        pool: a recorder integrates these over time, not the split."""
        if self._basis_matrix is not None:
            return self._basis_matrix
        R, C = len(self.rows) + 1, len(CATEGORIES)
        G = len(self._split_groups)
        out = np.zeros((2 + 4 * G + len(self._state_rows) + R, R, C), dtype=np.int64)
        out[1, R - 1, PADDING] = 1
        for g, (s, members, rule) in enumerate(self._split_groups):
            b = self.state.shapes[s].block_tokens
            held, floor, tail, start = 2 + 4 * g + np.arange(4)
            for i in members:
                tb, ppb = self.rows[i].token_bytes, self.rows[i].padding_per_block
                out[0, i, TOKEN] += tb
                out[start if rule.frees else floor, i, TOKEN] -= tb
                out[held, i, RESERVATION] += b * tb
                out[0, i, RESERVATION] -= tb
                out[floor, i, RESERVATION] += tb
                out[tail, i, RESERVATION] -= tb
                out[tail, i, INTERNAL] += tb
                out[held, i, PADDING] += ppb
                if rule.frees:
                    out[start, i, OUT_OF_WINDOW] += tb
                    out[floor, i, OUT_OF_WINDOW] -= tb
        for j, i in enumerate(self._state_rows):
            out[2 + 4 * G + j, i, TOKEN] = self.rows[i].state_bytes
            out[2 + 4 * G + j, i, PADDING] = self.rows[i].padding_per_block
        for i in range(R):
            out[2 + 4 * G + len(self._state_rows) + i, i, FREE] = 1
        self._basis_matrix = out.reshape(len(out), R * C)
        return self._basis_matrix

    def _basis(self, computed: np.ndarray | None, stored: int,
               check: bool = True) -> tuple[list[int], int, int, int]:
        """The sums :meth:`split_basis` maps to the split, now, and the split's token
        states, free and everything else held, all bytes (``stored``: Σ ``computed``;
        ``computed`` is read only by windowed groups). With ``check``, raises if a part of
        the split would be negative or the parts would not add up to the pool."""
        st = self.state
        free = self._free_bytes()
        fixed = self._fixed_padding()
        nseq = len(self._live)
        sums = [stored, fixed]
        token = held_bytes = 0
        elsewhere = fixed
        negative = None
        for s, rule, b, tb, ppb, bb in self._basis_info:
            held, floor, tail = st.held[s], st.floor[s], st.tail[s]
            start = 0
            if rule.frees and nseq:
                assert computed is not None
                start = int(rule.skipped(computed).sum())
            sums += (held, floor, tail, start)
            read = stored - start if rule.frees else stored - floor
            oow = start - floor if rule.frees else 0
            if read < 0 or oow < 0 or held * b - (stored - floor) - tail < 0 or tail < 0:
                negative = st.shapes[s]
            token += read * tb
            elsewhere += (tail + oow) * tb + held * ppb
            held_bytes += held * bb
        for i in self._state_rows:
            sums.append(nseq)
            token += nseq * self.rows[i].state_bytes
            elsewhere += nseq * self.rows[i].padding_per_block
            held_bytes += nseq * self.rows[i].block_bytes
        sums += free
        total = sum(free)
        if not check:
            return sums, token, total, elsewhere
        if negative is not None:
            raise AssertionError(f"broken byte split: a part of {negative} is negative\n{self._split_of(sums)}")
        if held_bytes + total + fixed != self.capacity or min(free) < 0:
            raise AssertionError(f"broken byte split: sums to {held_bytes + total + fixed:,} of {self.capacity:,}\n"
                                 f"{self._split_of(sums)}")
        return sums, token, total, elsewhere

    def split_slow(self, seqs: np.ndarray, computed: np.ndarray) -> np.ndarray:
        """:meth:`split` from each sequence's own blocks, position by position (``check=True``)."""
        out = np.zeros((len(self.rows) + 1, len(CATEGORIES)), dtype=np.int64)
        assert sorted(int(s) for s in seqs) == sorted(self._live), "live sequences differ"
        for seq, f in zip(seqs.tolist(), computed.tolist(), strict=True):
            final = self._final(seq)
            assert 0 <= f <= final, (seq, f, final)
            held = self.blocks_held(seq)
            for i, row in enumerate(self.rows):
                lo = self.first_block(seq, i)
                hi = lo + held[i]
                if self.tracks_ids:
                    assert len(self._block_ids(seq, i)) == hi - lo, (seq, row.label)
                out[i, PADDING] += (hi - lo) * row.padding_per_block
                if row.is_state:
                    out[i, TOKEN] += (hi - lo) * row.state_bytes
                    continue
                b, tb = row.block_tokens, row.token_bytes
                assert f <= hi * b, (seq, row.label, f, hi)
                start = row.rule.skipped(f)
                assert lo * b <= start or lo == 0, (seq, row.label, lo, start)
                positions = np.arange(lo * b, hi * b)
                out[i, OUT_OF_WINDOW] += int(((positions < start) & (positions < f)).sum()) * tb
                out[i, TOKEN] += int(((positions >= start) & (positions < f)).sum()) * tb
                out[i, RESERVATION] += int(((positions >= f) & (positions < final)).sum()) * tb
                out[i, INTERNAL] += int((positions >= max(final, f)).sum()) * tb
        out[:, FREE] = self._free_bytes()
        out[-1, PADDING] = self._fixed_padding()
        return out

    def check(self) -> None:
        """The kept sums against the per-sequence arrays, and the pool's own invariants."""
        self.state.check()
        self._check_pool()

    # --------------------------------------------------------- subclass hooks

    def _place(self, seq: int, frees: list[int], takes: list[int]) -> bool:
        raise NotImplementedError

    def _release(self, seq: int, held: list[int]) -> None:
        raise NotImplementedError

    def _free_bytes(self) -> list[int]:
        raise NotImplementedError

    def _fixed_padding(self) -> int:
        raise NotImplementedError

    def _can_take(self, takes: list[int]) -> bool:
        raise NotImplementedError

    def _fits_empty(self, takes: list[int]) -> bool:
        raise NotImplementedError

    def _block_ids(self, seq: int, row: int) -> list[int]:
        raise NotImplementedError

    def _check_pool(self) -> None:
        raise NotImplementedError

    def num_used_blocks(self) -> int:
        """Block ids (or small pages) held by sequences."""
        raise NotImplementedError

    @property
    def unit_kinds(self) -> list[str]:
        """What each group index of :meth:`unit_rows` holds."""
        return [r.kind for r in self.rows]

    def unit_rows(self) -> np.ndarray:
        """The pool's address space in its own units (blocks, slots, large pages), each
        marked with the group that holds it, −1 where free (for address maps)."""
        raise NotImplementedError


def one_pool_fits(takes: np.ndarray, frees: np.ndarray, free: int) -> int:
    """:meth:`HybridManager._stretch_fits` of one pool of ``free`` free units, any group's
    block one unit: the first step whose takes (``[steps, groups]``) exceed what is free
    before it (earlier steps' frees count, its own do not: each move then needs no more
    than is free when it comes)."""
    if len(takes) <= 64:  # a short stretch: the running sums in plain ints
        freed = taken = 0
        for j, (t, f) in enumerate(zip(takes.sum(axis=1).tolist(), frees.sum(axis=1).tolist(), strict=True)):
            taken += t
            if taken > free + freed:
                return j
            freed += f
        return len(takes)
    total = takes.sum(axis=1)
    freed_before = np.concatenate(([0], np.cumsum(frees.sum(axis=1))[:-1]))
    short = np.flatnonzero(np.cumsum(total) > free + freed_before)
    return int(short[0]) if len(short) else len(total)


def one_pool_admits(takes: np.ndarray, frees: np.ndarray, free: int, need: int) -> int:
    """:meth:`HybridManager._stretch_admits` of one pool of ``free`` free units: the first
    step after whose moves ``need`` units are free."""
    if len(takes) <= 64:
        for j, d in enumerate((frees.sum(axis=1) - takes.sum(axis=1)).tolist()):
            free += d
            if free >= need:
                return j
        return len(takes)
    fits = np.flatnonzero(free + np.cumsum(frees.sum(axis=1) - takes.sum(axis=1)) >= need)
    return int(fits[0]) if len(fits) else len(takes)


def kind_of_groups(rows: tuple[Group, ...]) -> list[str]:
    """The kind of each group, then the pool's (for the per-kind split)."""
    return [r.kind for r in rows] + [POOL]
