"""A cluster: many instances of one deployment behind a router.

:mod:`~fragsim.cluster.routers` holds the routing policies (round-robin,
least-loaded, prefix-aware), :mod:`~fragsim.cluster.cluster` builds the instances
(each today's engine with its own KV manager), runs them and the router as
processes of one SimPy environment, and adds up where the memory went.
"""

from fragsim.cluster.cluster import ClusterResult, Member, Settings, run_cluster, run_members
from fragsim.cluster.routers import ROUTERS

__all__ = ["ROUTERS", "ClusterResult", "Member", "Settings", "run_cluster", "run_members"]
