"""KV offload tiers below the GPU pool, as vLLM 0.33's OffloadingConnector keeps them.

This room owns what a tier holds and gives up: :mod:`~fragsim.offload.policies`
orders keys for eviction (LRU, ARC), :mod:`~fragsim.offload.tier` is one tier's
chunk slots with their read and write states, and :mod:`~fragsim.offload.replay`
replays a trace in request order against one tier for hit rate by capacity
(``fragsim trace hits``). It knows keys and chunk counts, not bytes, time or the
GPU pool; it imports nothing of the engine.
"""

from fragsim.offload.policies import POLICIES
from fragsim.offload.replay import HitRate, hit_rates
from fragsim.offload.tier import Lookup, RequestAccess, StoreResult, Tier

__all__ = ["POLICIES", "HitRate", "Lookup", "RequestAccess", "StoreResult", "Tier", "hit_rates"]
