"""fragsim's allocators on real device memory, with Triton attention reading the KV cache.

``pool``: the KV pool of real tensors and its device-side bookkeeping.
``backend``: an engine observer that executes every allocation decision on the pool.
``kernels`` / ``reference``: decode attention (contiguous and paged) and its PyTorch reference.
``validate``: replay a trace slice and compare the device with the simulation.

Without CUDA everything runs on CPU tensors; set ``TRITON_INTERPRET=1`` before the
kernels are imported (``fragsim validate --device cpu`` does it for you).
"""

#: max-length requests the default pool of a validation holds: enough to batch, few
#: enough that requests wait and are preempted. The pool is sized for the miniature
#: that runs, never for the full model on a GPU (a model too large for any GPU still
#: validates); --kv-slots or --pool-bytes set it instead.
POOL_REQUESTS = 8
