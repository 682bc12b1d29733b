"""vLLM 0.33's hybrid KV cache manager: one pool of equal blocks for every group.

vLLM cuts the model's layers into KV cache groups (:mod:`fragsim.vllm_plan`: one
page size for all, phantom layers padding short groups, state pages padded and
attention blocks inflated until a page holds a whole state). A block id is one
page in each of the ``group size`` per-layer buffers, so every block costs
``bytes_per_block`` whichever group holds it; the pool is ``num_gpu_blocks`` of
them, block 0 being vLLM's null block. Each group keeps its own block table per
request, drawing from one free queue (:class:`~fragsim.hybrid.pools.queue.BlockQueue`):

* full attention and MLA hold ``ceil(q / B)`` blocks;
* a sliding-window group frees the blocks wholly before the window as the
  sequence computes (vLLM's ``remove_skipped_blocks``), a chunked group those of
  finished chunks;
* a state group holds one block per request: its state, padded to the page.

The free queue is first in, first out; a request's freed blocks join its tail,
last block first (only the counts are vLLM's here: without caching vLLM puts freed
blocks at the front). With prefix caching the pool is vLLM's caching block pool
(:class:`~fragsim.hybrid.pools.caching.CachingBlockPool`) and hits are found across
kinds by :class:`~fragsim.hybrid.coordinator.Coordinator`. Without an address map
the pool is a :class:`~fragsim.hybrid.pools.ledger.Ledger` of one bin.

One difference from vLLM, on purpose: without caching, when an extension cannot
get its blocks, this manager leaves the sequence as it was (the allocator
contract), where vLLM would already have dropped the skipped blocks; the engine
then preempts as vLLM does. With caching it frees them first, as vLLM does.
"""

from __future__ import annotations

from fragsim.hybrid.groups import groups_of_plan
from fragsim.hybrid.manager import HybridManager
from fragsim.hybrid.pools import Bin, BlockQueue, CachingBlockPool, Ledger, Pool
from fragsim.vllm_plan import VllmPlan


class VllmHybridManager(HybridManager):
    """vLLM's groups over one pool of ``bytes_per_block`` blocks."""

    def __init__(self, plan: VllmPlan, *, max_seq_len: int, name: str = "vllm-hybrid",
                 track_ids: bool = True, prefix_caching: bool = False) -> None:
        """``track_ids=False``: block counts only (a simulation that draws no address map
        and feeds no device needs no ids; the counts, and so every result, are the same).
        ``prefix_caching``: vLLM's caching block pool (always keeps ids)."""
        if plan.num_gpu_blocks < 2:
            raise ValueError(f"the pool holds {plan.num_gpu_blocks} blocks of "
                             f"{plan.bytes_per_block:,} bytes; vLLM needs at least 2 (one is its null block)")
        groups = groups_of_plan(plan)
        capacity, n, bpb = plan.kv_cache_memory_bytes, plan.num_gpu_blocks, plan.bytes_per_block
        pool: Pool
        if prefix_caching:
            pool = CachingBlockPool(groups, capacity, num_blocks=n, block_bytes=bpb)
        elif track_ids:
            pool = BlockQueue(groups, capacity, num_blocks=n, block_bytes=bpb)
        else:
            pool = Ledger(groups, capacity, [Bin(n - 1, bpb, tuple(range(len(groups))))])
        super().__init__(name=name, placement="vllm-hybrid", pool=pool, max_seq_len=max_seq_len,
                         prefix_caching=prefix_caching)
        self.plan = plan
        self.bytes_per_block = bpb
        self.num_blocks = n

    def num_free_blocks(self) -> int:
        """Free blocks (vLLM's ``get_num_free_blocks``)."""
        return self.pool.num_free_blocks()  # type: ignore[attr-defined,no-any-return]


class VllmPrefixManager(VllmHybridManager):
    """:class:`VllmHybridManager` with prefix caching."""

    def __init__(self, plan: VllmPlan, *, max_seq_len: int, name: str = "vllm-hybrid") -> None:
        super().__init__(plan, max_seq_len=max_seq_len, name=name, prefix_caching=True)
