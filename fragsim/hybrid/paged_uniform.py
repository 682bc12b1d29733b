"""Every layer allocates for every token: how engines ran hybrid models before
hybrid KV cache support, and the baseline the hybrid managers are measured against.

One paged pool of ``block_size``-token blocks, each holding every attention
layer's K and V for its tokens: a sliding-window or chunked layer keeps the whole
sequence although it reads only its window, so the positions before the window
show as ``out_of_window``. State layers (Mamba, linear attention) get what vLLM's
engine gave them before its hybrid manager: a state array for ``max_num_seqs``
sequences carved out of the memory up front, each running sequence taking one
slot; an unused slot is free memory that only a state can use
(:class:`~fragsim.hybrid.pools.uniform.UniformPool`).

Without an address map (``track_ids=False``) the pool is a
:class:`~fragsim.hybrid.pools.ledger.Ledger` of two bins, uniform blocks and state
slots: the same results, faster.
"""

from __future__ import annotations

from fragsim.hybrid.groups import Group
from fragsim.hybrid.manager import HybridManager
from fragsim.hybrid.pools import Bin, Ledger, Pool, UniformPool


class PagedUniformManager(HybridManager):
    """Uniform blocks for all attention layers; a static state slot per sequence."""

    def __init__(self, rows: tuple[Group, ...], capacity: int, *, max_seq_len: int,
                 max_num_seqs: int, name: str = "paged-uniform", track_ids: bool = True) -> None:
        attention = tuple(i for i, r in enumerate(rows) if not r.is_state)
        states = tuple(i for i, r in enumerate(rows) if r.is_state)
        if len({rows[i].block_tokens for i in attention}) > 1:
            raise ValueError("paged-uniform needs one block size for every attention row")
        if any(rows[i].frees_window for i in attention if rows[i].rule.frees):
            raise ValueError("paged-uniform rows keep their out-of-window blocks (frees_window=False)")
        self.state_slot_bytes = sum(rows[i].block_bytes for i in states)
        self.num_state_slots = max_num_seqs if states else 0
        rest = capacity - self.num_state_slots * self.state_slot_bytes
        self.uniform_block_bytes = sum(rows[i].block_bytes for i in attention)
        self.num_blocks = rest // self.uniform_block_bytes if self.uniform_block_bytes else 0
        if rest < 0 or (attention and self.num_blocks < 1):
            raise ValueError(f"{capacity:,} bytes hold neither {self.num_state_slots} state slots of "
                             f"{self.state_slot_bytes:,} bytes and one {self.uniform_block_bytes:,}-byte block")
        pool: Pool
        if track_ids:
            pool = UniformPool(rows, capacity, num_blocks=self.num_blocks, block_bytes=self.uniform_block_bytes,
                               num_slots=self.num_state_slots)
        else:
            bins = [Bin(self.num_blocks, self.uniform_block_bytes, attention, once=True)] if attention else []
            if states:
                bins.append(Bin(self.num_state_slots, self.state_slot_bytes, states, once=True,
                                in_pool_row=False, counted=False))
            pool = Ledger(rows, capacity, bins)
        super().__init__(name=name, placement="paged-uniform", pool=pool, max_seq_len=max_seq_len)
