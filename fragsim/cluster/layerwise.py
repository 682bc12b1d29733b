"""Layer-wise overlap (``--kv-transfer-layerwise``): the prefill instance pushes each
layer's KV to the decode instance as it computes that layer, so the transfer runs
beside the prefill instead of after it (Mooncake, DistServe, LMCache's layer-wise mode).

A push needs somewhere to write before the first layer is computed, so the decode side
reserves first. At the request's arrival the router hands it to its decode instance at
once, besides sending it to its prefill instance; the decode instance queues it and
admits it as any other request (its FCFS order, limits and room rule that), placing the
blocks the transfer fills. The prefill instance skips the request at admission until
that reservation exists: with the decode pool full, the prefill waits. A request either
instance can never serve (too long, too large for its pool) goes by the pull flow, whose
refusals free what was held (:mod:`fragsim.cluster.disagg`). Reserving at arrival
rather than at the prefill's admission keeps the decode pool under its own scheduler,
at its own steps, as for any request; the price is that the blocks are held while the
request waits in the prefill queue too, and that a prefill starts no sooner than the
decode instance's next step.

What the link carries and when. A prefill step computes its layers one after another,
each in ``1/L`` of the step (``L`` layers). Every chunk of a prompt streams as computed,
not only the last: each step of a chunked prefill sends its chunk's KV layer by layer,
and the positions the prefill instance had cached go at its admission (``dt = 0``).
A chunk's bytes are its share of the transfer by tokens; a hybrid model's full-attention
bytes stream so, its window, chunk and state bytes go with the last chunk (they are
final only then). For a chunk whose step starts at ``t`` and lasts ``dt``, taking
``s`` seconds on the link, its layer ``j`` is ready at ``t + j·dt/L`` and the link
sends one layer after another, so with the link free from ``F`` its last byte lands at::

    F' = max(F + s,  t + lat + dt/L + s,  t + lat + dt + s/L)

(the latest of ``t + lat + j·dt/L + (L - j + 1)·s/L`` over ``j`` is at ``j = 1`` or
``j = L``). Each chunk holds the sender's then the receiver's port for its ``s`` seconds
only, the last ``s`` before ``F'``: another transfer may use the ports in between, and a
chunk that finds them taken starts when they free (``F'`` = then + ``s``). A piece never
starts before that window, even on idle ports: a NIC interleaving several pushes would
send their layers meanwhile, so under a loaded link this is pessimistic. Every layer
carries the same share of a piece (for a hybrid model, an average over its kinds).
One prompt in one step on an idle link, ``W`` seconds of bytes::

    TTFT = lat + max(prefill + W/L, prefill/L + W) + first step

prefill-bound (``W <= prefill``) ``prefill + lat + W/L + first step``, link-bound
``prefill/L + lat + W + first step``. The pull flow's ``prefill + lat + W + first step``
is never less.

The memory cost: the decode side's blocks are reserved (the split's *receiving*) from
its admission, before the prefill runs, until the last byte lands; the prefill side's
copy is freed once the push has landed, as in the pull flow.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Piece:
    """KV a prefill step made ready for a push: from ``start``, over ``compute`` seconds,
    one layer after another (0: all at once)."""

    start: float
    compute: float
    size: float                 # bytes
    last: bool


@dataclass(eq=False)
class Stream:
    """One push's pieces, fed as its prefill computes them (:meth:`feed`)."""

    queue: Any                  # a simpy.Store of Pieces
    first: int                  # positions [first, last) cross
    last: int
    streamed: float             # bytes that go chunk by chunk, in proportion to tokens
    tail: float                 # bytes that go with the last chunk
    pos: int | None = None      # positions computed so far (None: the prefill not admitted)
    sent: float = 0.0           # streamed bytes fed so far
    spans: list[tuple[float, float, float]] = field(default_factory=list)  # (start, end, bytes) on the ports

    def feed(self, upto: int, start: float, compute: float) -> None:
        """The prefill has positions ``[pos, upto)`` ready from ``start``, over ``compute``
        seconds (the step computing them)."""
        lo = self.first if self.pos is None else max(self.pos, self.first)
        self.pos = upto
        last = upto >= self.last
        if last:
            size, self.sent = self.streamed - self.sent + self.tail, self.streamed
        else:
            size = self.streamed * max(0, min(upto, self.last) - lo) / (self.last - self.first)
            self.sent += size
        if size > 0 or last:
            self.queue.put(Piece(start, compute, size, last))


def lands(piece: Piece, seconds: float, latency: float, num_layers: int) -> float:
    """When ``piece``'s last byte lands on a link free from its first layer on (see the
    module docstring)."""
    return latency + max(piece.start + piece.compute / num_layers + seconds,
                         piece.start + piece.compute + seconds / num_layers)


def run_push(link: Any, job: Any) -> Generator[Any, Any, None]:
    """A push on ``link`` (a :class:`~fragsim.cluster.disagg.KVLink`): each piece holds
    the sender's port, then the receiver's, for its bytes, as late as its layers allow
    or once the ports free."""
    env, stream = link.env, job.stream
    rate = job.bytes / job.seconds if job.seconds else 1.0
    layers = link.num_layers[job.sender]
    while True:
        piece = yield stream.queue.get()
        seconds = piece.size / rate
        begin = lands(piece, seconds, job.latency, layers) - seconds
        if begin > env.now:
            yield env.timeout(begin - env.now)
        with link.ports[job.sender].request() as send:
            yield send
            with link.ports[job.receiver].request() as receive:
                yield receive
                now = float(env.now)
                if job.start is None:
                    job.start = now
                stream.spans.append((now, now + seconds, piece.size))
                if piece.last:  # both ends now know when it lands
                    job.end = now + seconds
                    link.pokes[job.sender]()
                    link.pokes[job.receiver]()
                yield env.timeout(seconds)
        if piece.last:
            return
