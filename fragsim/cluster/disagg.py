"""Prefill/decode disaggregation: a request's prompt runs on a prefill instance, its KV
moves to a decode instance over a link, and the decode instance generates the answer.

Both sides follow vLLM's ``NixlConnector`` (on which llm-d's P/D runs), as the
engine's KV connector (:mod:`fragsim.connector`):

prefill side (:class:`PrefillSide`)
    The request runs with one output token (the proxy's ``max_tokens=1``). When it
    finishes, its blocks stay held (vLLM: ``delay_free_blocks``) until the decode side
    has read them, and the request is handed to its decode instance, which sees it at
    that instant (:meth:`RequestTable.hand_in
    <fragsim.request_table.RequestTable.hand_in>`).
decode side (:class:`DecodeSide`)
    The request queues there like any other. Once admitted, its blocks for the whole
    prompt are placed: the KV is reserved as the transfer starts. Its own prefix-cache
    hit is not moved; the rest is (whole blocks), while the request waits (vLLM:
    ``WAITING_FOR_REMOTE_KVS``). When it lands, the prefill side frees its copy at its
    next step, and the request computes the prompt's last token again, which gives the
    first output token. On an idle cluster, then::

        TTFT = prefill + latency + moved tokens × bytes per token per GPU / bandwidth + first step

The link (:class:`KVLink`): every instance has one port, each GPU its own NIC, so a
transfer's bytes move over as many NICs at once as the smaller side has GPUs, each
at the link's bandwidth. A transfer
waits the base latency, takes the sender's port, then the receiver's (always in that
order, so no two transfers wait on each other), and holds both for its bytes over the
bandwidth: transfers that share a port queue for it, first come, first served.

Where the bytes are while a request changes instance, cluster-wide (:meth:`KVLink.summary`):
*sending*, the prefill side's blocks held for a transfer (before and while it runs);
*receiving*, the decode side's blocks reserved for a transfer that has not landed;
*duplicated*, bytes present at both ends: a transfer's bytes arrive at an even rate
while it holds the ports, and are duplicated from arrival until the prefill side
frees its copy.

Hybrid models (a hybrid KV manager on every instance) move what each layer kind
reads, as vLLM 0.33's NixlConnector does with its hybrid allocator: the decode side
places, per group, only the blocks its first step reads past the arriving KV (a
window's, a chunk's; one state per state layer: ``num_external_computed_tokens``),
and those blocks cross, whole (``bytes_<kind>`` in :meth:`KVLink.table`). The
prefill side keeps the same blocks of a finished request and frees the rest at once,
as vLLM frees out-of-window blocks before ``request_finished``. Where vLLM's prefill
stops one token short for a state model, here it computes the whole prompt; the
decode side recomputes the last token in both.

How long the prefill side keeps an unread copy: vLLM 0.33 keeps it under a lease
(``kv_lease_duration``, 30 s) that the decode side renews every 5 s while the request
waits in its queue, and frees it at once when the decode side aborts the request
unscheduled; the lease runs out only when a decode instance stops answering. Instances
here do not fail, so a copy lives until it is read, or until its decode side refuses
the request (:meth:`KVLink.drop`).

Layer-wise overlap (``--kv-transfer-layerwise``) is a push flow instead, whose decode
side reserves before the prefill runs and whose prefill pushes each layer's KV as it
computes it (:mod:`fragsim.cluster.layerwise`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import simpy

from fragsim.cluster.layerwise import Stream, run_push
from fragsim.connector import HeldBlocks
from fragsim.request_table import REFUSED


@dataclass(eq=False)
class Handoff:
    """One request's KV on its way from a prefill instance to a decode instance."""

    req: int
    sender: int
    receiver: int
    tokens: int                 # tokens whose blocks move (whole blocks)
    bytes: int                  # every GPU's share
    units: int                  # what the receiver reserved for them, in its KV manager's unit
    by_kind: dict[str, int]     # bytes by layer kind (a hybrid KV manager; else empty)
    seconds: float              # on the ports
    ready: float                # when the decode side reserved its blocks and asked
    latency: float
    start: float | None = None  # when it held both ports
    end: float | None = None    # known once it holds both ports (a push: for its last piece)
    stream: Stream | None = None  # a layer-wise push's pieces (None: pulled at once)


def _next_done(jobs: Any) -> float | None:
    """The earliest time one of ``jobs`` lands, of those that hold their ports (None:
    none does; the link wakes both ends when one takes its ports)."""
    return min((job.end for job in jobs if job.end is not None), default=None)


class KVLink:
    """The instances' ports and the transfers between them (see the module docstring)."""

    def __init__(self, bandwidth: float, latency_s: float, token_bytes: list[int], tp: list[int],
                 block_size: int, num_layers: list[int] | None = None) -> None:
        """``token_bytes``: one token's KV on each instance, every GPU together; ``tp``:
        each instance's GPUs; ``num_layers``: each instance's layers, for layer-wise pushes
        (:mod:`fragsim.cluster.layerwise`; None: every transfer is pulled)."""
        if bandwidth <= 0:
            raise ValueError(f"--kv-transfer-bandwidth must be > 0, got {bandwidth / 1e9:g} GB/s")
        if latency_s < 0:
            raise ValueError(f"--kv-transfer-latency-ms must be >= 0, got {latency_s * 1e3:g}")
        self.bandwidth, self.latency = bandwidth, latency_s
        self.token_bytes, self.tp, self.block = token_bytes, tp, block_size
        self.num_layers = num_layers
        self.env: simpy.Environment | None = None
        self.ports: list[simpy.Resource] = []
        self.senders: dict[int, PrefillSide] = {}
        self.receivers: dict[int, DecodeSide] = {}
        self.pokes: dict[int, Callable[[], None]] = {}  # instance -> wake its engine
        self.done: list[Handoff] = []
        self.dropped = 0            # copies freed unread (the decode side refused the request)
        self.receiving = 0.0        # ∫ units reserved for transfers not landed dt (slots or bytes)
        self.duplicated = 0.0       # ∫ duplicated units dt

    def bind(self, env: simpy.Environment, num_instances: int) -> None:
        self.env = env
        self.ports = [simpy.Resource(env, capacity=1) for _ in range(num_instances)]

    def send(self, req: int, sender: int, receiver: int, tokens: int, now: float,
             payload: tuple[int, dict[str, int]] | None = None) -> Handoff:
        """Move ``tokens`` tokens' blocks of ``req`` (the decode side reserved them now).
        ``payload``: (what the receiver reserved, in its KV manager's unit; bytes of every
        GPU by layer kind), where a hybrid KV manager placed only what each kind needs;
        None: every layer's whole blocks, ``tokens`` slots reserved."""
        job = self._job(req, sender, receiver, tokens, now, payload)
        self.senders[sender].jobs[req] = job
        self.process(self._run(job))
        return job

    def push(self, req: int, sender: int, receiver: int, tokens: int, now: float,
             payload: tuple[int, dict[str, int]] | None, first: int) -> Handoff:
        """As :meth:`send`, for positions ``[first, first + tokens)`` that the prefill
        instance ``sender`` will push layer by layer as it computes them (it has not
        started: it waited for this reservation)."""
        job = self._job(req, sender, receiver, tokens, now, payload)
        # A hybrid model's full-attention bytes stream with the prompt; the rest go last.
        streamed = job.by_kind.get("full", 0) if job.by_kind else job.bytes
        assert self.env is not None
        job.stream = Stream(simpy.Store(self.env), first, first + tokens, float(streamed),
                            float(job.bytes - streamed))
        self.senders[sender].reserved(req, job)
        self.process(run_push(self, job))
        return job

    def process(self, gen: Generator[simpy.Event, Any, None]) -> None:
        assert self.env is not None, "bind() the link first"
        self.env.process(gen)

    def _job(self, req: int, sender: int, receiver: int, tokens: int, now: float,
             payload: tuple[int, dict[str, int]] | None) -> Handoff:
        by_kind: dict[str, int] = {}
        if payload is None:
            moved = -(-tokens // self.block) * self.block
            units, size = tokens, moved * self.token_bytes[sender]
        else:
            (units, by_kind), size = payload, sum(payload[1].values())
        # Each GPU its own NIC: as many move at once as the smaller side has.
        lanes = min(self.tp[sender], self.tp[receiver])
        return Handoff(req, sender, receiver, tokens, size, units, by_kind, size / (lanes * self.bandwidth),
                       now, self.latency)

    def drop(self, req: int, sender: int, now: float) -> None:
        """The decode side refused ``req``: its prefill side frees its copy unread."""
        job = Handoff(req, sender, -1, 0, 0, 0, {}, 0.0, now, 0.0, now, now)
        self.senders[sender].jobs[req] = job
        self.pokes[sender]()

    def _run(self, job: Handoff) -> Generator[simpy.Event, Any, None]:
        env = self.env
        assert env is not None
        if job.latency:
            yield env.timeout(job.latency)
        with self.ports[job.sender].request() as send:
            yield send
            with self.ports[job.receiver].request() as receive:
                yield receive
                job.start = float(env.now)
                job.end = job.start + job.seconds
                self.pokes[job.sender]()  # both ends now know when it lands
                self.pokes[job.receiver]()
                yield env.timeout(job.seconds)

    def freed(self, job: Handoff, now: float) -> None:
        """The prefill side freed its copy at ``now``: the transfer is over."""
        assert job.start is not None and job.end is not None
        if job.receiver < 0:
            self.dropped += 1
            return
        if job.stream is None:
            self.duplicated += job.units * ((job.end - job.start) / 2 + (now - job.end))
        else:  # each piece at an even rate over its own time on the ports
            self.duplicated += sum(job.units * size / job.bytes * ((end - start) / 2 + (now - end))
                                   for start, end, size in job.stream.spans)
        self.done.append(job)

    def table(self) -> Any:
        """One row per transfer that landed: who, how much, and when."""
        import pandas as pd

        done = self.done
        kinds = list(dict.fromkeys(kind for job in done for kind in job.by_kind))
        return pd.DataFrame({
            "request_id": [job.req for job in done],
            "sender": [job.sender for job in done],
            "receiver": [job.receiver for job in done],
            "tokens": [job.tokens for job in done],
            "bytes": [job.bytes for job in done],
            **{f"bytes_{kind}": [job.by_kind.get(kind, 0) for job in done] for kind in kinds},
            "reserved_s": [job.ready for job in done],
            "start_s": [job.start for job in done],
            "end_s": [job.end for job in done],
        })

    def summary(self, span: float) -> dict[str, Any]:
        """The cluster's transfer figures (means over ``span`` seconds, in slots)."""
        done = self.done
        by_kind: dict[str, int] = {}
        for job in done:
            for kind, size in job.by_kind.items():
                by_kind[kind] = by_kind.get(kind, 0) + size
        return {
            "num_kv_transfers": len(done),
            "num_kv_dropped": self.dropped,
            "kv_transfer_bytes": int(sum(job.bytes for job in done)),
            "mean_kv_transfer_bytes": sum(job.bytes for job in done) / len(done) if done else 0.0,
            **({"kv_transfer_bytes_by_kind": by_kind} if by_kind else {}),
            "mean_kv_transfer_s": sum(job.seconds for job in done) / len(done) if done else 0.0,
            "mean_kv_transfer_wait_s":
                sum((job.end or 0.0) - job.ready for job in done) / len(done) if done else 0.0,
            "mean_kv_receiving_slots": self.receiving / span if span > 0 else 0.0,
            "mean_kv_duplicated_slots": self.duplicated / span if span > 0 else 0.0,
        }


class PrefillSide:
    """The connector of a prefill instance (see the module docstring)."""

    host_pool = None
    decode_chunk = None   # stores nothing of its own
    sends_kv = True  # what it holds is KV waiting to be read (the split's sending part)

    def __init__(self, link: KVLink, index: int, hand_off: Callable[[int, int, float], None],
                 keep: Callable[[int, int], None] | None = None) -> None:
        """``keep(seq, req)``: a finished request's blocks stay for the decode side to
        read; those it will not read go back (a hybrid KV manager's window)."""
        self.link, self.index, self.hand_off, self.keep = link, index, hand_off, keep
        link.senders[index] = self
        self.held = HeldBlocks()
        self.jobs: dict[int, Handoff] = {}  # req -> its transfer, once the decode side asked
        self.awaiting: set[int] = set()     # pushes whose decode side has not reserved yet
        self.pushes: dict[int, Handoff] = {}  # pushes reserved, until their prefill ends
        self.env: simpy.Environment | None = None
        self.now = 0.0

    @property
    def busy(self) -> bool:
        return bool(self.held) or bool(self.awaiting)

    def expect_push(self, req: int) -> None:
        """``req`` runs here once its decode side has reserved (:meth:`reserved`)."""
        self.awaiting.add(req)

    def reserved(self, req: int, job: Handoff) -> None:
        """``req``'s decode side reserved its blocks: its prefill may run and push."""
        self.awaiting.remove(req)
        self.pushes[req] = job
        self.link.pokes[self.index]()

    def pending_at_end(self) -> bool:
        return bool(self.held)  # its copies must last until they are read

    def bind(self, env: simpy.Environment) -> None:
        self.env = env
        self.now = float(env.now)

    def probe(self, req: int, prompt: int, context: int, gpu_hit: int) -> int | None:
        """Nothing comes in here; a push waits for its decode side's reservation."""
        return None if req in self.awaiting else 0

    def start_load(self, req: int, prompt: int, context: int, gpu_hit: int, now: float,
                   load: bool = True) -> int:
        """A push starts: what this instance had cached is ready now."""
        job = self.pushes.get(req)
        if job is not None:
            assert job.stream is not None and job.stream.pos is None, "a push's prefill ran twice"
            job.stream.feed(gpu_hit, now, 0.0)
        return 0

    def store(self, req: int, prompt: int, computed: int, now: float) -> None:
        """A push sends what this step computed, layer by layer over the step (it
        started at the environment's time: an engine runs ahead to its step's end)."""
        self.now = now
        job = self.pushes.get(req)
        if job is not None:
            assert job.stream is not None and self.env is not None
            start = float(self.env.now)
            job.stream.feed(computed, start, now - start)

    def must_hold(self, req: int) -> bool:
        return True  # every request here hands its KV on

    def hold(self, req: int, seq: int) -> None:
        if self.keep is not None:
            self.keep(seq, req)
        self.held.hold(req, seq)
        if req in self.pushes:
            self.jobs[req] = self.pushes.pop(req)

    def finish(self, req: int, now: float) -> None:
        if req not in self.jobs:  # a push is under way already
            self.hand_off(req, self.index, now)

    def poll(self, now: float, free: Callable[[int], Any]) -> tuple[list[int], bool]:
        """Free the copies whose transfers landed by ``now``."""
        self.now = now
        landed = [job for job in self.jobs.values() if job.end is not None and job.end <= now]
        freed = False
        for job in landed:
            del self.jobs[job.req]
            freed |= self.held.release(job.req, free)
            self.link.freed(job, now)
        return [], freed

    def next_done(self) -> float | None:
        return _next_done(self.jobs.values())

    def check(self) -> None:
        assert all(req in self.held for req in self.jobs), "a transfer from blocks no longer held"
        assert not self.awaiting & set(self.pushes), "a push both reserved and waiting for it"

    def close(self, now: float) -> None:
        assert not self.held, "a prefill instance ended with copies unread"
        assert not self.awaiting and not self.pushes, "a prefill instance ended with pushes not run"


class DecodeSide:
    """The connector of a decode instance (see the module docstring)."""

    host_pool = None
    decode_chunk = None   # stores nothing of its own
    sends_kv = False

    def __init__(self, link: KVLink, index: int, requests: Any,
                 payload: Callable[[int, int, int], tuple[int, dict[str, int]]] | None = None) -> None:
        """``payload(req, first, last)``: what moving positions ``[first, last)`` of
        ``req`` into its placed blocks takes (:meth:`KVLink.send`); None: whole blocks."""
        self.link, self.index, self.requests, self.payload = link, index, requests, payload
        link.receivers[index] = self
        self.remote: dict[int, int] = {}      # req -> its prefill instance, until admitted
        self.pushed: set[int] = set()         # of those, the ones it pushes layer by layer
        self.loading: dict[int, Handoff] = {}
        self.env: simpy.Environment | None = None
        self.now = 0.0

    @property
    def busy(self) -> bool:
        return bool(self.loading)

    def pending_at_end(self) -> bool:
        return False

    def bind(self, env: simpy.Environment) -> None:
        self.env = env
        self.now = float(env.now)

    def expect(self, req: int, sender: int, push: bool = False) -> None:
        """``req``'s prompt ran on instance ``sender``; its KV is there (``push``: its
        prompt runs there once this side has reserved, and its KV comes layer by layer)."""
        self.remote[req] = sender
        if push:
            self.pushed.add(req)

    def probe(self, req: int, prompt: int, context: int, gpu_hit: int) -> int | None:
        """What its prefill side holds past the prefix hit (the transfer starts once the
        blocks are placed)."""
        return context - gpu_hit if req in self.remote else 0

    def start_load(self, req: int, prompt: int, context: int, gpu_hit: int, now: float,
                   load: bool = True) -> int:
        """``req``'s blocks are placed: move what its own prefix hit lacks (a request
        that recomputes after a preemption here moves nothing: its prefill side's copy
        is gone)."""
        self.now = now
        if not load:
            return 0
        sender = self.remote.pop(req, None)
        if sender is None:
            return 0
        tokens = context - gpu_hit
        assert tokens > 0, "a prefix hit always leaves the last token to compute"
        payload = self.payload(req, gpu_hit, context) if self.payload is not None else None
        if req in self.pushed:
            self.pushed.remove(req)
            self.loading[req] = self.link.push(req, sender, self.index, tokens, now, payload, gpu_hit)
        else:
            self.loading[req] = self.link.send(req, sender, self.index, tokens, now, payload)
        return tokens

    def poll(self, now: float, free: Callable[[int], Any]) -> tuple[list[int], bool]:
        """The requests whose KV landed by ``now``; the prefill side of one refused here
        (too large, or past the queue timeout) frees its copy."""
        self.now = now
        status = self.requests.status
        for req in [req for req in self.remote if status[req] == REFUSED]:
            assert req not in self.pushed, "a push is routed only where both sides serve it"
            self.link.drop(req, self.remote.pop(req), now)
        ready = [req for req, job in self.loading.items() if job.end is not None and job.end <= now]
        for req in ready:  # reserved until now, when the engine fills the blocks
            job = self.loading.pop(req)
            self.link.receiving += job.units * (now - job.ready)
        return ready, False

    def store(self, req: int, prompt: int, computed: int, now: float) -> None:
        self.now = now

    def must_hold(self, req: int) -> bool:
        return False

    def hold(self, req: int, seq: int) -> None:
        raise AssertionError("a decode instance holds nothing past a request")

    def finish(self, req: int, now: float) -> None:
        self.now = now

    def next_done(self) -> float | None:
        return _next_done(self.loading.values())

    def check(self) -> None:
        assert not set(self.remote) & set(self.loading), "a request both expected and loading"
        assert self.pushed <= set(self.remote), "a push expected but not remote"

    def close(self, now: float) -> None:
        assert not self.loading, "a decode instance ended with transfers in flight"
