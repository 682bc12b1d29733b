"""KV managers for models whose layers differ: one pool, many layer kinds.

    >>> from fragsim.catalog import get_model, get_gpu
    >>> from fragsim.hybrid import create_manager
    >>> m = create_manager("vllm-hybrid", get_model("gpt-oss-20b"), get_gpu("h100-80gb"),
    ...                    pool_bytes=20 << 30, max_seq_len=8192)
    >>> [r.label for r in m.rows]
    ['sliding 128', 'full']

``paged-uniform`` allocates every layer for every token (engines before hybrid
support); ``vllm-hybrid`` is vLLM 0.33's hybrid KV cache manager; ``jenga`` is
Jenga's two-level allocator; ``static-partition`` gives each kind its own pool.
:mod:`fragsim.hybrid.groups` defines the groups, :mod:`fragsim.hybrid.manager` what each
sequence holds in them, :mod:`fragsim.hybrid.pools` where the blocks are and
:mod:`fragsim.hybrid.basis` the byte split.
"""

from __future__ import annotations

from fragsim.catalog import GPUConfig, ModelConfig
from fragsim.hybrid.groups import CATEGORIES, POOL, Group, kind_groups
from fragsim.hybrid.jenga import JengaManager
from fragsim.hybrid.manager import HybridManager
from fragsim.hybrid.paged_uniform import PagedUniformManager
from fragsim.hybrid.static_partition import StaticPartitionManager
from fragsim.hybrid.vllm_hybrid import VllmHybridManager, VllmPrefixManager

MANAGERS = ("paged-uniform", "vllm-hybrid", "jenga", "static-partition")

__all__ = ["CATEGORIES", "MANAGERS", "POOL", "Group", "HybridManager", "JengaManager", "PagedUniformManager",
           "StaticPartitionManager", "VllmHybridManager", "VllmPrefixManager", "create_manager",
           "kind_groups"]


def create_manager(name: str, model: ModelConfig, gpu: GPUConfig, *, pool_bytes: int,
                   max_seq_len: int, tp: int = 1, block_size: int | None = None,
                   max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                   hybrid_chunked: bool = True, track_ids: bool = True,
                   prefix_caching: bool = False) -> HybridManager:
    """The manager ``name`` over ``pool_bytes`` of KV memory on one ``tp`` rank.

    ``block_size`` is the attention block in tokens (None: 16, and vLLM's backend
    default for ``vllm-hybrid``, which vLLM may inflate for state layers).
    ``track_ids=False`` lets a manager keep block counts only (``jenga`` where every
    small page is a whole large page): faster, no placements or address maps, the same
    results. ``prefix_caching`` is modelled for
    ``vllm-hybrid`` only (:mod:`fragsim.hybrid.pools.caching`; it keeps ids).
    """
    if name not in MANAGERS:
        raise ValueError(f"unknown hybrid KV manager {name!r}; choose from {', '.join(MANAGERS)}")
    if prefix_caching and name != "vllm-hybrid":
        raise ValueError(f"prefix caching is modelled for vllm-hybrid only, not {name}")
    if name == "vllm-hybrid":
        from fragsim.vllm_plan import plan_vllm

        plan = plan_vllm(model, gpu, pool_bytes, tp=tp, max_model_len=max_seq_len,
                         prefix_caching=prefix_caching, max_num_batched_tokens=max_num_batched_tokens,
                         block_size=block_size, chunked_hybrid=hybrid_chunked)
        if prefix_caching:
            return VllmPrefixManager(plan, max_seq_len=max_seq_len)
        return VllmHybridManager(plan, max_seq_len=max_seq_len, track_ids=track_ids)
    bs = 16 if block_size is None else block_size
    if name == "paged-uniform":
        return PagedUniformManager(kind_groups(model, tp=tp, block_size=bs, frees_window=False),
                                   pool_bytes, max_seq_len=max_seq_len, max_num_seqs=max_num_seqs,
                                   track_ids=track_ids)
    rows = kind_groups(model, tp=tp, block_size=bs)
    if name == "jenga":
        return JengaManager(rows, pool_bytes, max_seq_len=max_seq_len, track_ids=track_ids)
    # Prompts are placed whole at admission, so a step computes up to a whole prompt.
    return StaticPartitionManager(rows, pool_bytes, max_seq_len=max_seq_len, step_tokens=max_seq_len,
                                  track_ids=track_ids)
