"""A paged pool per layer kind, sized up front: the baseline of Jenga's paper.

Each row (layer kind) gets its own pool of its own blocks, ``block_size`` tokens
of its layers' KV (a state row: one state), and frees its window as vLLM's
hybrid manager does; only the split of the memory is fixed. The memory is cut in
proportion to what one ``max_seq_len`` request needs in each row at its peak, as
vLLM sizes a request's worst case, with ``T`` tokens computed in one step::

    share(row) ∝ blocks × block bytes, blocks = full: ceil(L / B)
                                                sliding: ceil(min(W − 1 + T, L) / B) + 1
                                                chunked: ceil(min(C + T, L) / B)
                                                state: 1

so a workload of long requests fills every pool together, and any other mix
leaves one pool short while another has room. A pool's free blocks count as that
row's free memory; no other row can use them
(:class:`~fragsim.hybrid.pools.partition.PartitionPool`). Without an address map
(``track_ids=False``) the pool is a :class:`~fragsim.hybrid.pools.ledger.Ledger`
of one bin per row: the same results, faster.
"""

from __future__ import annotations

from fragsim.hybrid.groups import Group
from fragsim.hybrid.manager import HybridManager
from fragsim.hybrid.pools import Bin, Ledger, PartitionPool, Pool
from fragsim.hybrid.pools.partition import proportional_largest
from fragsim.kinds import cdiv


def max_blocks(row: Group, max_seq_len: int, step_tokens: int) -> int:
    """Blocks of ``row`` one request of ``max_seq_len`` tokens holds at most, computing
    up to ``step_tokens`` tokens a step (its rule's :meth:`~fragsim.kinds.Kind.max_blocks`)."""
    if row.is_state:
        return 1
    return min(cdiv(max_seq_len, row.block_tokens), row.holds.max_blocks(max_seq_len, row.block_tokens, step_tokens))


class StaticPartitionManager(HybridManager):
    """One FIFO paged pool per row, in a fixed share of the memory."""

    def __init__(self, rows: tuple[Group, ...], capacity: int, *, max_seq_len: int,
                 step_tokens: int, name: str = "static-partition", track_ids: bool = True) -> None:
        weights = [max_blocks(r, max_seq_len, step_tokens) * r.block_bytes for r in rows]
        total = sum(weights)
        self.share_bytes = [capacity * w // total for w in weights]
        self.num_blocks = [s // r.block_bytes for s, r in zip(self.share_bytes, rows, strict=True)]
        if min(self.num_blocks) < 1:
            short = rows[self.num_blocks.index(min(self.num_blocks))]
            raise ValueError(f"the {short.label} pool's share of {capacity:,} bytes holds no "
                             f"{short.block_bytes:,}-byte block")
        pool: Pool
        if track_ids:
            pool = PartitionPool(rows, capacity, num_blocks=self.num_blocks)
        else:
            pool = Ledger(rows, capacity, [Bin(n, r.block_bytes, (i,), in_pool_row=False)
                                           for i, (n, r) in enumerate(zip(self.num_blocks, rows, strict=True))],
                          largest=proportional_largest(self.num_blocks, capacity))
        super().__init__(name=name, placement="static-partition", pool=pool, max_seq_len=max_seq_len)
