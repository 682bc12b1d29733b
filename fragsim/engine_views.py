"""What can be read off a running engine without changing it.

It owns the step observer protocol (what follows a run step by step, such as the
GPU backend) and the views such a follower reads: every sequence holding KV memory
now (:class:`LiveSequence`), the memory split now, the prefix-cache counts, and
the address-map samples of the pool's units over a run. The engine
(:mod:`fragsim.engine`) decides; nothing here writes to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from fragsim.engine import Engine
    from fragsim.kv.protocol import KVManager


class StepObserver(Protocol):
    """Something that follows the run step by step (the GPU backend, a tracer)."""

    def before_step(self, engine: Engine, dt: float) -> None:
        """Called once a step's decisions are made, before its time passes."""

    def after_step(self, engine: Engine) -> None:
        """Called at the end of each step, after growth and completions."""


@dataclass(frozen=True)
class LiveSequence:
    req: int
    filled: int      # tokens stored now
    final: int       # prompt + output
    decoding: bool
    seq_id: int      # the KV manager's sequence id (the request's own for its first)
    cached: int = 0  # leading positions found in the prefix cache at its admission (not its writes)


def live_sequences(engine: Engine) -> list[LiveSequence]:
    """Every sequence holding KV memory now, with what it has stored (the observer's view)."""
    b, g, cached = engine.batch, engine.g, engine.requests.cached
    out = [LiveSequence(int(r), int(min(o + g, f)), int(f), True, int(s), int(cached[r]) if s == r else 0)
           for r, o, f, s in zip(b.req[: b.n], b.offset[: b.n], b.final[: b.n], b.seq[: b.n],
                                 strict=True)]
    for p in engine.prefilling:
        final = int(engine.requests.final[p.req])
        out.append(LiveSequence(p.req, p.done, final, False, p.req, p.cached))
        # The other sequences of a prefilling group store nothing of their own yet.
        out += [LiveSequence(p.req, 0, final, False, seq) for seq in p.seqs[1:]]
    return out


def memory_split(engine: Engine) -> tuple[int, int, int, int]:
    """(token_states, reservation, internal, free) right now, in the KV manager's unit."""
    b = engine.batch
    stored = int(np.minimum(b.offset[: b.n] + engine.g, b.final[: b.n]).sum()) \
        + sum(p.done for p in engine.prefilling) \
        - (engine.duplicate_stored() if engine.kv.shared_slots else 0)
    return engine.kv.split(stored, engine)


def prefix_cache_stats(engine: Engine) -> dict[str, float]:
    """Prefix-cache counts in vLLM's names, in tokens (all 0 without prefix caching)."""
    queries, hits = engine.num_prefix_queries, engine.num_prefix_hits
    return {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0}


class AddressMapSampler:
    """The KV manager's units, sampled every ``interval_s`` of simulated time (None:
    never) from ``start``, each sample binned to ``bins`` (a bin shows its first unit)."""

    def __init__(self, kv: KVManager, interval_s: float | None, bins: int, start: float) -> None:
        self.kv, self.interval_s, self.bins = kv, interval_s, bins
        self.next = start
        self.times: list[float] = []
        self.rows: list[np.ndarray] = []

    def due(self, now: float) -> bool:
        return self.interval_s is not None and now >= self.next

    def sample(self, now: float, filled: dict[int, int]) -> None:
        """The units at ``now``; ``filled``: tokens stored by each live sequence."""
        units = self.kv.sample_units(filled)
        bins = min(len(units), self.bins)
        self.times.append(now)
        self.rows.append(units[(np.arange(bins) * len(units)) // bins])
        self.next = now + (self.interval_s or 1.0)

    def address_map(self) -> dict[str, Any] | None:
        """Sampled owners of the pool's units over time (:meth:`KVManager.address_map`)."""
        if not self.times:
            return None
        return self.kv.address_map(self.times, self.rows)
