"""A CPU tier under the GPU pool, in time: vLLM 0.33's ``OffloadingConnector`` in the engine.

The engine (:mod:`fragsim.engine`) calls it where vLLM's scheduler calls the
connector's scheduler side (``vllm/distributed/kv_transfer/kv_connector/v1/offloading/``):

=======================  =================================================================
admission                after the GPU prefix-cache hit, :meth:`lookup` walks the request's
                         prompt chunks from the first one the GPU did not hit until the
                         first miss; the run of ready chunks is loaded (pinned in the tier)
                         into the blocks the admission placed. The request waits, holding
                         them, until the load lands (``WAITING_FOR_REMOTE_KVS``), then its
                         prefill starts after the loaded tokens. One token is always
                         computed, as for GPU hits.
end of a step            :meth:`store` offers the prompt chunks the step completed (eager
                         stores, prompt only); the tier takes them all or none, evicting
                         idle chunks by its policy, never one being read or written.
a request finishes       its GPU blocks stay held (:meth:`hold`) until its stores land
start of a step          :meth:`poll`: transfers that ended by now complete; loaded
                         requests may run; held blocks are freed
=======================  =================================================================

Transfers go over the host link, one SimPy resource per GPU link (loads and stores
queue for it first come, first served): a transfer of ``n`` tokens takes
``n × kv_bytes_per_token_per_gpu / bandwidth`` seconds once it holds the link. A
transfer's end is known once it holds the link, so :meth:`poll` decides by time,
whatever order SimPy runs same-time events in.

Where the tier's chunk slots go, integrated over time (:class:`TierSplit`, the
``*_frac`` keys of the tier's summary)::

    write_pending + read_pending + cached_hit_later + cached_never_hit + chunk_tail + free
        == num_chunks × span

A resident chunk is *write pending* from its store until the write lands, *read
pending* while a load reads it, *cached, hit later* while idle before a read that
comes, *cached, never hit again* while idle after its last read (or with none),
until evicted or the run ends. Only whole chunks are stored here, so chunk tails
are 0 (a tier storing partial chunks would count their unused tokens there).

What is not modelled here: decode-token stores (``prompt only`` is the only mode),
load timeouts and a cap on loading requests, a disk tier below the CPU tier, and
preemption while a load is in flight leaves the load running (its chunks are
unpinned when it lands).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import simpy

from fragsim.offload.tier import WRITING, RequestAccess, Tier
from fragsim.prefix import PrefixKeys
from fragsim.traces import Trace

GIB = 2**30


@dataclass(frozen=True)
class OffloadSpec:
    """A CPU tier as vLLM's options name it (``--kv-offloading-*``)."""

    size_gib: float
    policy: str = "lru"
    block_size: int | None = None      # tokens per chunk; None: the GPU block size
    store_threshold: int = 1
    prompt_only: bool = True

    def check(self, gpu_block: int) -> None:
        from fragsim.offload.policies import POLICIES

        if not self.size_gib > 0:
            raise ValueError(f"--kv-offloading-size must be > 0 GiB, got {self.size_gib:g}")
        if self.policy not in POLICIES:
            raise ValueError(f"--kv-offloading-policy must be one of {', '.join(POLICIES)}, "
                             f"got {self.policy!r}")
        chunk = self.chunk_tokens(gpu_block)
        if chunk < 1 or chunk % gpu_block:
            raise ValueError(f"--kv-offloading-block-size must be a multiple of the GPU block "
                             f"size {gpu_block}, got {chunk}")
        if self.store_threshold < 1:
            raise ValueError(f"--kv-offloading-store-threshold must be >= 1, got {self.store_threshold}")
        if not self.prompt_only:
            raise ValueError("--no-kv-offloading-prompt-only: storing decode blocks is not "
                             "modelled yet; tiers store prompt blocks only")

    def chunk_tokens(self, gpu_block: int) -> int:
        return self.block_size if self.block_size is not None else gpu_block


@dataclass(eq=False)
class Transfer:
    """One job on the host link: ``tokens`` tokens of KV, ``seconds`` once it holds the link."""

    kind: str                     # "load" (CPU to GPU) or "store" (GPU to CPU)
    req: int
    keys: list[int]
    tokens: int
    seconds: float
    ready: float                  # when it may start
    start: float | None = None    # when it took the link
    end: float | None = None      # start + seconds, once it took the link
    cancelled: bool = False       # a load whose request was preempted meanwhile


@dataclass
class _Residency:
    """One chunk's stay in the tier, for the split."""

    t_in: float
    t_ready: float | None = None
    read_total: float = 0.0
    read_since: float | None = None        # a read episode is open (readers > 0) since then
    last_read_start: float | None = None
    read_before_last: float = 0.0          # read time before the last episode started


@dataclass
class TierSplit:
    """Chunk-seconds of each part of the tier (see the module docstring)."""

    write_pending: float = 0.0
    read_pending: float = 0.0
    cached_hit_later: float = 0.0
    cached_never_hit: float = 0.0
    chunk_tail: float = 0.0

    def close(self, r: _Residency, t_out: float) -> None:
        if r.t_ready is None:
            self.write_pending += t_out - r.t_in
            return
        self.write_pending += r.t_ready - r.t_in
        read = r.read_total + (t_out - r.read_since if r.read_since is not None else 0.0)
        later = (r.last_read_start - r.t_ready - r.read_before_last) if r.last_read_start is not None else 0.0
        self.read_pending += read
        self.cached_hit_later += later
        self.cached_never_hit += (t_out - r.t_ready) - read - later

    @property
    def used(self) -> float:
        return (self.write_pending + self.read_pending + self.cached_hit_later
                + self.cached_never_hit + self.chunk_tail)


@dataclass
class TierStats:
    """Counts over a run (tokens unless named otherwise)."""

    queries: int = 0            # prompt tokens looked up past the GPU hit (vLLM: external queries)
    hits: int = 0               # of which loaded from the tier
    load_tokens: int = 0
    store_tokens: int = 0
    load_time_s: float = 0.0    # time the link spent on loads
    store_time_s: float = 0.0
    failed_stores: int = 0
    loads: list[float] = field(default_factory=list)  # each load's time from admission to landing


class OffloadConnector:
    """One CPU tier and its host link, driven by the engine (see the module docstring)."""

    name = "cpu"

    def __init__(self, trace: Trace, spec: OffloadSpec, gpu_block: int,
                 kv_bytes_per_token_per_gpu: int, tp: int, bandwidth: float) -> None:
        spec.check(gpu_block)
        if bandwidth <= 0:
            raise ValueError(f"host link bandwidth must be > 0 B/s, got {bandwidth}")
        self.spec = spec
        self.gpu_block = gpu_block
        self.chunk = spec.chunk_tokens(gpu_block)
        self.token_bytes = kv_bytes_per_token_per_gpu * tp   # one token, every GPU of the instance
        self.chunk_bytes = self.chunk * self.token_bytes
        self.num_chunks = int(spec.size_gib * GIB // self.chunk_bytes)
        self.seconds_per_token = kv_bytes_per_token_per_gpu / bandwidth  # each GPU over its own link
        self.tier = Tier(self.num_chunks, spec.policy, store_threshold=spec.store_threshold)
        self.keys = PrefixKeys(trace, self.chunk)
        self.stats = TierStats()
        self.split = TierSplit()
        self._resident: dict[int, _Residency] = {}
        self._access: dict[int, RequestAccess] = {}
        self._next_store: dict[int, int] = {}        # req -> first chunk not yet offered
        self._pending_stores: dict[int, int] = {}    # req -> store jobs in flight
        self._held: dict[int, list[int]] = {}        # req -> sequences kept for its stores
        self._loading: dict[int, Transfer] = {}      # req -> its load in flight
        self._inflight: list[Transfer] = []
        self.env: simpy.Environment | None = None
        self.link: simpy.Resource | None = None
        self.t_start = 0.0

    # ------------------------------------------------------------------ setup

    def bind(self, env: simpy.Environment) -> None:
        """Run on ``env`` (the engine's, made when it runs)."""
        self.env = env
        self.link = simpy.Resource(env, capacity=1)
        self.t_start = float(env.now)

    @property
    def busy(self) -> bool:
        """Something is in flight or waiting on it (the engine takes single steps then)."""
        return bool(self._inflight or self._held)

    @property
    def held_seqs(self) -> list[int]:
        return [seq for seqs in self._held.values() for seq in seqs]

    # -------------------------------------------------------------- admission

    def _access_of(self, req: int, prompt: int) -> RequestAccess:
        access = self._access.get(req)
        if access is None:
            keys = self.keys.keys(req, prompt)
            access = RequestAccess({key: i + 1 for i, key in enumerate(keys)})
            self._access[req] = access
        return access

    def lookup(self, req: int, prompt: int, context: int, gpu_hit: int, now: float) -> int:
        """Tokens found past the GPU hit (0: none); a hit starts their load, which the
        request waits for (:meth:`loading`)."""
        keys = self.keys.keys(req, prompt)
        access = self._access_of(req, prompt)
        self._next_store.setdefault(req, gpu_hit // self.chunk)
        first = gpu_hit // self.chunk
        state = self.tier.state
        hits = 0
        for key in keys[first:]:
            if state.get(key, WRITING) == WRITING:
                break
            hits += 1
        self.stats.queries += context - gpu_hit
        self.tier.counters.lookups += min(hits + 1, len(keys) - first)
        limit = (context - 1) // self.gpu_block * self.gpu_block  # one token is always computed
        tokens = min((first + hits) * self.chunk, limit) - gpu_hit
        if tokens <= 0:
            return 0
        loaded = keys[first: -(-(gpu_hit + tokens) // self.chunk)]
        self.tier.counters.hits += len(loaded)
        self.tier.prepare_load(loaded, access)
        for key in loaded:
            r = self._resident[key]
            if r.read_since is None:
                r.read_before_last = r.read_total
                r.read_since = r.last_read_start = now
        self._next_store[req] = max(self._next_store[req], (gpu_hit + tokens) // self.chunk)
        self.stats.hits += tokens
        job = Transfer("load", req, loaded, tokens, tokens * self.seconds_per_token, now)
        self._loading[req] = job
        self._start(job)
        return tokens

    def loading(self, req: int) -> bool:
        return req in self._loading

    def cancel(self, req: int) -> None:
        """``req`` was preempted while loading: its load runs on, unheeded."""
        job = self._loading.pop(req, None)
        if job is not None:
            job.cancelled = True

    # ----------------------------------------------------------------- stores

    def store(self, req: int, prompt: int, computed: int, now: float) -> None:
        """Offer the prompt chunks the first ``computed`` tokens complete (end of a step)."""
        full = min(computed, prompt) // self.chunk
        first = self._next_store.get(req, 0)
        if full <= first:
            return
        self._next_store[req] = full
        keys = self.keys.keys(req, prompt)[first:full]
        result = self.tier.prepare_store(keys, self._access_of(req, prompt))
        if result is None:
            self.stats.failed_stores += 1
            return
        for key in result.evicted:
            self.split.close(self._resident.pop(key), now)
        if not result.stored:
            return
        for key in result.stored:
            self._resident[key] = _Residency(now)
        tokens = len(result.stored) * self.chunk
        self._pending_stores[req] = self._pending_stores.get(req, 0) + 1
        self._start(Transfer("store", req, result.stored, tokens, tokens * self.seconds_per_token, now))

    def must_hold(self, req: int) -> bool:
        """Whether ``req``'s GPU blocks must outlive it (its stores are in flight)."""
        return self._pending_stores.get(req, 0) > 0

    def hold(self, req: int, seq: int) -> None:
        self._held.setdefault(req, []).append(seq)

    def finish(self, req: int) -> None:
        """``req`` finished: its accesses reach the tier's policy (vLLM 0.33 updates recency here)."""
        access = self._access.pop(req, None)
        if access is not None:
            self.tier.finish(access)
        self._next_store.pop(req, None)
        self.keys.forget(req)

    def held_slots(self, kv: Any, final: Any) -> tuple[int, int]:
        """(tokens the held sequences store, slots only they hold). ``final``: each
        request's final length (a finished sequence has stored all of it)."""
        if not self._held:
            return 0, 0
        stored = sum(int(final[req]) * len(seqs) for req, seqs in self._held.items())
        alloc = getattr(kv, "alloc", None)
        if alloc is None or not hasattr(alloc, "ref_cnt"):
            return stored, stored  # nothing is shared: each held slot is theirs alone
        holders: dict[int, int] = {}
        for seq in self.held_seqs:
            for block in alloc.block_table(seq):
                holders[block] = holders.get(block, 0) + 1
        only = sum(1 for block, n in holders.items() if n == alloc.ref_cnt(block))
        unused = sum(max(0, alloc.num_owned(seq) - int(final[req]))
                     for req, seqs in self._held.items() for seq in seqs)
        return stored, only * alloc.block_size - unused

    # -------------------------------------------------------------- transfers

    def _start(self, job: Transfer) -> None:
        assert self.env is not None, "bind() the connector to the engine's environment first"
        self._inflight.append(job)
        self.env.process(self._run(job))

    def _run(self, job: Transfer) -> Generator[simpy.Event, Any, None]:
        env, link = self.env, self.link
        assert env is not None and link is not None
        if job.ready > env.now:
            yield env.timeout(job.ready - env.now)
        with link.request() as turn:
            yield turn
            job.start = float(env.now)
            job.end = job.start + job.seconds
            yield env.timeout(job.seconds)

    def next_done(self) -> float | None:
        """The earliest time a transfer in flight lands (None: nothing in flight)."""
        ends = [job.end for job in self._inflight if job.end is not None]
        if ends:
            return min(ends)
        waits = [job.ready + job.seconds for job in self._inflight]
        return min(waits) if waits else None

    def poll(self, now: float, free: Callable[[int], Any]) -> tuple[list[int], bool]:
        """Complete the transfers that landed by ``now``: returns the requests whose load
        landed, and whether held blocks were freed (``free``: the KV manager's)."""
        landed = [job for job in self._inflight if job.end is not None and job.end <= now]
        if not landed:
            return [], False
        self._inflight = [job for job in self._inflight if not (job.end is not None and job.end <= now)]
        ready: list[int] = []
        freed = False
        stats, tier = self.stats, self.tier
        for job in sorted(landed, key=lambda j: (j.end, j.start)):
            assert job.end is not None and job.start is not None
            if job.kind == "load":
                stats.load_tokens += job.tokens
                stats.load_time_s += job.seconds
                tier.complete_load(job.keys)
                for key in job.keys:
                    if tier.state[key] == 0:
                        r = self._resident[key]
                        assert r.read_since is not None
                        r.read_total += job.end - r.read_since
                        r.read_since = None
                if not job.cancelled:
                    del self._loading[job.req]
                    stats.loads.append(job.end - job.ready)
                    ready.append(job.req)
                continue
            stats.store_tokens += job.tokens
            stats.store_time_s += job.seconds
            tier.complete_store(job.keys)
            for key in job.keys:
                self._resident[key].t_ready = job.end
            left = self._pending_stores[job.req] - 1
            if left:
                self._pending_stores[job.req] = left
                continue
            del self._pending_stores[job.req]
            for seq in self._held.pop(job.req, ()):
                free(seq)
                freed = True
        return ready, freed

    # ---------------------------------------------------------------- results

    def check(self) -> None:
        """The tier's states against the residency log and its own counts."""
        tier = self.tier
        state = tier.state
        assert len(state) <= tier.num_chunks, (len(state), tier.num_chunks)
        assert state.keys() == self._resident.keys(), "tier and residency log drifted"
        assert tier.num_idle == sum(1 for s in state.values() if s == 0)
        assert tier.num_writing == sum(1 for s in state.values() if s == WRITING)
        for key, s in state.items():
            r = self._resident[key]
            assert (s == WRITING) == (r.t_ready is None), f"chunk {key}: write state drifted"
            assert (s > 0) == (r.read_since is not None), f"chunk {key}: read state drifted"
        assert all(self._pending_stores.get(req, 0) > 0 for req in self._held), "held without stores"

    def close(self, now: float) -> None:
        """The run ended at ``now``: every stay still open ends there."""
        for key in list(self._resident):
            self.split.close(self._resident.pop(key), now)
        self.t_end = now

    def summary(self) -> dict[str, Any]:
        """The tier's entry of the run's ``tiers`` list."""
        span = max(getattr(self, "t_end", self.t_start) - self.t_start, 0.0)
        total = self.num_chunks * span
        split = self.split
        parts = {
            "cached_hit_later": split.cached_hit_later,
            "cached_never_hit": split.cached_never_hit,
            "write_pending": split.write_pending,
            "read_pending": split.read_pending,
            "chunk_tail": split.chunk_tail,
        }
        fracs = {f"{k}_frac": (v / total if total > 0 else 0.0) for k, v in parts.items()}
        fracs["free_frac"] = (total - split.used) / total if total > 0 else 1.0
        s, c = self.stats, self.tier.counters
        loads = sorted(s.loads)
        return {
            "name": self.name,
            "policy": self.spec.policy,
            "block_size": self.chunk,
            "capacity_bytes": self.num_chunks * self.chunk_bytes,
            "capacity_blocks": self.num_chunks,
            "hits_tokens": s.hits,
            "queries_tokens": s.queries,
            "stored_blocks": c.stored,
            "evicted_blocks": c.evicted,
            "failed_stores": s.failed_stores,
            "mean_used_bytes": (split.used / span * self.chunk_bytes) if span > 0 else 0.0,
            **fracs,
            "load_bytes": s.load_tokens * self.token_bytes,
            "store_bytes": s.store_tokens * self.token_bytes,
            "load_time_s": s.load_time_s,
            "store_time_s": s.store_time_s,
            "mean_load_wait_s": sum(loads) / len(loads) if loads else 0.0,
        }
