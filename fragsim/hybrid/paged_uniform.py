"""Every layer allocates for every token: how engines ran hybrid models before
hybrid KV cache support, and the baseline the hybrid managers are measured against.

One paged pool of ``block_size``-token blocks, each holding every attention
layer's K and V for its tokens: a sliding-window or chunked layer keeps the whole
sequence although it reads only its window, so the positions before the window
show as ``out_of_window``. State layers (Mamba, linear attention) get what vLLM's
engine gave them before its hybrid manager: a state array for ``max_num_seqs``
sequences carved out of the memory up front, each running sequence taking one
slot; an unused slot is free memory that only a state can use.

Without an address map (``track_ids=False``) the pool keeps the free block and
slot counts only: the same results, faster.
"""

from __future__ import annotations

import numpy as np

from fragsim.hybrid.groups import Group
from fragsim.hybrid.manager import HybridManager


class PagedUniformManager(HybridManager):
    """Uniform blocks for all attention layers; a static state slot per sequence."""

    def __init__(self, rows: tuple[Group, ...], capacity: int, *, max_seq_len: int,
                 max_num_seqs: int, name: str = "paged-uniform", track_ids: bool = True) -> None:
        attention = [r for r in rows if not r.is_state]
        if len({r.block_tokens for r in attention}) > 1:
            raise ValueError("paged-uniform needs one block size for every attention row")
        if any(r.frees_window for r in attention if r.rule.frees):
            raise ValueError("paged-uniform rows keep their out-of-window blocks (frees_window=False)")
        super().__init__(name=name, placement="paged-uniform", rows=rows, capacity=capacity,
                         max_seq_len=max_seq_len)
        self._attention = [i for i, r in enumerate(rows) if not r.is_state]
        self._states = [i for i, r in enumerate(rows) if r.is_state]
        self.state_slot_bytes = sum(rows[i].block_bytes for i in self._states)
        self.num_state_slots = max_num_seqs if self._states else 0
        rest = capacity - self.num_state_slots * self.state_slot_bytes
        self.uniform_block_bytes = sum(rows[i].block_bytes for i in self._attention)
        self.num_blocks = rest // self.uniform_block_bytes if self.uniform_block_bytes else 0
        if rest < 0 or (self._attention and self.num_blocks < 1):
            raise ValueError(f"{capacity:,} bytes hold neither {self.num_state_slots} state slots of "
                             f"{self.state_slot_bytes:,} bytes and one {self.uniform_block_bytes:,}-byte block")
        self._queue = list(range(self.num_blocks))
        self._head = 0
        self._state_free = list(range(self.num_state_slots))
        self._blocks: dict[int, list[int]] = {}
        self._slot: dict[int, int] = {}
        #: False: only the free blocks and state slots are counted
        self.tracks_ids = track_ids
        self._free_count = self.num_blocks
        self._free_slots = self.num_state_slots

    def _count_steps(self, frees: np.ndarray, takes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Counts: a step takes its attention rows' blocks once (one uniform block holds
        every attention layer), and decode steps take no state slot."""
        k = len(takes)
        free = self._free_count - np.cumsum(takes[:, 0]) if self._attention else np.full(k, self._free_count)
        if k and int(free.min()) < 0:
            raise AssertionError("a block move failed inside a stretch that had room for it")
        if k:
            self._free_count = int(free[-1])
        free_rows = np.zeros((k, len(self.rows) + 1), dtype=np.int64)
        for i in self._states:
            free_rows[:, i] = self._free_slots * self.rows[i].block_bytes
        free_rows[:, -1] = free * self.uniform_block_bytes
        return free_rows, free_rows[:, -1].copy(), self.num_blocks - free

    def num_free_blocks(self) -> int:
        return len(self._queue) - self._head if self.tracks_ids else self._free_count

    def num_free_slots(self) -> int:
        return len(self._state_free) if self.tracks_ids else self._free_slots

    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks()

    def _takes(self, takes: list[int]) -> tuple[int, int]:
        blocks = states = 0
        for i in self._attention:
            if takes[i] > blocks:
                blocks = takes[i]
        for i in self._states:
            if takes[i] > states:
                states = takes[i]
        return blocks, states

    def _place(self, seq: int, frees: list[int], takes: list[int]) -> bool:
        assert not any(frees), "paged-uniform frees no block before the sequence ends"
        blocks, states = self._takes(takes)
        if not self.tracks_ids:
            if blocks > self._free_count or states > self._free_slots:
                return False
            self._free_count -= blocks
            self._free_slots -= states
            return True
        queue, head = self._queue, self._head
        if blocks > len(queue) - head or states > len(self._state_free):
            return False
        if blocks:
            self._take_blocks(seq, blocks)
        if states:
            self._slot[seq] = self._state_free.pop(0)
        return True

    def _fits_moves(self, takes: list[list[int]], frees: list[list[int]]) -> bool:
        """:meth:`_stretch_fits` of one step, in plain ints (a decode step takes no state)."""
        return not self._attention or sum(takes[self._attention[0]]) <= self.num_free_blocks()

    def _place_moves(self, seqs: list[int], frees: list[list[int]], takes: list[list[int]]) -> None:
        """:meth:`_place` of each moving sequence in turn, known to fit."""
        att = self._attention
        if not att:
            super()._place_moves(seqs, frees, takes)
            return
        per_seq = takes[att[0]]   # one block size, nothing freed: every attention row takes alike
        if not self.tracks_ids:
            states = sum(max(c) for c in zip(*(takes[i] for i in self._states), strict=True)) if self._states else 0
            self._free_count -= sum(per_seq)
            self._free_slots -= states
            if self._free_count < 0 or self._free_slots < 0:
                raise AssertionError("a move ran out of blocks it was told were free")
            return
        if self._states:
            states = [max(c) for c in zip(*(takes[i] for i in self._states), strict=True)]
            for seq, n in zip(seqs, states, strict=True):
                if n:
                    self._slot[seq] = self._state_free.pop(0)
        if sum(per_seq) > self.num_free_blocks():
            raise AssertionError("a move ran out of blocks it was told were free")
        for seq, n in zip(seqs, per_seq, strict=True):
            if n:
                self._take_blocks(seq, n)

    def _take_blocks(self, seq: int, n: int) -> None:
        """The next ``n`` free blocks of the queue for ``seq`` (known to be there)."""
        queue, head = self._queue, self._head
        mine = self._blocks.get(seq)
        if mine is None:
            mine = self._blocks[seq] = []
        if n == 1:
            mine.append(queue[head])
        else:
            mine += queue[head:head + n]
        head += n
        if head > 1024 and head > len(queue) >> 1:
            del queue[:head]
            head = 0
        self._head = head

    def _release(self, seq: int, held: list[int]) -> None:
        if not self.tracks_ids:
            if self._attention:
                self._free_count += held[self._attention[0]]
            if self._states:
                self._free_slots += held[self._states[0]]
            return
        self._queue.extend(self._blocks.pop(seq, []))
        if seq in self._slot:
            self._state_free.append(self._slot.pop(seq))

    def _free_bytes(self) -> list[int]:
        out = [0] * (len(self.rows) + 1)
        for i in self._states:
            out[i] = self.num_free_slots() * self.rows[i].block_bytes
        out[-1] = self.num_free_blocks() * self.uniform_block_bytes
        return out

    def _fixed_padding(self) -> int:
        return (self.capacity - self.num_state_slots * self.state_slot_bytes
                - self.num_blocks * self.uniform_block_bytes)

    def _can_take(self, takes: list[int]) -> bool:
        blocks, states = self._takes(takes)
        return blocks <= self.num_free_blocks() and states <= self.num_free_slots()

    _needs_per_seq = False

    def _stretch_fits(self, takes: np.ndarray, frees: np.ndarray, per_seq: np.ndarray) -> int:
        if not self._attention:
            return len(takes)
        short = np.flatnonzero(np.cumsum(takes[:, self._attention[0]]) > self.num_free_blocks())
        return int(short[0]) if len(short) else len(takes)

    def _fits_empty(self, takes: list[int]) -> bool:
        blocks, states = self._takes(takes)
        return blocks <= self.num_blocks and states <= self.num_state_slots

    largest_is_free = False

    def largest_allocatable(self) -> int:
        """Free blocks: the free state slots hold nothing else."""
        return self.num_free_blocks() * self.uniform_block_bytes

    def _block_ids(self, seq: int, row: int) -> list[int]:
        if not self.tracks_ids:
            raise ValueError("this paged-uniform manager keeps block counts only (track_ids=False)")
        if self.rows[row].is_state:
            return [self._slot[seq]] if seq in self._slot else []
        return list(self._blocks.get(seq, []))

    @property
    def unit_kinds(self) -> list[str]:
        return [r.kind for r in self.rows] + ["every attention layer"]

    def unit_rows(self) -> np.ndarray:
        """The uniform blocks (every attention layer: the index after the rows), then
        the state slots."""
        if not self.tracks_ids:
            raise ValueError("this paged-uniform manager keeps block counts only (track_ids=False)")
        blocks = np.full(self.num_blocks, -1, dtype=np.int64)
        for ids in self._blocks.values():
            blocks[ids] = len(self.rows)
        slots = np.full(self.num_state_slots, -1, dtype=np.int64)
        if self._states:
            slots[list(self._slot.values())] = self._states[0]
        return np.concatenate((blocks, slots))

    def _check_pool(self) -> None:
        if not self.tracks_ids:
            held = [self.held_blocks[i] for i in self._attention]
            assert self._free_count + (held[0] if held else 0) == self.num_blocks, "uniform blocks lost"
            slots = [self.held_blocks[i] for i in self._states]
            assert self._free_slots + (slots[0] if slots else 0) == self.num_state_slots, "state slots lost"
            return
        free = self._queue[self._head:]
        held = [b for t in self._blocks.values() for b in t]
        assert sorted(free + held) == list(range(self.num_blocks)), "uniform blocks lost or doubled"
        slots = list(self._slot.values())
        assert sorted(slots + self._state_free) == list(range(self.num_state_slots)), "state slots"
