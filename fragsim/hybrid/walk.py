"""The block moves of a stretch of decode steps, from each sequence's closed form.

In step ``j`` of a stretch the sequence that had stored ``f0`` tokens computes token
``f0 + j`` and asks for ``t = f0 + j + 1``; its blocks are each shape's rule of that
length (:mod:`fragsim.hybrid.state`), so the steps at which it moves are known up
front: its first move is where its room runs out, each later one where the room of
its new blocks does. A *move* is (step, sequence, target, blocks after per shape,
frees, takes). Per step and shape the walk also sums the blocks taken and freed and
the changes of the kept sums (held, floor in blocks, tail).

A stretch moves a few sequences a few times: the walk is a plain loop over moves; a
long stretch of many moving sequences takes the array form (:func:`_events`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fragsim.hybrid.state import SeqState, tail_of, tails

#: a stretch over more than this many (moving sequences × steps) finds its moves in numpy
#: (a long stretch of many sequences: the loop's cost grows with the moves, numpy's less)
EVENTS_NP = 2048


class Walk(NamedTuple):
    """The moves of ``k`` steps, and per step and shape the blocks taken and freed and
    the changes of the kept sums ``[3][k][shapes]``."""

    k: int
    moves: list[tuple[int, int, int, list[int], list[int], list[int], list[int]]]
    takes: list[list[int]]
    frees: list[list[int]]
    sums: list[list[list[int]]]


def walk(state: SeqState, cols: np.ndarray, seqs: np.ndarray, filled0: np.ndarray, j0: np.ndarray,
         k: int) -> Walk:
    """Moves over ``k`` steps of the sequences ``seqs[cols]`` (``cols``: their columns in
    the stretch, ``j0``: the step of each one's first move)."""
    S = len(state.shapes)
    los, his = state.lo[:, seqs[cols]], state.hi[:, seqs[cols]]   # [S, movers]
    finals = state.finals[seqs[cols]]
    if len(cols) * k > EVENTS_NP:
        return _events(state, k, cols, filled0[cols], j0[cols], los, his, finals)
    moves: list[tuple[int, int, int, list[int], list[int], list[int], list[int]]] = []
    takes = [[0] * S for _ in range(k)]
    frees = [[0] * S for _ in range(k)]
    sums = [[[0] * S for _ in range(k)] for _ in range(3)]
    cap = state.max_seq_len + 1
    params = state._params
    for col, f0, j, final, lo, hi in zip(cols.tolist(), filled0[cols].tolist(), j0[cols].tolist(),
                                         finals.tolist(), los.T.tolist(), his.T.tolist(), strict=True):
        while j < k:
            t = f0 + j + 1
            limit = cap
            lo1s, hi1s, frs, tks = [], [], [], []
            for s, (b, rule, frees_any) in enumerate(params):
                lo0, hi0 = lo[s], hi[s]
                hi1 = (t + b - 1) // b
                if hi1 < hi0:
                    hi1 = hi0
                end = hi1 * b
                if end < limit:
                    limit = end
                lo1 = lo0
                if frees_any:
                    x = rule.skipped_blocks(t - 1, b)
                    if x > lo0:
                        lo1 = x
                    x = rule.next_skip(lo1, b)
                    if x < limit:
                        limit = x
                x = (lo1 if lo1 < hi0 else hi0) - lo0
                fr = x if x > 0 else 0
                x = hi1 - (hi0 if hi0 > lo1 else lo1)
                tk = x if x > 0 else 0
                if fr or tk:
                    frees[j][s] += fr
                    takes[j][s] += tk
                sums[0][j][s] += (hi1 - lo1) - (hi0 - lo0)
                sums[1][j][s] += lo1 - lo0
                if end > final:
                    sums[2][j][s] += tail_of(hi1, lo1, b, final) - tail_of(hi0, lo0, b, final)
                lo1s.append(lo1)
                hi1s.append(hi1)
                frs.append(fr)
                tks.append(tk)
            moves.append((j, col, t, lo1s, hi1s, frs, tks))
            lo, hi = lo1s, hi1s
            if limit - f0 <= j:
                raise AssertionError("a sequence's blocks did not move where its length said")
            j = limit - f0
    return Walk(k, moves, takes, frees, sums)


def _events(state: SeqState, k: int, cols: np.ndarray, f0: np.ndarray, j0: np.ndarray, lo0: np.ndarray,
            hi0: np.ndarray, finals: np.ndarray) -> Walk:
    """:func:`walk` from each shape's closed form over ``[steps, sequences]``."""
    S = len(state.shapes)
    steps = np.arange(k, dtype=np.int64)[:, None]
    t = f0[None, :] + steps + 1                                     # [k, m] targets
    live = steps >= j0[None, :]                                     # before its first move: none
    los, his, frs, tks = [], [], [], []
    sums = np.zeros((3, k, S), dtype=np.int64)
    for s, shape in enumerate(state.shapes):
        b, rule = shape.block_tokens, shape.rule
        l0, h0 = lo0[s][None, :], hi0[s][None, :]
        hi = np.where(live, np.maximum(h0, (t + (b - 1)) // b), h0)
        if shape.frees:
            lo = np.where(live, np.maximum(l0, rule.skipped_blocks(t - 1, b)), l0)
        else:
            lo = np.broadcast_to(l0, hi.shape)
        lo_prev = np.concatenate((l0, lo[:-1]))
        hi_prev = np.concatenate((h0, hi[:-1]))
        fr = np.maximum(np.minimum(lo, hi_prev) - lo_prev, 0)
        tk = np.maximum(hi - np.maximum(hi_prev, lo), 0)
        sums[0, :, s] = ((hi - lo) - (hi_prev - lo_prev)).sum(axis=1)
        sums[1, :, s] = (lo - lo_prev).sum(axis=1)
        near = (hi * b > finals[None, :]) & ((hi != hi_prev) | (lo != lo_prev))
        if near.any():
            fin = np.broadcast_to(finals[None, :], hi.shape)
            sums[2, :, s] = np.where(near, tails(hi, lo, b, fin) - tails(hi_prev, lo_prev, b, fin), 0).sum(axis=1)
        los.append(lo)
        his.append(hi)
        frs.append(fr)
        tks.append(tk)
    lo_a, hi_a, fr_a, tk_a = np.stack(los), np.stack(his), np.stack(frs), np.stack(tks)   # [S, k, m]
    jj, cc = np.nonzero((fr_a > 0).any(axis=0) | (tk_a > 0).any(axis=0))
    moves = list(zip(jj.tolist(), cols[cc].tolist(), t[jj, cc].tolist(), lo_a[:, jj, cc].T.tolist(),
                     hi_a[:, jj, cc].T.tolist(), fr_a[:, jj, cc].T.tolist(), tk_a[:, jj, cc].T.tolist(),
                     strict=True))
    return Walk(k, moves, tk_a.sum(axis=2).T.tolist(), fr_a.sum(axis=2).T.tolist(), sums.tolist())
