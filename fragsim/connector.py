"""What the engine asks of a KV connector: KV that arrives from, or leaves for,
somewhere other than the instance's own GPU pool.

vLLM gives its scheduler one connector slot (``--kv-transfer-config``) for both jobs
that move KV across an instance's edge: an offload tier below the GPU pool
(:class:`fragsim.offload.connector.OffloadConnector`) and prefill/decode
disaggregation, where a prefill instance's KV moves to a decode instance
(:mod:`fragsim.cluster.disagg`). The engine (:mod:`fragsim.engine`) calls it at the
same points vLLM's scheduler calls its connector's scheduler side:

===========================  ===============================================================
admission, after the GPU     :meth:`~KVConnector.probe`: tokens it can supply past the GPU
prefix-cache hit             hit, or None to skip the request this step; once the request's
                             blocks are placed, :meth:`~KVConnector.start_load` starts
                             moving them in and returns how many tokens the request waits
                             for (vLLM: ``WAITING_FOR_REMOTE_KVS``)
end of a step                :meth:`~KVConnector.store`: prompt tokens computed by now, and
                             with ``decode_chunk`` set, decode tokens at every multiple of it
a request finishes           :meth:`~KVConnector.must_hold` / :meth:`~KVConnector.hold`: its
                             blocks outlive it while something still reads them (vLLM:
                             ``delay_free_blocks``); :meth:`~KVConnector.finish`
start of a step              :meth:`~KVConnector.poll`: transfers that landed by now; held
                             blocks are freed
idle                         :meth:`~KVConnector.next_done`: when the next transfer lands
===========================  ===============================================================

:class:`HeldBlocks` keeps the sequences a connector holds past their request's end,
by request, until it frees them. The engine keeps them too, with their stored length,
and its KV manager works out what part of the pool only they hold (the split's
``held`` part, :meth:`KVManager.held_units <fragsim.kv.protocol.KVManager.held_units>`). :class:`MultiConnector` puts several connectors in
the one slot (a side of a prefill/decode split over an offload tier), as vLLM's does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import simpy


class HostPool(Protocol):
    """Host memory that swap preemption takes its room from (one host pool with a tier)."""

    def swap_out(self, slots: int, now: float) -> bool:
        """Room for ``slots`` KV slots of a swapped-out sequence; False: none."""

    def swap_in(self, slots: int, now: float) -> None:
        """Give back what :meth:`swap_out` took."""


class KVConnector(Protocol):
    #: transfers in flight or blocks held: the engine steps one at a time meanwhile
    busy: bool
    #: where swap preemption takes host memory from; None: the engine's swap space
    host_pool: HostPool | None
    #: it stores decode blocks too, in chunks of this many tokens: the engine calls
    #: :meth:`store` for a decoding sequence whenever its computed tokens reach a multiple
    #: (a stretch of decode steps stops there); None: prompt tokens only
    decode_chunk: int | None

    def bind(self, env: simpy.Environment) -> None:
        """Run on ``env`` (the engine's, made when it runs)."""

    def probe(self, req: int, prompt: int, context: int, gpu_hit: int) -> int | None:
        """Tokens it holds past ``gpu_hit`` (0: none); None: skip ``req`` this step."""

    def start_load(self, req: int, prompt: int, context: int, gpu_hit: int, now: float,
                   load: bool = True) -> int:
        """``req``'s blocks are placed: start loading; returns the tokens it waits for
        (``load=False``: another connector loads it; this one only follows it)."""

    def poll(self, now: float, free: Callable[[int], Any]) -> tuple[list[int], bool]:
        """(requests whose loads all landed by ``now``, whether held blocks were freed)."""

    def store(self, req: int, prompt: int, computed: int, now: float) -> None:
        """The KV of the first ``computed`` tokens of ``req`` is in the GPU pool (end of a step)."""

    def must_hold(self, req: int) -> bool:
        """Whether ``req``'s blocks must outlive it."""

    def hold(self, req: int, seq: int) -> None:
        """Keep ``seq``'s blocks until :meth:`poll` frees them."""

    def finish(self, req: int, now: float) -> None:
        """``req`` finished at ``now``."""

    def next_done(self) -> float | None:
        """The earliest time a transfer in flight may land (None: none known)."""

    def pending_at_end(self) -> bool:
        """Whether the engine runs on once its requests are done (until this is False)."""

    def check(self) -> None:
        """Its own invariants (``check=True``)."""

    def close(self, now: float) -> None:
        """The run ended at ``now``."""


class HeldBlocks:
    """Sequences kept past their request's end, by request."""

    def __init__(self) -> None:
        self.by_req: dict[int, list[int]] = {}

    def __bool__(self) -> bool:
        return bool(self.by_req)

    def __contains__(self, req: int) -> bool:
        return req in self.by_req

    def hold(self, req: int, seq: int) -> None:
        self.by_req.setdefault(req, []).append(seq)

    def release(self, req: int, free: Callable[[int], Any]) -> bool:
        """Free ``req``'s held sequences; True if it held any."""
        seqs = self.by_req.pop(req, ())
        for seq in seqs:
            free(seq)
        return bool(seqs)


def parts(connector: Any) -> list[Any]:
    """The connectors an engine's connector slot holds (one, or a :class:`MultiConnector`'s)."""
    if connector is None:
        return []
    return list(getattr(connector, "connectors", [connector]))


class MultiConnector:
    """Several connectors in the engine's one slot, as vLLM's ``MultiConnector``
    composes them (``vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py``):
    an instance of a prefill/decode split with an offload tier, say.

    Every connector is asked at admission; the first that can supply tokens loads
    the request, and the others see it with nothing to load, so they still store its
    blocks (a decode instance's tier keeps the KV that arrived). A connector asking
    to skip the request skips it. A finished request's blocks stay until every
    connector that holds them is done with them.
    """

    def __init__(self, connectors: list[Any]) -> None:
        self.connectors = connectors
        self.host_pool = next((c.host_pool for c in connectors if c.host_pool is not None), None)
        chunks = [c.decode_chunk for c in connectors if c.decode_chunk is not None]
        self.decode_chunk = math.gcd(*chunks) if chunks else None
        self._loader: dict[int, Any] = {}    # req -> the connector that loads it
        self._holders: dict[int, int] = {}   # seq -> connectors still holding it
        self._sent: set[int] = set()         # held seqs a side of a transfer held too

    @property
    def busy(self) -> bool:
        return any(c.busy for c in self.connectors)

    def bind(self, env: simpy.Environment) -> None:
        for c in self.connectors:
            c.bind(env)

    def probe(self, req: int, prompt: int, context: int, gpu_hit: int) -> int | None:
        found = 0
        self._loader.pop(req, None)
        for c in self.connectors:
            tokens = c.probe(req, prompt, context, gpu_hit)
            if tokens is None:
                return None
            if not found and tokens > 0:
                found = tokens
                self._loader[req] = c
        return found

    def start_load(self, req: int, prompt: int, context: int, gpu_hit: int, now: float,
                   load: bool = True) -> int:
        loader = self._loader.get(req) if load else None
        tokens = 0
        for c in self.connectors:
            if loader is not None and c is loader:
                tokens = c.start_load(req, prompt, context, gpu_hit, now)
            else:
                c.start_load(req, prompt, context, gpu_hit, now, load=False)
        if not tokens:
            self._loader.pop(req, None)
        return tokens

    def poll(self, now: float, free: Callable[[int], Any]) -> tuple[list[int], bool]:
        freed = False

        def release(seq: int) -> None:
            nonlocal freed
            left = self._holders[seq] - 1
            if left:
                self._holders[seq] = left
                return
            del self._holders[seq]
            self._sent.discard(seq)
            free(seq)
            freed = True

        ready: list[int] = []
        for c in self.connectors:
            landed, _ = c.poll(now, release)
            ready += landed
        for req in ready:
            self._loader.pop(req, None)
        return ready, freed

    def store(self, req: int, prompt: int, computed: int, now: float) -> None:
        for c in self.connectors:
            c.store(req, prompt, computed, now)

    def must_hold(self, req: int) -> bool:
        return any(c.must_hold(req) for c in self.connectors)

    def hold(self, req: int, seq: int) -> None:
        holders = [c for c in self.connectors if c.must_hold(req)]
        for c in holders:
            c.hold(req, seq)
        self._holders[seq] = len(holders)
        if any(getattr(c, "sends_kv", False) for c in holders):
            self._sent.add(seq)

    def finish(self, req: int, now: float) -> None:
        for c in self.connectors:
            c.finish(req, now)

    def next_done(self) -> float | None:
        return min((t for t in (c.next_done() for c in self.connectors) if t is not None), default=None)

    def pending_at_end(self) -> bool:
        """A copy held for a transfer lasts until every connector is done with it (its
        stores too); otherwise as each connector says."""
        return bool(self._sent) or any(c.pending_at_end() for c in self.connectors)

    def check(self) -> None:
        for c in self.connectors:
            c.check()
        assert self._sent <= set(self._holders), "a sent copy no connector holds"

    def close(self, now: float) -> None:
        for c in self.connectors:
            c.close(now)
