"""What every live sequence holds, per shape, as arrays over sequences.

Groups of one *shape* (the rule their blocks follow and their block size) hold the
same blocks of every sequence: vLLM's groups of one kind, paged-uniform's attention
layers. So the state is kept per shape, ``[shapes, sequences]``::

    requested[seq]   tokens asked for           computed: what the engine has stored
    lo[s, seq]       first block still held     rule.skipped_blocks(computed), never lower
    hi[s, seq]       blocks up to               cdiv(requested, B), never lower

and, per shape, the sums the byte split is linear in, kept as blocks move::

    held    Σ (hi − lo)                      blocks held
    floor   Σ lo · B                         positions below the first held block
    tail    Σ max(0, hi·B − max(final, lo·B))  positions held that will never be filled

A state group holds one block (its state) from admission on and never moves. A
sequence's *room* is the longest requested length that moves no block: the least
over shapes of ``hi · B`` and the computed length at which the next block falls out
of the window (:meth:`Kind.next_skip`); the engine meets the manager exactly there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from fragsim.hybrid.groups import Group
from fragsim.kinds import Kind


@dataclass(frozen=True)
class Shape:
    """Attention groups that hold the same blocks: their rule and block size."""

    rule: Kind
    block_tokens: int
    groups: tuple[int, ...]

    @property
    def frees(self) -> bool:
        return self.rule.frees


class Move(NamedTuple):
    """A sequence's blocks after a change, per attention shape, and the blocks each
    shape frees and takes on the way (``state``: blocks each state group takes)."""

    lo: list[int]
    hi: list[int]
    frees: list[int]
    takes: list[int]
    state: int = 0


def tail_of(hi: int, lo: int, block_tokens: int, final: int) -> int:
    """Positions of ``[lo·B, hi·B)`` at or past ``final``: held, never filled."""
    if hi <= lo:
        return 0
    end, start = hi * block_tokens, lo * block_tokens
    if start < final:
        start = final
    return end - start if end > start else 0


def tails(hi: np.ndarray, lo: np.ndarray, block_tokens: int, finals: np.ndarray) -> np.ndarray:
    """:func:`tail_of` over arrays."""
    return np.where(hi > lo, np.maximum(0, hi * block_tokens - np.maximum(finals, lo * block_tokens)), 0)


class SeqState:
    """Per shape, the blocks ``[lo, hi)`` of every live sequence, and the kept sums."""

    def __init__(self, groups: tuple[Group, ...], max_seq_len: int) -> None:
        self.groups = groups
        self.max_seq_len = max_seq_len
        keys: dict[tuple[Kind, int], list[int]] = {}
        for i, g in enumerate(groups):
            if not g.is_state:
                keys.setdefault((g.holds, g.block_tokens), []).append(i)
        self.shapes = tuple(Shape(rule, b, tuple(members)) for (rule, b), members in keys.items())
        #: each group's shape (−1: a state group)
        self.shape_of = [-1] * len(groups)
        for s, shape in enumerate(self.shapes):
            for i in shape.groups:
                self.shape_of[i] = s
        self.state_groups = [i for i, g in enumerate(groups) if g.is_state]
        S = len(self.shapes)
        self.q = np.zeros(0, dtype=np.int64)
        self.lo = np.zeros((S, 0), dtype=np.int64)
        self.hi = np.zeros((S, 0), dtype=np.int64)
        self.finals = np.zeros(0, dtype=np.int64)
        self.held = [0] * S
        self.floor = [0] * S
        self.tail = [0] * S
        self.live: dict[int, None] = {}
        # Each shape's parameters as plain ints, for the per-sequence paths.
        self._params = [(sh.block_tokens, sh.rule, sh.frees) for sh in self.shapes]
        self._fresh: tuple[int, Move] = (-1, Move([], [], [], []))

    # -------------------------------------------------------------- sequences

    def ensure(self, seq: int) -> None:
        if seq < len(self.q):
            return
        size = max(seq + 1, 2 * len(self.q), 64)
        old = len(self.q)
        for name in ("q", "finals"):
            grown = np.zeros(size, dtype=np.int64)
            grown[:old] = getattr(self, name)
            setattr(self, name, grown)
        self.finals[old:] = self.max_seq_len
        for name in ("lo", "hi"):
            grown = np.zeros((len(self.shapes), size), dtype=np.int64)
            grown[:, :old] = getattr(self, name)
            setattr(self, name, grown)

    def require(self, seq: int) -> None:
        if seq not in self.live:
            raise ValueError(f"unknown sequence {seq}")

    def target(self, q: int, computed: int, lo: list[int], hi: list[int], state: int = 0) -> Move:
        """The blocks for ``q`` tokens requested and ``computed`` computed, from ``[lo, hi)``."""
        new_lo, new_hi, frees, takes = [], [], [], []
        for (b, rule, frees_any), lo0, hi0 in zip(self._params, lo, hi, strict=True):
            hi1 = -(-q // b)
            if hi1 < hi0:
                hi1 = hi0
            lo1 = lo0
            if frees_any:
                at = rule.skipped_blocks(computed, b)
                if at > lo0:
                    lo1 = at
            m = lo1 if lo1 < hi0 else hi0
            frees.append(m - lo0 if m > lo0 else 0)
            m = hi0 if hi0 > lo1 else lo1
            takes.append(hi1 - m if hi1 > m else 0)
            new_lo.append(lo1)
            new_hi.append(hi1)
        return Move(new_lo, new_hi, frees, takes, state)

    def fresh(self, q: int) -> Move:
        """:meth:`target` of a fresh sequence of ``q`` tokens (cached: a blocked queue head
        asks again every step; not to be changed)."""
        if self._fresh[0] != q:
            zero = [0] * len(self.shapes)
            self._fresh = (q, self.target(q, 0, zero, zero, 1 if self.state_groups else 0))
        return self._fresh[1]

    def move_of(self, seq: int, q: int, computed: int) -> Move:
        """:meth:`target` of a live sequence."""
        return self.target(q, computed, self.lo[:, seq].tolist(), self.hi[:, seq].tolist())

    def per_group(self, per_shape: list[int], state: int = 0) -> list[int]:
        """A per-shape list spread over the groups (state groups get ``state``)."""
        return [per_shape[s] if s >= 0 else state for s in self.shape_of]

    def commit(self, seq: int, q: int, move: Move, fresh: bool = False) -> None:
        """The sequence holds ``move``'s blocks now, with ``q`` requested (``fresh``: it
        held none before)."""
        final = int(self.finals[seq])
        if fresh:
            lo = hi = [0] * len(self._params)
        else:
            lo, hi = self.lo[:, seq].tolist(), self.hi[:, seq].tolist()
        for s, (b, _, _) in enumerate(self._params):
            lo0, hi0, lo1, hi1 = lo[s], hi[s], move.lo[s], move.hi[s]
            self.held[s] += (hi1 - lo1) - (hi0 - lo0)
            self.floor[s] += (lo1 - lo0) * b
            self.tail[s] += tail_of(hi1, lo1, b, final) - tail_of(hi0, lo0, b, final)
        self.lo[:, seq] = move.lo
        self.hi[:, seq] = move.hi
        self.q[seq] = q

    def start(self, seq: int, final: int, q: int, move: Move) -> None:
        self.ensure(seq)
        self.live[seq] = None
        self.finals[seq] = final
        self.commit(seq, q, move, fresh=True)

    def end(self, seq: int) -> None:
        zero = [0] * len(self.shapes)
        self.commit(seq, 0, Move(zero, zero, zero, zero))
        del self.live[seq]

    # ------------------------------------------------------------------- rooms

    def room_of(self, lo: list[int], hi: list[int]) -> int:
        """The room of a sequence holding blocks ``[lo, hi)`` per shape."""
        limit = self.max_seq_len + 1
        for (b, rule, frees_any), lo0, hi0 in zip(self._params, lo, hi, strict=True):
            at = hi0 * b
            if at < limit:
                limit = at
            if frees_any:
                at = rule.next_skip(lo0, b)
                if at < limit:
                    limit = at
        return limit

    def room(self, seq: int) -> int:
        return self.room_of(self.lo[:, seq].tolist(), self.hi[:, seq].tolist())

    def rooms(self, seqs: np.ndarray) -> np.ndarray:
        """:meth:`room` of many sequences."""
        limit = np.full(len(seqs), self.max_seq_len + 1, dtype=np.int64)
        for s, (b, rule, frees_any) in enumerate(self._params):
            np.minimum(limit, self.hi[s, seqs] * b, out=limit)
            if frees_any:
                np.minimum(limit, rule.next_skip(self.lo[s, seqs], b), out=limit)
        return limit

    def blocks_held(self, seq: int) -> list[int]:
        """Blocks each group holds for the sequence."""
        self.require(seq)
        held = (self.hi[:, seq] - self.lo[:, seq]).tolist()
        return self.per_group(held, 1)

    # ------------------------------------------------------------ a batch grows

    def grow_moves(self, seqs: list[int], targets: list[int]) -> tuple[list[int], list[tuple]]:
        """Decoding sequences grown to ``targets`` (``targets − 1`` computed), one after
        another: each one's room after, and per shape (blocks before, after, frees, takes,
        the change of the tail).

        NOTE: a step moves a few dozen sequences at most: plain ints per sequence beat
        numpy's per-call cost here (numpy over them all was measured slower even at
        thirty sequences and two shapes)."""
        cap = self.max_seq_len + 1
        S = len(self.shapes)
        los = self.lo[:, seqs].tolist()
        his = self.hi[:, seqs].tolist()
        finals = self.finals[seqs].tolist()
        lo1s: list[list[int]] = [[] for _ in range(S)]
        hi1s: list[list[int]] = [[] for _ in range(S)]
        frs: list[list[int]] = [[] for _ in range(S)]
        tks: list[list[int]] = [[] for _ in range(S)]
        tail_d = [0] * S
        rooms: list[int] = []
        params = self._params
        for i, (t, final) in enumerate(zip(targets, finals, strict=True)):
            limit = cap
            for s in range(S):
                b, rule, frees_any = params[s]
                lo0, hi0 = los[s][i], his[s][i]
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
                    frs[s].append(x if x > 0 else 0)
                    x = hi1 - (hi0 if hi0 > lo1 else lo1)
                    tks[s].append(x if x > 0 else 0)
                    lo1s[s].append(lo1)
                else:
                    tks[s].append(hi1 - hi0)
                hi1s[s].append(hi1)
                if end > final:  # only a block past the final length has a tail
                    tail_d[s] += tail_of(hi1, lo1, b, final) - tail_of(hi0, lo0, b, final)
            rooms.append(limit)
        zero = [0] * len(seqs)
        return rooms, [(los[s], his[s], lo1s[s] if params[s][2] else los[s], hi1s[s],
                        frs[s] if params[s][2] else zero, tks[s], tail_d[s]) for s in range(S)]

    def commit_grown(self, seqs: np.ndarray, targets: list[int], per_shape: list[tuple]) -> None:
        """The sums and arrays after :meth:`grow_moves` took effect."""
        for s, (lo0, hi0, lo1, hi1, _, _, tail_d) in enumerate(per_shape):
            d_lo = sum(lo1) - sum(lo0) if self.shapes[s].frees else 0
            self.held[s] += sum(hi1) - sum(hi0) - d_lo
            self.floor[s] += d_lo * self.shapes[s].block_tokens
            self.tail[s] += tail_d
            if d_lo:
                self.lo[s, seqs] = lo1
            self.hi[s, seqs] = hi1
        self.q[seqs] = targets

    # -------------------------------------------------------------------- check

    def check(self) -> None:
        """The kept sums against the per-sequence arrays."""
        seqs = np.fromiter(self.live, dtype=np.int64, count=len(self.live))
        for s, shape in enumerate(self.shapes):
            lo, hi, b = self.lo[s, seqs], self.hi[s, seqs], shape.block_tokens
            assert self.held[s] == int((hi - lo).sum()), (shape, "held blocks")
            assert self.floor[s] == int(lo.sum()) * b, (shape, "floor")
            assert self.tail[s] == int(tails(hi, lo, b, self.finals[seqs]).sum()), (shape, "tail")
