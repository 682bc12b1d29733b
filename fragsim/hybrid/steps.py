"""A stretch of decode steps over a hybrid manager's sequence state and pool.

Each sequence's blocks over the stretch follow from its rule, so the blocks every
step takes and frees are known up front (:func:`~fragsim.hybrid.walk.walk`); the
pool says how far they surely fit and places them in the order exact steps would;
the kept sums advance, and each step's split is the basis map of its sums
(:meth:`~fragsim.hybrid.basis.SplitBasis.step_sums`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fragsim.hybrid.basis import SplitBasis
from fragsim.hybrid.groups import CATEGORIES
from fragsim.hybrid.pools.base import Pool, Steps
from fragsim.hybrid.state import SeqState
from fragsim.hybrid.walk import walk


def stretch(st: SeqState, pool: Pool, basis: SplitBasis, seqs: np.ndarray, reqs: np.ndarray, filled0: np.ndarray,
            k: int, head: Callable[[], list[int]] | None, first_step_first: bool = False,
            owned: np.ndarray | None = None) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Up to ``k`` decode steps of the sequences ``seqs`` (all that hold memory), the
    sequence at ``filled0`` tokens computing token ``filled0 + j`` in step ``j``.

    Each sequence's blocks over the stretch follow from its rule, so the blocks every
    step takes and frees are known up front (:func:`~fragsim.hybrid.walk.walk`). The
    stretch stops before the first step whose takes might not all fit
    (``pool.stretch_fits``), when a request of ``head_tokens`` waits at the head of
    the queue before the first step whose frees might let it in
    (``pool.stretch_admits``), and, over shared blocks, before a window reaches one.
    The pool places the moves in the order exact steps would (step, then ``reqs``).

    ``head`` gives the blocks per group a fresh sequence of the waiting request takes
    (None: none waits); ``owned``: each sequence's room, when the caller keeps it.
    Returns the steps taken, the split of each ``[k, groups + 1, categories]``, the
    largest allocatable bytes and used blocks of each, and each sequence's last
    requested length (−1: no block moved).
    """
    R, n, S = len(pool.groups), len(seqs), len(st.shapes)
    if pool.shares_blocks:
        k = min(k, pool.shared_limit(st, seqs, filled0, k))  # type: ignore[attr-defined]
    if k <= 0:
        return _no_steps(R, n)
    # Each sequence's first move: the first step whose target passes its room
    # (``owned``: :meth:`HybridManager.owned_many` of ``seqs``, when the caller keeps it).
    if owned is None:
        owned = st.rooms(seqs)
    j0 = np.maximum(owned - filled0, 0)   # a prompt just computed may be past its window
    movers = np.flatnonzero(j0 < k)
    # Under memory pressure a stretch often cannot take its first step, and stretches
    # stall in runs: ``first_step_first`` (the caller's last stretch stalled) tries the
    # first step alone first (the limits read no later step to stop there).
    for kk in ((1, k) if first_step_first and k > 1 and (j0[movers] == 0).any() else (k,)):
        w = walk(st, movers, seqs, filled0, j0, kk)
        step_takes, step_frees = _per_group(st, w.takes, kk), _per_group(st, w.frees, kk)
        if w.moves and pool.needs_per_seq:
            per_seq = np.zeros((R, kk, n), dtype=np.int64)
            for j, col, _, _, _, _, tks in w.moves:
                per_seq[:, j, col] = st.per_group(tks)
        else:
            per_seq = np.zeros((R, kk, 0), dtype=np.int64)   # no sequence takes, or not read
        limit = pool.stretch_fits(step_takes, step_frees, per_seq)
        if head is not None and w.moves and step_frees.any():
            limit = min(limit, pool.stretch_admits(step_takes, step_frees, head()))
        if limit == 0:
            break
    k = min(k, limit)
    if k <= 0:
        return _no_steps(R, n)
    moves = [mv for mv in w.moves if mv[0] < k] if k < kk else w.moves
    free_rows, largest, used = pool.place_steps(Steps(k, step_takes[:k], step_frees[:k], moves, seqs, reqs,
                                                      st.shape_of))
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
    splits = basis.split_of(basis.step_sums(filled0, k, tot, sums, pool.fixed_padding(), free_rows))
    if pool.shares_blocks:
        pool.correct_steps(splits)  # type: ignore[attr-defined]
    return k, splits, largest, used, last_target


def _per_group(st: SeqState, per_shape: list[list[int]], k: int) -> np.ndarray:
    """A walk's per-step, per-shape counts as ``[k, groups]`` (state groups: 0)."""
    out = np.array(per_shape, dtype=np.int64).reshape(k, len(st.shapes))
    if st.shape_of != list(range(len(st.shape_of))):
        out = out[:, [max(s, 0) for s in st.shape_of]]
    if st.state_groups:
        out[:, st.state_groups] = 0
    return out


def _no_steps(R: int, n: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    return (0, np.zeros((0, R + 1, len(CATEGORIES)), dtype=np.int64), np.zeros(0, dtype=np.int64),
            np.zeros(0, dtype=np.int64), np.full(n, -1))
