"""Hit rate against tier capacity: a trace replayed in request order, as Mooncake's Fig. 9.

No time, no GPU: each request, in trace order, makes the calls vLLM 0.33's
``OffloadingConnectorScheduler`` makes on its offloading manager for a request
whose prefill runs in one step and that the GPU prefix cache does not serve
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``):

1. the request arrives (``on_new_request``);
2. its full prompt chunks are looked up from the first until the first miss
   (``_maximal_prefix_lookup``); the run of hits is its hit;
3. the hits are loaded (``update_state_after_alloc`` → ``prepare_load``), and the
   load completes before the prefill runs;
4. the prompt chunks after the hit are offered for storing (``_build_store_jobs``
   → ``prepare_store``; vLLM's chunk-level policy skips the chunks it hit), and
   the stores complete;
5. the request finishes (``on_request_finished``), which is where 0.33 updates
   recency (earlier releases touched keys at lookup).

Only full chunks have keys: a prompt of ``n`` tokens has ``n // block_size`` of
them, as vLLM hashes only full blocks. A chunk's key is fixed by the trace's
content hashes up to its last token and its index (:class:`fragsim.prefix.PrefixKeys`),
so Mooncake's 512-token ``hash_ids`` give a 512-token chunk one key each.

Besides the hit rate at each capacity the replay reports the most any capacity
could give (every chunk kept: the consecutive prefix of chunks seen before) and
the *cache ratio*: the share of chunk references whose key was seen before at
all, wherever it stands in the prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from fragsim.offload.tier import RequestAccess, Tier
from fragsim.prefix import PrefixKeys
from fragsim.traces import Trace


@dataclass
class HitRate:
    """One capacity's replay (the keys of ``fragsim trace hits --json``)."""

    capacity_tokens: int
    policy: str
    block_size: int
    requests: int
    block_refs: int
    hit_blocks: int
    max_hit_rate: float
    cache_ratio: float
    evictions: int
    failed_stores: int
    hit_blocks_per_request: list[int] = field(repr=False)

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.block_refs if self.block_refs else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "capacity_tokens": self.capacity_tokens,
            "policy": self.policy,
            "block_size": self.block_size,
            "requests": self.requests,
            "block_refs": self.block_refs,
            "hit_blocks": self.hit_blocks,
            "hit_rate": self.hit_rate,
            "max_hit_rate": self.max_hit_rate,
            "cache_ratio": self.cache_ratio,
            "evictions": self.evictions,
            "failed_stores": self.failed_stores,
            "hit_blocks_per_request": self.hit_blocks_per_request,
        }


def chunk_keys(trace: Trace, block_size: int) -> list[list[int]]:
    """Each request's full prompt chunks of ``block_size`` tokens, as integer keys."""
    keys = PrefixKeys(trace, block_size)
    out = []
    for req, prompt_len in enumerate(trace.prompt_len.tolist()):
        out.append(keys.keys(req, prompt_len))
        keys.forget(req)
    return out


def replay(keys: Sequence[Sequence[int]], num_chunks: int, policy: str = "lru",
           store_threshold: int = 1) -> tuple[list[int], Tier]:
    """Hit chunks per request, replaying each request's calls in order on one tier."""
    tier = Tier(num_chunks, policy, store_threshold=store_threshold)
    state = tier.state  # lookups read it directly: the replay's inner loop
    hits_per_request = []
    for request in keys:
        access = RequestAccess({key: i + 1 for i, key in enumerate(request)})
        hit = 0
        for key in request:
            if state.get(key, -1) < 0:  # absent, or (never here) still being written
                break
            hit += 1
        tier.counters.lookups += min(hit + 1, len(request))
        tier.counters.hits += hit
        if hit:
            loaded = request[:hit]
            tier.prepare_load(loaded, access)
            tier.complete_load(loaded)
        if hit < len(request):
            result = tier.prepare_store(request[hit:], access)
            if result is not None and result.stored:
                tier.complete_store(result.stored)
        tier.finish(access)
        hits_per_request.append(hit)
    return hits_per_request, tier


def prefix_seen(keys: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(chunks in the longest seen-before prefix, chunks seen before anywhere), summed."""
    seen: set[int] = set()
    prefix = anywhere = 0
    for request in keys:
        run = True
        for key in request:
            if key in seen:
                anywhere += 1
                prefix += run
            else:
                run = False
        seen.update(request)
    return prefix, anywhere


def hit_rates(trace: Trace, capacities_tokens: Sequence[int], policy: str = "lru",
              block_size: int = 512, store_threshold: int = 1,
              progress: Callable[[int], None] | None = None) -> list[HitRate]:
    """Replay ``trace`` once per capacity (tokens, rounded down to whole chunks)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    keys = chunk_keys(trace, block_size)
    refs = sum(len(k) for k in keys)
    prefix, anywhere = prefix_seen(keys)
    max_rate = prefix / refs if refs else 0.0
    ratio = anywhere / refs if refs else 0.0
    out = []
    for i, capacity in enumerate(capacities_tokens):
        per_request, tier = replay(keys, int(capacity) // block_size, policy, store_threshold)
        out.append(HitRate(int(capacity), policy, block_size, len(keys), refs,
                           int(np.sum(per_request)), max_rate, ratio, tier.counters.evicted,
                           tier.counters.failed_stores, per_request))
        if progress is not None:
            progress(i + 1)
    return out
