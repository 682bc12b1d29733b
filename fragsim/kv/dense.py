"""The KV manager of the dense allocators: slots, one per token of every layer.

:class:`DenseKV` puts an allocator of :mod:`fragsim.allocators` behind the engine's
protocol (:mod:`fragsim.kv.protocol`) and keeps the totals the split is recorded
from::

    owned_total     Σ slots owned over sequences (a shared slot once per holder)
    internal_total  Σ max(0, owned − final)            never to be filled
    shared_slots    slots owned_total counts more than once (block sharing)

    token_states = Σ filled − duplicates               (the engine knows what is filled)
    owned        = owned_total − shared_slots          (physical)
    reservation  = owned − token_states − internal_total
    free         = capacity − owned

Every change of what a sequence owns goes through :meth:`DenseKV._take` with the
sequence's final length, so the totals move by exactly what the per-sequence
formula says; :meth:`DenseKV.check` recomputes them from every sequence.

A sequence's room is the slots it owns; with block sharing, a sequence whose last
block is shared has room only for what it asked for, so that its next token copies
the block first (copy-on-write). Block sharing (an allocator that can ``fork``:
parallel samples, beam search, prefix caching) is :mod:`fragsim.kv.sharing`'s: its
admission of a request's sequences and its prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fragsim.allocators import Allocator, Extent, reserve_slots
from fragsim.engine_config import EngineConfig
from fragsim.kv import dense_stretch
from fragsim.kv.protocol import Admitted, Hit, LiveView, PrefixCache, Rows, StretchMemory
from fragsim.kv.sharing import DensePrefixCache, admit_group
from fragsim.metrics import Recorder
from fragsim.prefix import PrefixKeys


class DenseKV:
    """An allocator in slots and the totals of the split; see the module docstring."""

    unit = "slots"
    #: a dense stretch that cannot take its first step costs one comparison: no back-off
    backs_off = False

    def __init__(self, allocator: Allocator, *, max_seq_len: int,
                 prefix_keys: PrefixKeys | None = None) -> None:
        self.alloc = allocator
        self.name = allocator.name
        self.capacity = int(allocator.capacity)
        self.max_seq_len = max_seq_len
        self.block_size = int(getattr(allocator, "block_size", 1) or 1)
        self.grows_on_demand = bool(allocator.grows_on_demand)
        #: whether the allocator shares blocks (reference counts, fork, copy-on-write)
        self.shares = hasattr(allocator, "fork")
        if prefix_keys is not None and not self.shares:
            raise ValueError(f"prefix caching needs a paged allocator that can share blocks, "
                             f"not {allocator.name!r}")
        self.prefix: PrefixCache | None = \
            DensePrefixCache(allocator, prefix_keys) if prefix_keys is not None else None
        self.owned_total = 0
        self.internal_total = 0
        self.shared_slots = 0
        self._final: dict[int, int] = {}
        #: the recorder compares its free count with the allocator's at every record
        self.free_probe: Callable[[], int] | None = allocator.num_free
        # The paged allocator's batched growth (all or none); others grow one by one.
        self._extend_many: Callable[[list[int], list[int]], list[int] | None] | None = \
            getattr(allocator, "extend_many", None)

    # -------------------------------------------------------------- the totals

    def _take(self, final: int, owned: int, delta: int = 1) -> None:
        """A sequence of final length ``final`` starts (``delta=1``) or stops (``-1``)
        owning ``owned`` slots."""
        self.owned_total += delta * owned
        self.internal_total += delta * max(0, owned - final)

    def _refresh(self) -> None:
        if self.shares:
            self.shared_slots = self.alloc.num_shared_slots()  # type: ignore[attr-defined]

    @property
    def physical(self) -> int:
        """Slots held, each once however many sequences hold it."""
        return self.owned_total - self.shared_slots

    def validate(self, config: EngineConfig) -> None:
        """What the engine's modes need of the allocator."""
        alloc = self.alloc
        if config.batching == "static" and self.grows_on_demand:
            raise ValueError(
                f"request-level (static) batching reserves each request's memory when its batch "
                f"forms; {alloc.name!r} grows on demand: use a reserving allocator (ft-static, "
                f"orca-*, static, contiguous, buddy) or --batching continuous")
        if config.sharing and not self.shares:
            raise ValueError(f"block sharing needs a paged allocator that can fork "
                             f"(paged-shared), got {type(alloc).__name__}")
        if config.prefix_caching != (self.prefix is not None):
            raise ValueError("prefix caching needs the trace's prefix keys with the allocator "
                             "(and only with prefix caching)")

    # ---------------------------------------------------------------- admission

    def fits_alone(self, prompt: np.ndarray, output: np.ndarray, width: int) -> np.ndarray:
        """Whether what each request must eventually hold fits the empty pool."""
        final = prompt + output
        if self.grows_on_demand and width > 1:
            # the prompt's full blocks once, then each sequence's own blocks, all diverged
            B = self.block_size
            shared = (prompt // B) * B
            need = shared + width * (-(-(final - shared) // B) * B)
        elif self.grows_on_demand:
            need = final
        else:
            policy = self.alloc.reserve
            need = (np.array([reserve_slots(policy, int(p), int(o), self.max_seq_len)
                              for p, o in zip(prompt, output, strict=True)], dtype=np.int64)
                    if policy == "pow2" else np.full(len(prompt), self.max_seq_len)
                    if policy == "max" else final)
        largest_empty = self.alloc.largest_allocatable()
        distinct = np.unique(need)
        rounded = np.array([self.alloc.rounded(int(x)) for x in distinct], dtype=np.int64)
        fits = dict(zip(distinct.tolist(), (rounded <= largest_empty).tolist(), strict=True))
        return np.array([fits[int(x)] for x in need], dtype=bool)

    def admission_tokens(self, prompt: int, output: int, context: int) -> int:
        if self.grows_on_demand:
            return context + 1
        return reserve_slots(self.alloc.reserve, prompt, output, self.max_seq_len)

    def admit(self, seqs: Sequence[int], tokens: int, final: int, prompt: int,
              hit: Hit | None, external: int = 0) -> Admitted | None:
        """Place ``tokens`` slots for the request's first sequence (its cached blocks
        first), and fork the others over its prompt; None (nothing changed) when the
        pool cannot hold them all. Every layer reads every position, so KV arriving
        from elsewhere (``external``) needs the same slots."""
        if self.shares:
            admitted = admit_group(self.alloc, seqs, tokens, prompt, hit)
            if admitted is None:
                return None
            for seq in seqs:
                self._final[seq] = final
                self._take(final, self.alloc.num_owned(seq))
            self._refresh()
            return admitted
        (seq,) = seqs
        if self.alloc.allocate(seq, tokens) is None:
            return None
        owned = self.alloc.num_owned(seq)
        self._final[seq] = final
        self._take(final, owned)
        return Admitted((owned,))

    def blocked_by_fragmentation(self, tokens: int) -> bool:
        """Whether free memory would hold ``tokens`` but no placement does (a paged pool
        that shares blocks never fragments)."""
        return not self.shares and self.alloc.num_free() >= self.alloc.rounded(tokens)

    def fork(self, parent: int, child: int, tokens: int) -> int:
        """``child`` shares the blocks of ``parent``'s first ``tokens`` positions (beam
        search); returns the child's room (the parent's may shrink: ask :meth:`room`).

        A sequence asks for growth only past its room, so the parent may have stored more
        than it asked for; it asks for its stored tokens first (no block moves: it owns
        them), so that the copy-on-write of its next token sees where it writes."""
        alloc = self.alloc
        asked = alloc.num_requested(parent)
        if asked < tokens and not alloc.extend(parent, tokens - asked):
            raise AssertionError(f"sequence {parent} could not ask for the {tokens} tokens it holds")
        alloc.fork(parent, child, tokens)  # type: ignore[attr-defined]
        final = self._final[parent]
        self._final[child] = final
        self._take(final, self.alloc.num_owned(child))
        self._refresh()
        return self.room(child)

    # ------------------------------------------------------------------ growth

    def room(self, seq: int) -> int:
        if self.shares:
            return self.alloc.room(seq)  # type: ignore[attr-defined,no-any-return]
        return self.alloc.num_owned(seq)

    def grow(self, seq: int, target: int) -> int | None:
        """Room for ``target`` tokens; the room now, or None (unchanged) when the pool
        cannot give it."""
        alloc = self.alloc
        old = alloc.num_owned(seq)
        if not alloc.extend(seq, target - alloc.num_requested(seq)):
            return None
        new = alloc.num_owned(seq)
        final = self._final[seq]
        self._take(final, new)
        self._take(final, old, -1)
        self._refresh()
        return self.room(seq) if self.shares else new

    def grow_many(self, seqs: list[int], targets: list[int], rooms: Sequence[int],
                  finals: Sequence[int]) -> list[int] | None:
        """Grow every sequence at once, all or none (None also when the allocator has no
        batched growth): their rooms now. ``rooms`` are what they owned before."""
        if self._extend_many is None:
            return None
        new = self._extend_many(seqs, targets)
        if new is None:
            return None
        d_owned = d_internal = 0
        for now_owned, before, final in zip(new, rooms, finals, strict=True):
            d_owned += now_owned - before
            if now_owned > final:  # max(0, new − final) − max(0, old − final)
                d_internal += now_owned - (before if before > final else final)
        self.owned_total += d_owned
        self.internal_total += d_internal
        return new

    def extend_all(self, seqs: list[int], totals: list[int]) -> bool:
        """Grow each sequence to its total in order, with no change to the totals (a
        stretch sets them step by step); False if any fails."""
        if self._extend_many is not None:
            return self._extend_many(seqs, totals) is not None
        alloc = self.alloc
        return all(alloc.extend(seq, total - alloc.num_requested(seq))
                   for seq, total in zip(seqs, totals, strict=True))

    def free(self, seq: int) -> int:
        """Free a sequence; the slots it owned."""
        owned = self.alloc.num_owned(seq)
        self.alloc.free(seq)
        self._take(self._final.pop(seq), owned, -1)
        self._refresh()
        return owned

    def held_units(self, held: dict[int, int], live: LiveView) -> tuple[int, int]:
        """(tokens the sequences ``held`` store, slots only they hold); ``held``: each
        sequence kept past its request's end, and its stored length."""
        stored = sum(held.values())
        alloc: Any = self.alloc  # a paged allocator where blocks are shared
        if not hasattr(alloc, "ref_cnt"):
            return stored, stored  # nothing is shared: each held slot is theirs alone
        holders: dict[int, int] = {}
        for seq in held:
            for block in alloc.block_table(seq):
                holders[block] = holders.get(block, 0) + 1
        only = sum(1 for block, n in holders.items() if n == alloc.ref_cnt(block))
        unused = sum(max(0, alloc.num_owned(seq) - n) for seq, n in held.items())
        return stored, only * alloc.block_size - unused

    def stretch(self, rows: Rows, k: int, head_tokens: int | None, stalled: bool) -> StretchMemory:
        """``k`` decode steps of ``rows`` or fewer: paged blocks taken at the steps they
        are needed (a dense stretch frees nothing, so a waiting request stays out)."""
        if not self.grows_on_demand:
            return StretchMemory(k, None, {})
        return dense_stretch.grow(self, rows, k)

    # ----------------------------------------------------------------- the split

    def record(self, rec: Recorder, now: float, dt: float, stored: int, live: LiveView,
               running: int, waiting: int) -> None:
        """The split held for ``dt`` from ``now`` (``stored``: stored tokens, each once)."""
        rec.record(now, dt, stored, self.physical, self.internal_total,
                   self.alloc.largest_allocatable(), running, waiting, self.shared_slots)

    def record_steps(self, rec: Recorder, memory: StretchMemory, now: float, dts: np.ndarray,
                     stored: np.ndarray, running: int, waiting: np.ndarray) -> None:
        """A stretch's split, step by step (shared slots stay put in a stretch: nothing
        forks, frees or is admitted, and every shared block is full)."""
        k, shared = len(dts), self.shared_slots
        steps = memory.per_step
        if "owned" in steps:
            owned, internal = steps["owned"][:k], steps["internal"][:k]
            largest = None  # paged: every free slot is allocatable
            if shared:
                owned = owned - shared
        else:
            owned = np.full(k, self.owned_total, dtype=np.int64)
            internal = np.full(k, self.internal_total, dtype=np.int64)
            largest = np.full(k, self.alloc.largest_allocatable(), dtype=np.int64)
        rec.record_steps(now, dts, stored, owned, internal, largest, running, waiting, shared)

    def split(self, stored: int, live: LiveView) -> tuple[int, int, int, int]:
        """(token_states, reservation, internal, free) with ``stored`` stored tokens."""
        owned = self.physical
        return (stored, owned - stored - self.internal_total, self.internal_total,
                self.capacity - owned)

    def check(self, live: LiveView) -> None:
        """The totals against every sequence's, and the allocator's own invariants."""
        alloc = self.alloc
        seqs = alloc.seq_ids()
        assert sorted(seqs) == sorted(self._final), "sequences drifted"
        owned = sum(alloc.num_owned(s) for s in seqs)
        internal = sum(max(0, alloc.num_owned(s) - self._final[s]) for s in seqs)
        assert owned == self.owned_total, (owned, self.owned_total)
        assert internal == self.internal_total, (internal, self.internal_total)
        if self.shares:
            assert self.shared_slots == alloc.num_shared_slots(), "shared slots drifted"  # type: ignore[attr-defined]
        assert self.capacity - self.physical == alloc.num_free()
        alloc.check()

    def summary(self) -> dict[str, Any]:
        """Counts only some allocators have: prefix-cache evictions, vmm page tails (per
        K or V buffer, and the bytes of one token in one)."""
        alloc = self.alloc
        token_bytes = getattr(alloc, "token_bytes", 0)
        return {"num_prefix_cache_evictions": int(getattr(alloc, "num_evictions", 0)),
                "vmm_tokens_per_page": int(getattr(alloc, "tokens_per_page", 0)),
                "page_tail_bytes_per_buffer": int(getattr(alloc, "page_tail_bytes", 0)),
                "token_bytes": int(token_bytes)}

    # ------------------------------------------------------------ address maps

    def sample_units(self, filled: dict[int, int]) -> np.ndarray:
        """Who holds each slot now: the sequence id where its token is stored, −2 where
        a sequence owns the slot but has not (or never will) filled it, −1 where free."""
        owner = np.full(self.capacity, -1, dtype=np.int64)
        for seq in self.alloc.seq_ids():
            place = self.alloc.placement(seq)
            if isinstance(place, Extent):
                slots = np.arange(place.offset, place.offset + place.length)
            else:
                bs = place.block_size
                blocks = np.asarray(place.block_ids, dtype=np.int64)
                slots = (blocks[:, None] * bs + np.arange(bs)[None, :]).ravel()
            n = filled.get(seq, 0)
            owner[slots[n:]] = -2
            owner[slots[:n]] = seq
        return owner

    def address_map(self, times: list[float], rows: list[np.ndarray]) -> dict[str, Any]:
        bins = len(rows[0])
        return {"time_s": np.array(times), "owner": np.vstack(rows),
                "slot": (np.arange(bins) * self.capacity) // bins}
