"""The byte split of a hybrid pool as a linear map of a few sums.

Per group, with ``F`` a sequence's final length, ``f`` its computed length and
``s(f)`` the first position the next token reads (the kind's ``skipped(f)``), the
held positions ``[lo·B, hi·B)`` split into::

    out_of_window           [lo·B, s(f))     stored, held, never read again
    token_states            [max(s, lo·B), f) stored and read again
    reservation             [f, min(hi·B, F)) held, filled later
    internal_fragmentation  [max(F, lo·B), hi·B) the block tail it never fills

(each in tokens × the group's bytes per token; a state group's whole state is token
states), and each block adds its ``padding``. Summed over the sequences, every part
is linear in: Σ computed, per shape the kept sums of
:class:`~fragsim.hybrid.state.SeqState` (blocks held, the ``lo·B`` floor, the tails),
per window the window starts Σ s(f), per state group its states, and the pool's free
bytes and fixed padding. Only the window starts are summed over the sequences per
step: as no sequence's ``lo·B`` passes its ``s(f)``, out of the window is
Σ s(f) − Σ lo·B. A recorder integrates the sums over time, not the split.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fragsim.hybrid.groups import (
    CATEGORIES,
    FREE,
    INTERNAL,
    OUT_OF_WINDOW,
    PADDING,
    RESERVATION,
    TOKEN,
    Group,
)
from fragsim.hybrid.state import SeqState


class SplitBasis:
    """The sums of a manager's groups and the map from them to its split."""

    def __init__(self, groups: tuple[Group, ...], state: SeqState) -> None:
        self.groups, self.state = groups, state
        self.state_groups = state.state_groups
        # Split groups: the groups of a shape that read from one window start (their
        # rule): (shape, its groups, rule).
        self.split_groups: list[tuple[int, list[int], Any]] = []
        for s, shape in enumerate(state.shapes):
            by_rule: dict[Any, list[int]] = {}
            for i in shape.groups:
                by_rule.setdefault(groups[i].rule, []).append(i)
            self.split_groups += [(s, members, rule) for rule, members in by_rule.items()]
        # Per split group: its shape, rule, block, and the sums over its groups of bytes
        # per token, padding per block and bytes per block.
        self._info = [(s, rule, state.shapes[s].block_tokens,
                       sum(groups[i].token_bytes for i in members),
                       sum(groups[i].padding_per_block for i in members),
                       sum(groups[i].block_bytes for i in members))
                      for s, members, rule in self.split_groups]
        #: whether the sums read every sequence's computed length (a group with a window)
        self.reads_windows = any(rule.frees for _, _, rule in self.split_groups)
        self.matrix = self._matrix()

    @property
    def num_sums(self) -> int:
        return 2 + 4 * len(self.split_groups) + len(self.state_groups) + len(self.groups) + 1

    def _matrix(self) -> np.ndarray:
        """``[sums, (groups + 1) · categories]``: ``split.ravel() == sums @ matrix``. The
        sums are Σ computed, the pool's fixed padding, per split group (a shape's groups
        of one window) the shape's blocks held, kept floor and tails and the group's
        window starts, per state group its states, then the free bytes of every group
        and the pool."""
        R, C = len(self.groups) + 1, len(CATEGORIES)
        G = len(self.split_groups)
        out = np.zeros((self.num_sums, R, C), dtype=np.int64)
        out[1, R - 1, PADDING] = 1
        for g, (s, members, rule) in enumerate(self.split_groups):
            b = self.state.shapes[s].block_tokens
            held, floor, tail, start = 2 + 4 * g + np.arange(4)
            for i in members:
                tb, ppb = self.groups[i].token_bytes, self.groups[i].padding_per_block
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
        for j, i in enumerate(self.state_groups):
            out[2 + 4 * G + j, i, TOKEN] = self.groups[i].state_bytes
            out[2 + 4 * G + j, i, PADDING] = self.groups[i].padding_per_block
        for i in range(R):
            out[2 + 4 * G + len(self.state_groups) + i, i, FREE] = 1
        return out.reshape(len(out), R * C)

    def token_bytes(self, seqs: np.ndarray, computed: np.ndarray) -> int:
        """Bytes of token states the live sequences ``seqs`` hold with ``computed``
        stored: per split group the positions read from ``max(s(f), lo·B)`` (a floor
        ``lo·B`` where no window frees), and each state group's whole state."""
        if not len(seqs):
            return 0
        lo_of = self.state.lo
        out = 0
        for s, rule, b, tb, _, _ in self._info:
            lo = lo_of[s, seqs] * b
            start = np.maximum(rule.skipped(computed), lo) if rule.frees else lo
            out += int(np.maximum(computed - start, 0).sum()) * tb
        return out + len(seqs) * sum(self.groups[i].state_bytes for i in self.state_groups)

    def split_of(self, sums: list[int] | np.ndarray) -> np.ndarray:
        """The split ``[..., groups + 1, categories]`` of sums (``[..., sums]``)."""
        sums = np.asarray(sums, dtype=np.int64)
        return (sums @ self.matrix).reshape(sums.shape[:-1] + (len(self.groups) + 1, len(CATEGORIES)))

    def sums(self, computed: np.ndarray | None, stored: int, free: list[int], fixed: int, capacity: int,
             check: bool = True, receiving: tuple[np.ndarray, np.ndarray] | None = None
             ) -> tuple[list[int], int, int, int]:
        """The sums now, and the split's token states, free and everything else held,
        all bytes (``stored``: Σ computed; ``computed`` is read only by windowed groups).
        With ``check``, raises if a part of the split would be negative or the parts
        would not add up to ``capacity``.

        ``receiving``: (sequences, their computed lengths) whose blocks were placed for
        KV still arriving (:meth:`HybridManager._allocate` with ``external``). Such a
        sequence may hold blocks from ``lo·B`` past its computed ``f``: it reads from
        ``max(s(f), min(lo·B, f))`` and its floor counts as ``min(lo·B, f)``, so what it
        holds past ``f`` is reservation (a state counts as token states throughout)."""
        st = self.state
        nseq = len(st.live)
        sums = [stored, fixed]
        token = held_bytes = 0
        elsewhere = fixed
        negative = None
        for s, rule, b, tb, ppb, bb in self._info:
            held, floor, tail = st.held[s], st.floor[s], st.tail[s]
            start = 0
            if rule.frees and nseq:
                assert computed is not None
                start = int(rule.skipped(computed).sum())
                if receiving is not None:
                    seqs, f = receiving
                    lo = st.lo[s, seqs] * b
                    low = np.minimum(lo, f)
                    floor += int((low - lo).sum())
                    skipped = rule.skipped(f)
                    start += int((np.maximum(skipped, low) - skipped).sum())
            sums += (held, floor, tail, start)
            read = stored - start if rule.frees else stored - floor
            oow = start - floor if rule.frees else 0
            if read < 0 or oow < 0 or held * b - (stored - floor) - tail < 0 or tail < 0:
                negative = st.shapes[s]
            token += read * tb
            elsewhere += (tail + oow) * tb + held * ppb
            held_bytes += held * bb
        for i in self.state_groups:
            sums.append(nseq)
            token += nseq * self.groups[i].state_bytes
            elsewhere += nseq * self.groups[i].padding_per_block
            held_bytes += nseq * self.groups[i].block_bytes
        sums += free
        total = sum(free)
        if not check:
            return sums, token, total, elsewhere
        if negative is not None:
            raise AssertionError(f"broken byte split: a part of {negative} is negative\n{self.split_of(sums)}")
        if held_bytes + total + fixed != capacity or min(free) < 0:
            raise AssertionError(f"broken byte split: sums to {held_bytes + total + fixed:,} of {capacity:,}\n"
                                 f"{self.split_of(sums)}")
        return sums, token, total, elsewhere

    def step_sums(self, filled0: np.ndarray, k: int, tot: list[list[int]], sums: np.ndarray,
                  fixed: int, free_rows: np.ndarray) -> np.ndarray:
        """The sums of each of a stretch's ``k`` steps (``[k, sums]``), the kept sums
        already advanced past them: their totals ``tot`` ``[3][shapes]`` (held, floor in
        blocks, tail) less the running changes ``sums`` ``[3, k, shapes]``; the window
        starts from each sequence's computed length ``filled0 + j``."""
        st = self.state
        G, n_states = len(self.split_groups), len(self.state_groups)
        out = np.empty((k, self.num_sums), dtype=np.int64)
        out[:, 0] = int(filled0.sum()) + len(filled0) * np.arange(k, dtype=np.int64)   # Σ computed
        out[:, 1] = fixed
        f: np.ndarray | None = None
        for g, (s, _, rule) in enumerate(self.split_groups):
            b = st.shapes[s].block_tokens
            col = 2 + 4 * g
            out[:, col] = st.held[s] - tot[0][s] + sums[0, :, s]
            out[:, col + 1] = st.floor[s] - tot[1][s] * b + sums[1, :, s] * b
            out[:, col + 2] = st.tail[s] - tot[2][s] + sums[2, :, s]
            if rule.frees:
                if f is None:
                    f = filled0[None, :] + np.arange(k, dtype=np.int64)[:, None]
                out[:, col + 3] = rule.skipped(f).sum(axis=1)
            else:
                out[:, col + 3] = 0
        out[:, 2 + 4 * G: 2 + 4 * G + n_states] = len(st.live)
        out[:, 2 + 4 * G + n_states:] = free_rows
        return out
