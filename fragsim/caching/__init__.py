"""PyTorch's CUDA caching allocator, modelled byte for byte (seed 004 §3.2).

:mod:`.model` is the allocator (built on :mod:`.blocks`, with the expandable
segments in :mod:`.expandable` and its read-only views in :mod:`.report`),
:mod:`.workloads` runs the serving workloads that drive it (what a workload is:
:mod:`.scenarios`; the server that allocates: :mod:`.server`), :mod:`.snapshot` reads
``torch.cuda.memory_snapshot()`` files (real ones and the model's own) into the
same figures.
"""

from fragsim.caching.model import BlockInfo, CachingAllocatorModel, SegmentInfo

__all__ = ["BlockInfo", "CachingAllocatorModel", "SegmentInfo"]
