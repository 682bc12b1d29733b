"""What a run's offload tiers are: the ``--kv-offloading-*`` options as specs, checked
with errors that name the option (:mod:`fragsim.offload.connector` runs them)."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
BACKENDS = ("native", "lmcache", "lazy")
LMCACHE_CHUNK = 256


@dataclass(frozen=True)
class DiskSpec:
    """A disk tier below the CPU tier."""

    size_gib: float
    read_bandwidth: float = 3e9     # B/s, all threads together
    write_bandwidth: float = 2e9
    threads: int = 4
    policy: str = "lru"

    def check(self) -> None:
        from fragsim.offload.policies import POLICIES

        if not self.size_gib > 0:
            raise ValueError(f"--kv-offloading-disk-size must be > 0 GiB, got {self.size_gib:g}")
        for name, value in (("read", self.read_bandwidth), ("write", self.write_bandwidth)):
            if not value > 0:
                raise ValueError(f"--kv-offloading-disk-{name}-gbps must be > 0, got {value / 1e9:g}")
        if self.threads < 1:
            raise ValueError(f"--kv-offloading-disk-threads must be >= 1, got {self.threads}")
        if self.policy not in POLICIES:
            raise ValueError(f"disk policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")


@dataclass(frozen=True)
class OffloadSpec:
    """Tiers as vLLM's options name them (``--kv-offloading-*``)."""

    size_gib: float
    policy: str = "lru"
    block_size: int | None = None      # tokens per chunk; None: the backend's default
    store_threshold: int = 1
    prompt_only: bool = True
    backend: str = "native"
    disk: DiskSpec | None = None

    def check(self, gpu_block: int) -> None:
        from fragsim.offload.policies import POLICIES

        if self.backend not in BACKENDS:
            raise ValueError(f"--kv-offloading-backend must be one of {', '.join(BACKENDS)}, "
                             f"got {self.backend!r}")
        if not self.size_gib > 0:
            raise ValueError(f"--kv-offloading-size must be > 0 GiB, got {self.size_gib:g}")
        if self.policy not in POLICIES:
            raise ValueError(f"--kv-offloading-policy must be one of {', '.join(POLICIES)}, "
                             f"got {self.policy!r}")
        chunk = self.chunk_tokens(gpu_block)
        if chunk < 1 or chunk % gpu_block:
            raise ValueError(f"--kv-offloading-block-size must be a multiple of the GPU block "
                             f"size {gpu_block}, got {chunk}")
        if self.backend == "lazy" and chunk != gpu_block:
            raise ValueError(f"the lazy backend stores GPU blocks as they are evicted: "
                             f"--kv-offloading-block-size must be the GPU block size {gpu_block}, got {chunk}")
        if self.store_threshold < 1:
            raise ValueError(f"--kv-offloading-store-threshold must be >= 1, got {self.store_threshold}")
        if not self.prompt_only and self.backend == "lazy":
            raise ValueError("--no-kv-offloading-prompt-only is an option of vLLM's OffloadingConnector "
                             "(native, lmcache); the lazy backend has none: it stores what the GPU "
                             "prefix cache evicts")
        if self.disk is not None:
            self.disk.check()

    def chunk_tokens(self, gpu_block: int) -> int:
        if self.block_size is not None:
            return self.block_size
        return LMCACHE_CHUNK if self.backend == "lmcache" else gpu_block
