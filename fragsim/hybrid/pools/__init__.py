"""The hybrid KV managers' pools: where a group's blocks are (:mod:`.base` says what a
pool answers; one module per pool)."""

from fragsim.hybrid.pools.base import IdPool, Pool, Steps
from fragsim.hybrid.pools.caching import CachingBlockPool
from fragsim.hybrid.pools.jenga import JengaPool
from fragsim.hybrid.pools.ledger import Bin, Ledger
from fragsim.hybrid.pools.partition import PartitionPool
from fragsim.hybrid.pools.queue import BlockQueue
from fragsim.hybrid.pools.uniform import UniformPool

__all__ = ["Bin", "BlockQueue", "CachingBlockPool", "IdPool", "JengaPool", "Ledger", "PartitionPool", "Pool",
           "Steps", "UniformPool"]
