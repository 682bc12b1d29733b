"""fragsim: where the KV cache's memory goes, allocator by allocator."""

__version__ = "0.1.0"
