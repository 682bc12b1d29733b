"""Tiers under the GPU pool, in time: vLLM 0.33's ``OffloadingConnector`` in the engine.

The engine (:mod:`fragsim.engine`) calls it where vLLM's scheduler calls the
connector's scheduler side (``vllm/distributed/kv_transfer/kv_connector/v1/offloading/``):

=======================  =================================================================
admission                after the GPU prefix-cache hit, :meth:`~OffloadConnector.probe`
                         looks the prompt's chunks up past it (:mod:`fragsim.offload.groups`;
                         a dense model: to the first chunk no tier holds). A chunk still
                         being written counts, but defers the request a step (vLLM's
                         ``HIT_PENDING``); less than a chunk is no hit. Once its blocks
                         are placed, :meth:`~OffloadConnector.start_load` pins and loads
                         the run; the request waits, holding its blocks, until every load
                         lands (``WAITING_FOR_REMOTE_KVS``), then prefills the rest (a whole
                         prompt's last token is computed again).
end of a step            :meth:`~OffloadConnector.store` offers the prompt chunks the step
                         completed (eager stores); the CPU tier takes them all or none,
                         evicting idle chunks by its policy, never one being read or
                         written. With decode stores (``--no-kv-offloading-prompt-only``)
                         the chunks decode tokens completed are offered too
                         (:mod:`fragsim.decode_stores`), keyed as
                         :mod:`fragsim.offload.keys` says.
a request finishes       its GPU blocks stay held until its stores land (vLLM 0.33 frees
                         them at once but fences their reuse until the stores land: the
                         same bytes are unusable meanwhile)
start of a step          :meth:`~OffloadConnector.poll`: transfers that ended by now
                         complete; loaded requests may run; held blocks are freed
=======================  =================================================================

Backends (``--kv-offloading-backend``)
    ``native``  vLLM's own: eager stores of whole chunks (``--kv-offloading-block-size``).
    ``lmcache`` LMCache-style: 256-token chunks under LRU, and a prompt's partial last
                chunk is stored too, in a whole chunk slot: its unused tokens are *chunk
                tails*. The partial chunk hits only a prompt of the same content and length.
    ``lazy``    vLLM's simple CPU offload with ``lazy_offload``: nothing is stored
                eagerly; a cached GPU block is copied to the tier when the GPU prefix
                cache evicts it (needs ``--prefix-caching``; chunks are GPU blocks). A
                block evicted in a stretch of decode steps is stored from the stretch's
                start, and the GPU reuses the block at once. It has no
                ``--no-kv-offloading-prompt-only`` (vLLM's simple connector has no such
                option): refused by name.

A hybrid model (``--allocator vllm-hybrid``) keys every chunk once per KV cache group;
a store offers a chunk in every group at once, each in a slot of its own (vLLM pads every
group's block to one page), and a load brings each group the chunks of the blocks the
manager placed (a sliding layer's: its window's).

A disk tier (``--kv-offloading-disk-size``) sits below the CPU tier, written through:
every chunk that lands in the CPU tier is then written to disk (not pinned meanwhile).
A lookup takes a chunk from the CPU tier if it is ready there, else from disk;
a disk chunk is read into a bounce buffer and goes over the host link, and is not
promoted into the CPU tier. Each tier evicts by its own policy.

Transfers queue for SimPy resources, first come, first served: the host link (one per
GPU; loads and stores share it; ``n`` tokens take ``n × bytes per token per GPU / PCIe
bandwidth`` seconds) and the disk's I/O threads
(``--kv-offloading-disk-threads`` jobs at once, each at that share of the read or
write bandwidth). A transfer's end is known once its last phase holds its
resource, so :meth:`~OffloadConnector.poll` decides by time, whatever order SimPy
runs same-time events in.

Where a tier's chunk slots go over time is :mod:`fragsim.offload.level`'s.

Not modelled: load timeouts and a cap on loading requests, and a request preempted
while loading leaves its load running (its chunks are unpinned when it lands).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import simpy

from fragsim.connector import HeldBlocks
from fragsim.offload import groups as tier_groups
from fragsim.offload.groups import FULL_GROUP, TierGroup, hit_spans, hit_tokens, load_plan, serve
from fragsim.offload.keys import ChunkKeys
from fragsim.offload.level import Level
from fragsim.offload.spec import GIB, OffloadSpec
from fragsim.offload.transfer import Transfer, next_done, run
from fragsim.prefix import PrefixKeys
from fragsim.traces import Trace


class OffloadConnector:
    """The tiers under one GPU pool and their links, driven by the engine (see the
    module docstring)."""

    def __init__(self, trace: Trace, spec: OffloadSpec, gpu_block: int,
                 kv_bytes_per_token_per_gpu: int, tp: int, bandwidth: float,
                 gpu_keys: PrefixKeys | None = None, groups: Sequence[TierGroup] = FULL_GROUP,
                 placed_from: Callable[[int, int], int] | None = None) -> None:
        spec.check(gpu_block)
        if len(groups) > 1 and spec.backend != "native":
            raise ValueError(f"the {spec.backend} backend keeps one chunk list a request; a hybrid "
                             f"model's groups are offloaded by the native backend")
        if bandwidth <= 0:
            raise ValueError(f"host link bandwidth must be > 0 B/s, got {bandwidth}")
        if spec.backend == "lazy" and gpu_keys is None:
            raise ValueError("the lazy backend stores blocks the GPU prefix cache evicts: "
                             "it needs --prefix-caching")
        self.spec = spec
        self.backend = spec.backend
        #: the KV cache groups, each chunk of each stored apart (a dense model: one, full)
        self.groups = tuple(groups)
        self.windowed = any(not g.is_full for g in self.groups)
        #: (request, group) -> the first token position the KV manager placed a block for
        self.placed_from = placed_from
        self.gpu_block = gpu_block
        self.chunk = spec.chunk_tokens(gpu_block)
        self.token_bytes = kv_bytes_per_token_per_gpu * tp   # one token, every GPU of the instance
        self.chunk_bytes = self.chunk * self.token_bytes
        self.per_gpu_token_bytes = kv_bytes_per_token_per_gpu
        self.link_seconds_per_token = kv_bytes_per_token_per_gpu / bandwidth  # each GPU, its own link
        self.cpu = Level("cpu", int(spec.size_gib * GIB // self.chunk_bytes), spec.policy,
                         spec.store_threshold, self.chunk_bytes)
        self.levels = [self.cpu]
        self.disk: Level | None = None
        if spec.disk is not None:
            self.disk = Level("disk", int(spec.disk.size_gib * GIB // self.chunk_bytes),
                              spec.disk.policy, 1, self.chunk_bytes)
            self.levels.append(self.disk)
        # The lazy backend's keys are the GPU prefix cache's own (it stores what the GPU evicts).
        prefix = gpu_keys if spec.backend == "lazy" and gpu_keys is not None else PrefixKeys(trace, self.chunk)
        self.keys = ChunkKeys(prefix, trace.output_len, spec.backend == "lmcache", not spec.prompt_only,
                              len(self.groups))
        #: decode stores (``--no-kv-offloading-prompt-only``): chunks that generated tokens
        #: complete are stored too (:mod:`fragsim.decode_stores`)
        self.decode_chunk: int | None = None if spec.prompt_only else self.chunk
        self._tail_due: set[int] = set()             # decode stores: lmcache tails not yet offered
        self.queries = 0                             # tokens looked up past the GPU hit
        self.hits = 0
        self.loads: list[float] = []                 # each load's time from admission to landing
        self._next_store: dict[int, int] = {}        # req -> first chunk not yet offered
        self._pending_stores: dict[int, int] = {}    # req -> store jobs in flight
        self._held = HeldBlocks()                    # sequences kept for their stores
        self.host_pool = self                        # swap takes its room from the CPU tier
        self._loading: dict[int, list[Transfer]] = {}  # req -> its loads in flight
        self._inflight: list[Transfer] = []
        self.env: simpy.Environment | None = None
        self.link: simpy.Resource | None = None
        self.io: simpy.Resource | None = None
        self.now = 0.0
        self.t_start = 0.0
        self.t_end: float | None = None

    @property
    def num_chunks(self) -> int:
        return self.cpu.num_chunks

    # ------------------------------------------------------------------ setup

    def bind(self, env: simpy.Environment) -> None:
        """Run on ``env`` (the engine's, made when it runs)."""
        self.env = env
        self.link = simpy.Resource(env, capacity=1)
        if self.spec.disk is not None:
            self.io = simpy.Resource(env, capacity=self.spec.disk.threads)
        self.now = self.t_start = float(env.now)

    def watch(self, allocator: Any) -> None:
        """The lazy backend: hear of every cached block the GPU allocator evicts."""
        if self.backend == "lazy":
            allocator.on_evict = self.store_evicted

    @property
    def busy(self) -> bool:
        """Something is in flight or waiting on it (the engine takes single steps then)."""
        return bool(self._inflight or self._held)

    # -------------------------------------------------------------- admission

    def _source(self, key: int) -> Level | None:
        """The tier a chunk is read from: the highest that holds it ready (None: none)."""
        return next((lv for lv in self.levels if lv.ready(key)), None)

    def _state(self, key: int, ready_only: bool) -> str:
        if self._source(key) is not None:
            return tier_groups.HIT
        held = not ready_only and any(key in lv.tier.state for lv in self.levels)
        return tier_groups.PENDING if held else tier_groups.MISS  # pending: vLLM's HIT_PENDING

    def _lookup(self, keys: Sequence[int], prompt: int, context: int, gpu_hit: int,
                ready_only: bool = False) -> int | None:
        """Tokens past the GPU hit the tiers hold (:func:`~fragsim.offload.groups.hit_tokens`;
        a model with a window stops a token short); ``ready_only``: a chunk still being
        written counts as missing."""
        bound = context if self.decode_chunk is not None else min(context, prompt)  # decode stores: every token
        limit = min(bound - self.windowed, len(keys) * self.chunk)  # a window stops a token short
        tokens, looked = hit_tokens(self.groups, self.chunk, gpu_hit, limit,
                                    lambda g, i: self._state(self.keys.key(keys[i], g), ready_only))
        for level in self.levels:
            level.tier.counters.lookups += looked
        return tokens

    def probe(self, req: int, prompt: int, context: int, gpu_hit: int) -> int | None:
        """Tokens the tiers hold past the GPU hit of ``gpu_hit`` tokens (0: none), or None: a
        chunk the answer rests on is still being written, and the request waits a step."""
        return self._lookup(self.keys.lookup(req, prompt, context), prompt, context, gpu_hit)

    def start_load(self, req: int, prompt: int, context: int, gpu_hit: int, now: float,
                   load: bool = True) -> int:
        """The request was admitted (its blocks placed): count its lookup, and load what
        the tiers hold past its GPU hit (pinned until it lands). Returns the tokens loaded,
        which the request waits for (:meth:`loading`). ``load=False``: another connector
        brings its KV (:class:`~fragsim.connector.MultiConnector`); its chunks are stored
        as they are computed or arrive."""
        self.now = now
        keys = self.keys.lookup(req, prompt, context)
        first = gpu_hit // self.chunk
        if req not in self._next_store and self.decode_chunk is not None \
                and self.backend == "lmcache" and prompt % self.chunk:
            self._tail_due.add(req)
        self._next_store.setdefault(req, first)
        self.queries += context - gpu_hit
        if not load:
            return 0
        # Ready chunks only: the admission may have evicted (lazy stores) since the probe.
        tokens = self._lookup(keys, prompt, context, gpu_hit, ready_only=True) or 0
        if tokens <= 0:
            return 0
        end = gpu_hit + tokens
        placed = [0 if g.is_full or self.placed_from is None else self.placed_from(req, i)
                  for i, g in enumerate(self.groups)]
        bound = context if self.decode_chunk is not None else min(context, prompt)
        plan = load_plan(self.groups, self.chunk, self.gpu_block, gpu_hit, end, bound, placed)
        served = serve(plan, hit_spans(self.chunk, gpu_hit, end), lambda g, i: self.keys.key(keys[i], g),
                       self._source)
        access = self.keys.of_groups(self.keys.access(req, prompt))
        jobs: list[Transfer] = []
        for level in self.levels:
            if level not in served:
                continue
            ks, moved, hit = served[level]
            level.tier.counters.hits += len(ks)
            level.pin(req, ks, now, access)
            level.stats.hits += hit
            phases = [(self._link(), moved * self.link_seconds_per_token)]
            if level is self.disk:
                phases.insert(0, (self._io(), self._disk_seconds(moved, read=True)))
            jobs.append(Transfer("load", req, ks, moved, phases, now, level))
        self._next_store[req] = max(self._next_store[req], end // self.chunk)
        self.hits += tokens
        self._loading[req] = jobs
        for job in jobs:
            self._start(job)
        return tokens

    def _chunk_len(self, i: int, prompt: int) -> int:
        return min(self.chunk, prompt - i * self.chunk)

    def loading(self, req: int) -> bool:
        return req in self._loading

    # ----------------------------------------------------------------- stores

    def store(self, req: int, prompt: int, computed: int, now: float) -> None:
        """Offer the chunks the first ``computed`` tokens complete (end of a step): the
        prompt's, and with decode stores the output's too."""
        if self.backend == "lazy":
            return
        if self.decode_chunk is not None:
            self._store_context(req, prompt, computed, now)
            return
        keys = self.keys.prompt(req, prompt)
        done = min(computed, prompt)
        full = done // self.chunk if done < prompt else len(keys)  # lmcache: the tail at the end
        first = self._next_store.get(req, 0)
        if full <= first:
            return
        self._next_store[req] = full
        fills = {keys[i]: self._chunk_len(i, prompt) / self.chunk for i in range(first, full)}
        self._offer(req, keys[first:full], fills, now, keys)

    def _store_context(self, req: int, prompt: int, computed: int, now: float) -> None:
        """Decode stores: every full chunk of the first ``computed`` tokens, prompt or
        output (lmcache: and the prompt's partial last chunk once the prompt is done)."""
        keys = self.keys.access(req, prompt)
        full_keys = self.keys.context(req, prompt)
        first = self._next_store.get(req, 0)
        full = min(computed // self.chunk, len(full_keys))
        offered = full_keys[first:full]
        fills: dict[int, float] = {}
        if req in self._tail_due and computed >= prompt:
            self._tail_due.discard(req)
            tail = keys[prompt // self.chunk]
            fills[tail] = (prompt % self.chunk) / self.chunk
            offered.insert(max(prompt // self.chunk - first, 0), tail)
        if not offered:
            return
        self._next_store[req] = max(first, full)
        self._offer(req, offered, fills, now, keys)

    def _offer(self, req: int, offered: list[int], fills: dict[int, float], now: float,
               keys: list[int]) -> None:
        """The CPU tier takes ``offered`` all or none, in every group at once (``fills``: a
        partial chunk's share of its tokens, 1 when absent); what it takes is written over
        the host link."""
        offered, keys = self.keys.of_groups(offered), self.keys.of_groups(keys)
        stored = self.cpu.store(req, offered, fills, now, keys)
        if not stored:
            return
        tokens = sum(round(fills.get(key, 1.0) * self.chunk) for key in stored)
        self._pending_stores[req] = self._pending_stores.get(req, 0) + 1
        self._start(Transfer("store", req, stored, tokens,
                             [(self._link(), tokens * self.link_seconds_per_token)], now, self.cpu))

    def store_evicted(self, keys: list[int]) -> None:
        """The lazy backend: GPU blocks the prefix cache evicted now go to the CPU tier."""
        stored = self.cpu.store(-1, keys, {}, self.now, keys)
        if stored:
            tokens = len(stored) * self.chunk
            self._start(Transfer("store", -1, stored, tokens,
                                 [(self._link(), tokens * self.link_seconds_per_token)], self.now, self.cpu))

    def must_hold(self, req: int) -> bool:
        """Whether ``req``'s GPU blocks must outlive it (its stores are in flight)."""
        return self._pending_stores.get(req, 0) > 0

    def hold(self, req: int, seq: int) -> None:
        self._held.hold(req, seq)

    def finish(self, req: int, now: float) -> None:
        """``req`` finished: its accesses reach each tier's policy (vLLM 0.33 updates
        recency here)."""
        for level in self.levels:
            level.finish(req)
        self._next_store.pop(req, None)
        self._tail_due.discard(req)
        if self.backend != "lazy":  # the lazy backend's keys are the GPU cache's
            self.keys.forget(req)

    def swap_out(self, slots: int, now: float) -> bool:
        """Room in the CPU tier for ``slots`` KV slots of a swapped-out sequence (one host
        pool: swap takes whole chunks from the tier, evicting idle ones); False: none."""
        return self.cpu.lend(-(-slots // self.chunk), now)

    def swap_in(self, slots: int, now: float) -> None:
        self.cpu.take_back(-(-slots // self.chunk), now)

    # -------------------------------------------------------------- transfers

    def _link(self) -> simpy.Resource:
        assert self.link is not None, "bind() the connector to the engine's environment first"
        return self.link

    def _io(self) -> simpy.Resource:
        assert self.io is not None and self.spec.disk is not None
        return self.io

    def _disk_seconds(self, tokens: int, read: bool) -> float:
        disk = self.spec.disk
        assert disk is not None
        bandwidth = disk.read_bandwidth if read else disk.write_bandwidth
        return tokens * self.token_bytes * disk.threads / bandwidth  # one thread's share

    def _start(self, job: Transfer) -> None:
        assert self.env is not None, "bind() the connector to the engine's environment first"
        self._inflight.append(job)
        self.env.process(run(self.env, job))

    def next_done(self) -> float | None:
        """The earliest time a transfer in flight may land (None: nothing in flight)."""
        return next_done(self._inflight, self.now, self.env)

    def pending_at_end(self) -> bool:
        """Stores still in flight when the last request ends are not waited for."""
        return False

    def poll(self, now: float, free: Callable[[int], Any]) -> tuple[list[int], bool]:
        """Complete the transfers that landed by ``now``: returns the requests whose loads
        all landed, and whether held blocks were freed (``free``: the KV manager's)."""
        self.now = now
        landed = [job for job in self._inflight if job.end is not None and job.end <= now]
        if not landed:
            return [], False
        gone = set(map(id, landed))
        self._inflight = [job for job in self._inflight if id(job) not in gone]
        ready: list[int] = []
        freed = False
        for job in sorted(landed, key=lambda j: (j.end, j.start)):
            assert job.end is not None and job.level is not None
            level = job.level
            if job.kind == "load":
                level.stats.load_tokens += job.tokens
                level.stats.load_time_s += job.seconds
                level.unpin(job.keys, job.end)
                waiting = self._loading[job.req]
                waiting.remove(job)
                if not waiting:
                    del self._loading[job.req]
                    self.loads.append(job.end - job.ready)
                    ready.append(job.req)
                continue
            level.stats.store_tokens += job.tokens
            level.stats.store_time_s += job.seconds
            level.written(job.keys, job.end)
            if job.kind == "store" and self.disk is not None:
                self._write_through(job)
            if job.kind != "store" or job.req < 0:
                continue
            left = self._pending_stores[job.req] - 1
            if left:
                self._pending_stores[job.req] = left
                continue
            del self._pending_stores[job.req]
            freed |= self._held.release(job.req, free)
        return ready, freed

    def _write_through(self, job: Transfer) -> None:
        """Chunks that landed in the CPU tier are written on to disk."""
        disk = self.disk
        assert disk is not None and job.end is not None
        keys = [key for key in job.keys if key in self.cpu.tier.state]
        req = job.req if job.req >= 0 and job.req in self.cpu.access else -1
        prompt_keys = list(self.cpu.access[req].positions) if req >= 0 else keys
        fills = {key: self.cpu.resident[key].fill for key in keys}
        stored = disk.store(req, keys, fills, job.end, prompt_keys)
        if stored:
            tokens = sum(round(fills[key] * self.chunk) for key in stored)
            self._start(Transfer("disk_write", job.req, stored, tokens,
                                 [(self._io(), self._disk_seconds(tokens, read=False))], job.end, disk))

    # ---------------------------------------------------------------- results

    def check(self) -> None:
        """Each tier's states against its residency log and its own counts."""
        for level in self.levels:
            level.check()
        assert all(self._pending_stores.get(req, 0) > 0 for req in self._held.by_req), "held without stores"

    def close(self, now: float) -> None:
        """The run ended at ``now``: every stay still open ends there."""
        for level in self.levels:
            level.close(now)
        self.t_end = now

    def summary(self) -> list[dict[str, Any]]:
        """The run's ``tiers`` list, top tier first."""
        span = max((self.t_end if self.t_end is not None else self.t_start) - self.t_start, 0.0)
        out = []
        for level in self.levels:
            entry = level.summary(span, self.chunk, self.token_bytes)
            entry["backend"] = self.backend
            entry["queries_tokens"] = self.queries
            out.append(entry)
        loads = self.loads
        out[0]["mean_load_wait_s"] = sum(loads) / len(loads) if loads else 0.0
        return out
