"""The KV side of the engine: what it asks of memory (:mod:`fragsim.kv.protocol`), and
the KV manager of the dense allocators (:mod:`fragsim.kv.dense`, block sharing in
:mod:`fragsim.kv.sharing`). The hybrid managers are :mod:`fragsim.hybrid`'s."""

from __future__ import annotations

from typing import Any

from fragsim.engine_config import EngineConfig
from fragsim.kv.dense import DenseKV
from fragsim.kv.protocol import Admitted, Hit, KVManager, PrefixCache, Rows, StretchMemory

__all__ = ["Admitted", "DenseKV", "Hit", "KVManager", "PrefixCache", "Rows", "StretchMemory",
           "as_kv_manager"]


def as_kv_manager(kv: Any, trace: Any, config: EngineConfig, keys: Any = None) -> KVManager:
    """``kv`` itself when it is a KV manager; an allocator gets :class:`DenseKV`, with
    the trace's prefix keys when the run caches prefixes (``keys``: given ones, which
    the instances of a cluster share so that a router can compare them)."""
    if hasattr(kv, "admit"):
        return kv  # type: ignore[no-any-return]
    if config.prefix_caching and keys is None:
        from fragsim.prefix import PrefixKeys

        keys = PrefixKeys(trace, int(getattr(kv, "block_size", 1) or 1))
    return DenseKV(kv, max_seq_len=config.max_seq_len,
                   prefix_keys=keys if config.prefix_caching else None)
