"""What the engine asks of its KV manager, and the small records they exchange.

The engine schedules: admission order, the token budget, preemption, time. The KV
manager is the only thing that knows memory. One protocol fits the dense
allocators in slots (:class:`fragsim.kv.dense.DenseKV`, with block sharing where
its allocator can fork) and the hybrid managers in bytes
(:class:`fragsim.kv.hybrid.HybridKV`)::

    engine                                   KV manager
    ------                                   ----------
    which requests could ever fit            fits_alone(prompt, output)
    tokens to place at admission             admission_tokens(prompt, output, context)
    a prefix-cache hit (if it caches)        prefix.lookup(req, prompt, context)
    admit a request's sequences              admit(seqs, tokens, final, prompt, hit)
    why it did not fit                       blocked_by_fragmentation(tokens)
    room for the next token                  grow(seq, target), grow_many(seqs, targets)
    forget a sequence                        free(seq)
    a stretch of decode steps                stretch(rows, k, head_tokens), record_steps(...)
    where the memory went this step          record(...), split(...)

A sequence's *room* is the longest length it can reach without asking again: the
slots it owns (dense), or the length at which a hybrid manager next moves a block
(a window's block falls out, or a new block is needed). The engine asks for growth
only when a sequence's next token passes its room.

Units: ``unit`` names what ``capacity`` and the split are counted in, ``"slots"``
(one token of every layer) or ``"bytes"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from fragsim.engine_config import EngineConfig
from fragsim.metrics import Recorder


@dataclass(frozen=True)
class Hit:
    """A prefix-cache hit: ``tokens`` leading tokens found cached (whole blocks), and
    what the manager needs to place them (``detail``: its own)."""

    tokens: int
    detail: Any = None


class Admitted(NamedTuple):
    """What an admission placed: each sequence's room, and the slots the new
    sequences share among themselves (a request's samples over its prompt), which a
    prefilling request's once-counted stored tokens do not count twice."""

    rooms: tuple[int, ...]
    shared: int = 0


@dataclass
class StretchMemory:
    """The memory side of a stretch of decode steps: how many of the asked steps fit
    (``k``), each row's room after them, and what ``record_steps`` needs to record
    them (``per_step``: the manager's own per-step arrays)."""

    k: int
    rooms: np.ndarray | None = None
    per_step: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Rows:
    """The decoding sequences a stretch advances, as arrays (the engine's batch):
    sequence ids, request ids (arrival order), tokens stored at the stretch's start,
    rooms and final lengths."""

    seqs: np.ndarray
    reqs: np.ndarray
    filled: np.ndarray
    rooms: np.ndarray
    finals: np.ndarray


class LiveView(Protocol):
    """The sequences holding memory now, as the engine sees them (it passes itself)."""

    def seqs(self) -> np.ndarray:
        """Their ids: the decoding rows', then each prefilling request's first, then
        those of finished requests kept for their KV to be read elsewhere."""

    def computed(self) -> np.ndarray:
        """Tokens each has stored, in the order of :meth:`seqs`."""

    def receiving(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids, tokens stored) of the sequences placed ahead of KV still arriving;
        None: none."""


class PrefixCache(Protocol):
    """Prefix caching, where a KV manager has it (its ``prefix``; None without)."""

    def keys(self, req: int, prompt_len: int) -> list[int]: ...

    def lookup(self, req: int, prompt_len: int, context: int) -> Hit: ...

    def cache(self, req: int, prompt_len: int, computed: int) -> None:
        """Register the full prompt blocks of the first ``computed`` tokens (the end of
        the step that computed them)."""

    def forget(self, req: int) -> None: ...

    def summary(self) -> dict[str, Any]: ...


class KVManager(Protocol):
    """The engine's KV manager (see the module docstring)."""

    name: str
    unit: str
    capacity: int
    block_size: int
    grows_on_demand: bool
    prefix: PrefixCache | None
    #: slots Σ over sequences counts more than once (block sharing); 0 without sharing
    shared_slots: int
    #: the manager's own free count, for the recorder to compare (None: nothing to compare)
    free_probe: Callable[[], int] | None
    #: whether stretches back off after stalls (:class:`fragsim.stretch.Backoff`)
    backs_off: bool

    def validate(self, config: EngineConfig) -> None:
        """Raise ValueError, naming what, when the engine's modes need what it lacks."""

    def fits_alone(self, prompt: np.ndarray, output: np.ndarray, width: int) -> np.ndarray: ...

    def admission_tokens(self, prompt: int, output: int, context: int) -> int: ...

    def admit(self, seqs: Sequence[int], tokens: int, final: int, prompt: int,
              hit: Hit | None, external: int = 0) -> Admitted | None:
        """Place a request's sequences for ``tokens`` tokens past its ``hit``; the next
        ``external`` tokens' KV will arrive from elsewhere (a manager may then place only
        what reading past them needs). None: no room, nothing changed."""

    def blocked_by_fragmentation(self, tokens: int) -> bool: ...

    def held_units(self, held: dict[int, int], live: LiveView) -> tuple[int, int]:
        """(tokens stored, units only they hold, not shared with a sequence of ``live``
        still running) of the sequences kept past their request's end for a connector
        (``held``: sequence -> stored length): the split's ``held`` part
        (:class:`fragsim.metrics.Recorder`)."""

    def room(self, seq: int) -> int: ...

    def grow(self, seq: int, target: int) -> int | None: ...

    def grow_many(self, seqs: list[int], targets: list[int], rooms: Sequence[int],
                  finals: Sequence[int]) -> list[int] | None:
        """Every sequence grown to its target at once, all or none (None: not now, or
        no batched growth); ``rooms`` and ``finals``: the engine's view of them."""

    def free(self, seq: int) -> int: ...

    def stretch(self, rows: Rows, k: int, head_tokens: int | None, stalled: bool) -> StretchMemory:
        """Up to ``k`` decode steps of ``rows``: as many as memory surely allows (and,
        with ``head_tokens`` waiting, none past a step that might let that request in);
        ``stalled``: the last stretch could not take a step."""
        ...

    def record(self, rec: Recorder, now: float, dt: float, stored: int, live: LiveView,
               running: int, waiting: int) -> None:
        """The split held for ``dt`` from ``now``, ``stored`` stored tokens (each once)."""

    def record_steps(self, rec: Recorder, memory: StretchMemory, now: float, dts: np.ndarray,
                     stored: np.ndarray, running: int, waiting: np.ndarray) -> None: ...

    def split(self, stored: int, live: LiveView) -> tuple[int, int, int, int]:
        """(token states, reservation, everything else held, free) now."""

    def check(self, live: LiveView) -> None:
        """The manager's own invariants, and its kept sums against every sequence's."""

    def summary(self) -> dict[str, Any]: ...

    def sample_units(self, filled: dict[int, int]) -> np.ndarray:
        """The pool's units now, each marked with who holds it (address maps)."""

    def address_map(self, times: list[float], rows: list[np.ndarray]) -> dict[str, Any]: ...
