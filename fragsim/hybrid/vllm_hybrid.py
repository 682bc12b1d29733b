"""vLLM 0.33's hybrid KV cache manager: one pool of equal blocks for every group.

vLLM cuts the model's layers into KV cache groups (:mod:`fragsim.vllm_plan`: one
page size for all, phantom layers padding short groups, state pages padded and
attention blocks inflated until a page holds a whole state). A block id is one
page in each of the ``group size`` per-layer buffers, so every block costs
``bytes_per_block`` whichever group holds it; the pool is ``num_gpu_blocks`` of
them, block 0 being vLLM's null block. Each group keeps its own block table per
request, drawing from one free queue:

* full attention and MLA hold ``ceil(q / B)`` blocks;
* a sliding-window group frees the blocks wholly before the window as the
  sequence computes (vLLM's ``remove_skipped_blocks``), a chunked group those of
  finished chunks;
* a state group holds one block per request: its state, padded to the page.

The free queue is first in, first out; a request's freed blocks join its tail,
last block first, as vLLM's ``FreeKVCacheBlockQueue`` has them (only the counts are
vLLM's here: without caching vLLM puts freed blocks at the front). Freed blocks are
free at once; prefix caching is :class:`~fragsim.hybrid.vllm_prefix.VllmPrefixManager`.

One difference from vLLM, on purpose: when an extension cannot get its blocks,
this manager leaves the sequence as it was (the allocator contract), where vLLM
would already have dropped the skipped blocks; the engine then preempts as vLLM does.
"""

from __future__ import annotations

import numpy as np

from fragsim.hybrid.groups import groups_of_plan
from fragsim.hybrid.manager import HybridManager, one_pool_admits, one_pool_fits
from fragsim.vllm_plan import VllmPlan


class VllmHybridManager(HybridManager):
    """Groups' block tables over one FIFO queue of ``bytes_per_block`` blocks."""

    def __init__(self, plan: VllmPlan, *, max_seq_len: int, name: str = "vllm-hybrid",
                 track_ids: bool = True) -> None:
        if plan.num_gpu_blocks < 2:
            raise ValueError(f"the pool holds {plan.num_gpu_blocks} blocks of "
                             f"{plan.bytes_per_block:,} bytes; vLLM needs at least 2 (one is its null block)")
        super().__init__(name=name, placement="vllm-hybrid", rows=groups_of_plan(plan),
                         capacity=plan.kv_cache_memory_bytes, max_seq_len=max_seq_len)
        self.plan = plan
        self.bytes_per_block = plan.bytes_per_block
        self.num_blocks = plan.num_gpu_blocks
        self._queue = list(range(1, self.num_blocks))
        self._head = 0
        self._tables: dict[int, list[list[int]]] = {}
        #: False: only block counts are kept (a simulation that draws no address map and
        #: feeds no device needs no ids; the counts, and so every result, are the same)
        self.tracks_ids = track_ids
        self._free_count = self.num_blocks - 1

    def num_free_blocks(self) -> int:
        return len(self._queue) - self._head if self.tracks_ids else self._free_count

    def num_used_blocks(self) -> int:
        """Block ids held by requests (vLLM's ``num_blocks − 1 − free``)."""
        return self.num_blocks - 1 - self.num_free_blocks()

    def _place(self, seq: int, frees: list[int], takes: list[int]) -> bool:
        need = sum(takes)
        if need > self.num_free_blocks() + sum(frees):
            return False
        if not self.tracks_ids:
            self._free_count += sum(frees) - need
            return True
        tables = self._tables.setdefault(seq, [[] for _ in self.rows])
        queue = self._queue
        for table, n in zip(tables, frees, strict=True):
            if n:
                queue.extend(reversed(table[:n]))
                del table[:n]
        for table, n in zip(tables, takes, strict=True):
            if n:
                table.extend(queue[self._head:self._head + n])
                self._head += n
        if self._head > 1024 and self._head > len(queue) >> 1:
            del queue[: self._head]
            self._head = 0
        return True

    _needs_per_seq = False

    def _count_steps(self, frees: np.ndarray, takes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._count_one_pool(frees, takes, self.bytes_per_block, self.num_blocks - 1)

    def _fits_moves(self, takes: list[list[int]], frees: list[list[int]]) -> bool:
        return sum(map(sum, takes)) <= self.num_free_blocks()

    def _place_moves(self, seqs: list[int], frees: list[list[int]], takes: list[list[int]]) -> None:
        if self.tracks_ids:
            super()._place_moves(seqs, frees, takes)
            return
        self._free_count += sum(map(sum, frees)) - sum(map(sum, takes))
        if self._free_count < 0:
            raise AssertionError("a move ran out of blocks it was told were free")

    def _release(self, seq: int, held: list[int]) -> None:
        if not self.tracks_ids:
            self._free_count += sum(held)
            return
        for table in self._tables.pop(seq, []):
            self._queue.extend(reversed(table))

    def _free_bytes(self) -> list[int]:
        return [0] * len(self.rows) + [self.num_free_blocks() * self.bytes_per_block]

    def _fixed_padding(self) -> int:
        # vLLM's null block, and the memory too small for one more block
        return self.capacity - (self.num_blocks - 1) * self.bytes_per_block

    def _can_take(self, takes: list[int]) -> bool:
        return sum(takes) <= self.num_free_blocks()

    def _stretch_fits(self, takes: np.ndarray, frees: np.ndarray, per_seq: np.ndarray) -> int:
        return one_pool_fits(takes, frees, self.num_free_blocks())

    def _stretch_admits(self, takes: np.ndarray, frees: np.ndarray, head: list[int]) -> int:
        return one_pool_admits(takes, frees, self.num_free_blocks(), sum(head))

    def _fits_empty(self, takes: list[int]) -> bool:
        return sum(takes) <= self.num_blocks - 1

    def _block_ids(self, seq: int, row: int) -> list[int]:
        if not self.tracks_ids:
            raise ValueError("this vllm-hybrid manager keeps block counts only (track_ids=False)")
        tables = self._tables.get(seq)
        return list(tables[row]) if tables else []

    def unit_rows(self) -> np.ndarray:
        if not self.tracks_ids:
            raise ValueError("this vllm-hybrid manager keeps block counts only (track_ids=False)")
        out = np.full(self.num_blocks, -1, dtype=np.int64)
        for tables in self._tables.values():
            for i, table in enumerate(tables):
                out[table] = i
        return out

    def _check_pool(self) -> None:
        if not self.tracks_ids:
            assert self._free_count + sum(self.held_blocks) == self.num_blocks - 1, "blocks lost"
            return
        free = self._queue[self._head:]
        held = [b for tables in self._tables.values() for t in tables for b in t]
        assert len(set(free)) == len(free), "free queue holds a block twice"
        assert not set(free) & set(held) and len(set(held)) == len(held), "a block is held twice"
        assert set(free) | set(held) == set(range(1, self.num_blocks)), "blocks lost"
        assert set(self._tables) <= set(self._live)
        assert sum(self.held_blocks) == len(held)
