"""The serving engine: a SimPy process that replays a trace against one allocator.

Step semantics (the contract every figure rests on)
---------------------------------------------------
A step starts at time ``t`` and lasts the cost model's step time ``dt``.

* At its start, in this order: arrivals with ``arrival_time <= t`` join the
  queue (requests that can never be served are refused on the spot); waiting
  requests past ``queue_timeout`` are refused; every decoding sequence gets room
  for the token it generates in this step (paged allocators may take a block;
  when none is left the latest-arrived running request is preempted); swapped-out
  requests are resumed, earliest first; unfinished prompt chunks continue; then
  waiting requests are admitted first-come first-served while the allocator and
  the batch limits (``max_num_seqs``, ``max_num_batched_tokens``) allow.
* During the step the pool holds what was decided at its start.
* At its end: each decoding sequence has stored one more token; a prompt whose
  last chunk ran holds ``prompt_len + 1`` tokens (its KV and the first output
  token); a request that reaches ``prompt_len + output_len`` completes and frees
  its memory at that instant.

Most steps change nothing but lengths; :mod:`fragsim.stretch` advances such
stretches in one go, and :mod:`fragsim.request_batching` holds request-level
(``static``) batching.

Two optional fast paths are looked up once, at construction: an allocator's
``extend_many`` (grow every decoding sequence that needs room in one call, all or
none; the paged allocator has it) and a cost model's ``decode_step_time`` (one
decode step in plain floats). Anything that implements only the
:class:`~fragsim.allocators.Allocator` and :class:`~fragsim.costmodel.CostModel`
protocols runs the same steps without them, one ``extend`` per sequence and arrays
of one element; both ways give the same blocks and the same step times.

What sequences hold, and the split, belong to one KV manager (``self.kv``,
:class:`fragsim.kv_manager.DenseKV` for the dense allocators): the engine asks it
to admit, grow, release and record, and keeps no totals of its own.

Block sharing (parallel samples, beam search, prefix caching) is
:class:`fragsim.sharing.SharingEngine`, this engine with sharing-aware admission,
growth, completion and preemption; here it shows only as the KV manager's
``shared_total``, the slots that Σ owned counts more than once, subtracted wherever
the split is recorded. Stretches keep working for samples and prefix caching; beams fork every
step, so a beam-search run goes step by step in both modes.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import simpy

from fragsim import request_batching, stretch
from fragsim.allocators import Allocator, Extent, reserve_slots
from fragsim.batch import DecodeBatch
from fragsim.costmodel import CostModel
from fragsim.engine_config import EngineConfig
from fragsim.kv_manager import DenseKV, KVManager
from fragsim.metrics import Recorder

# Request status codes in the per-request arrays.
PENDING, WAITING, RUNNING, SWAPPED, FINISHED, REFUSED = range(6)
STATUS_NAMES = ["pending", "waiting", "running", "swapped", "finished", "refused"]
REFUSE_TOO_LONG, REFUSE_TOO_LARGE, REFUSE_TIMEOUT = 1, 2, 3
REFUSE_REASONS = {0: "", REFUSE_TOO_LONG: "too_long", REFUSE_TOO_LARGE: "too_large",
                  REFUSE_TIMEOUT: "timeout"}
_BLOCK_FRAG, _BLOCK_CAP, _BLOCK_BATCH = 1, 2, 4
_REFUSAL_COUNTER = {REFUSE_TOO_LONG: "num_refused_too_long", REFUSE_TOO_LARGE: "num_refused_too_large",
                    REFUSE_TIMEOUT: "num_refused_timeout"}
_BLOCK_COUNTER = {_BLOCK_FRAG: "num_blocked_fragmentation", _BLOCK_CAP: "num_blocked_capacity",
                  _BLOCK_BATCH: "num_blocked_batch_limit"}

class StepObserver(Protocol):
    """Something that follows the run step by step (the GPU backend, a tracer)."""

    def before_step(self, engine: Engine, dt: float) -> None:
        """Called once a step's decisions are made, before its time passes."""

    def after_step(self, engine: Engine) -> None:
        """Called at the end of each step, after growth and completions."""


@dataclass(frozen=True)
class LiveSequence:
    req: int
    filled: int    # tokens stored now
    final: int     # prompt + output
    decoding: bool
    seq: int = -1  # the allocator's sequence id; -1: the request's own (req)
    cached: int = 0  # leading positions found in the prefix cache at its admission (not its writes)

    @property
    def seq_id(self) -> int:
        return self.req if self.seq < 0 else self.seq


@dataclass(slots=True)
class _Prefill:
    """A request whose prompt (or, after recompute, prompt + generated) is being processed."""

    req: int
    target: int       # tokens to process
    done: int         # processed so far; filled == done until the last chunk
    owned: int        # Σ over its sequences
    requested: int
    seqs: tuple[int, ...] = ()  # sharing runs: its sequences, the request's own first
    shared: int = 0   # slots its sequences share among themselves (forked from the first)
    cached: int = 0   # leading tokens found in the prefix cache (done started there)


class Engine:
    """Replays ``trace`` against ``allocator``; call :meth:`run` once."""

    def __init__(self, trace: object, allocator: Allocator, cost_model: CostModel,
                 config: EngineConfig, progress: Callable[[int], None] | None = None,
                 observer: StepObserver | None = None) -> None:
        if observer is not None and not config.exact_steps:
            raise ValueError("an observer sees every step, so it needs exact_steps=True")
        if config.batching == "static" and allocator.grows_on_demand:
            raise ValueError(
                f"request-level (static) batching reserves each request's memory when its batch "
                f"forms; {allocator.name!r} grows on demand: use a reserving allocator (ft-static, "
                f"orca-*, static, contiguous, buddy) or --batching continuous")
        self.observer = observer
        self.cfg = config
        self.alloc = allocator
        self.cost = cost_model
        self.progress = progress
        self.grows = bool(allocator.grows_on_demand)
        self.kv = self._make_kv(allocator)
        # Optional fast path; a cost model that implements only the protocol goes without.
        self._decode_step_time: Callable[[int, int], float] | None = \
            getattr(cost_model, "decode_step_time", None)
        self.block_size = int(getattr(allocator, "block_size", 1) or 1)
        self.capacity = int(allocator.capacity)
        self.rec = Recorder(self.capacity, config.timeseries_resolution_s,
                            free_probe=allocator.num_free)

        arrival = np.asarray(trace.arrival_s, dtype=np.float64)  # type: ignore[attr-defined]
        prompt = np.asarray(trace.prompt_len, dtype=np.int64).copy()  # type: ignore[attr-defined]
        output = np.asarray(trace.output_len, dtype=np.int64).copy()  # type: ignore[attr-defined]
        self.N = len(arrival)
        self.arrival, self.prompt, self.output = arrival, prompt, output
        self.status = np.full(self.N, PENDING, dtype=np.int8)
        self.refused = np.zeros(self.N, dtype=np.int8)
        self.blocked = np.zeros(self.N, dtype=np.int8)
        self.generated = np.zeros(self.N, dtype=np.int64)
        self.preemptions = np.zeros(self.N, dtype=np.int32)
        self.first_token = np.full(self.N, np.nan)
        self.finish = np.full(self.N, np.nan)
        self._classify_requests()
        self.final = self.prompt + self.output

        self.now = float(arrival[0]) if self.N else 0.0
        self.g = 0                      # steps completed
        self.num_steps = 0              # steps simulated (jumped ones included)
        self.num_events = 0             # SimPy timeouts
        self._next = 0                  # next trace row to pull
        self.waiting: deque[int] = deque()
        self.prefilling: list[_Prefill] = []
        self.swapped: deque[tuple[int, int, int]] = deque()  # (req, filled, slots held in CPU)
        self.swap_used = 0
        self.batch = DecodeBatch()
        self.num_prefill_tokens = 0     # prompt tokens computed (prefix-cache hits are not)
        self.num_prefix_queries = 0     # prefix caching: tokens looked up at admission (vLLM: queries)
        self.num_prefix_hits = 0        # of which found cached
        self.num_done = 0
        self._quiet = False
        self._static_running = False
        self._map_next = self.now
        self._map_times: list[float] = []
        self._map_rows: list[np.ndarray] = []

    # ------------------------------------------------------------------ setup

    def _classify_requests(self) -> None:
        """Refusals that depend only on the request: too long, or too large for the pool."""
        cfg = self.cfg
        too_long = self.prompt + self.output > cfg.max_seq_len
        if cfg.truncate_prompts:
            fixable = too_long & (self.output < cfg.max_seq_len)
            self.prompt[fixable] = cfg.max_seq_len - self.output[fixable]
            self.rec.counters.num_truncated = int(fixable.sum())
            too_long &= ~fixable
        final = self.prompt + self.output
        # What the request must eventually hold, after the placement's rounding.
        if self.grows:
            need = self._eventual_need(final)
        else:
            policy = self.alloc.reserve
            need = np.array([reserve_slots(policy, int(p), int(o), cfg.max_seq_len)
                             for p, o in zip(self.prompt, self.output, strict=True)], dtype=np.int64) \
                if policy == "pow2" else (np.full(self.N, cfg.max_seq_len) if policy == "max" else final)
        fits = self._fits_alone(np.unique(need))
        too_large = ~too_long & ~np.array([fits[int(x)] for x in need], dtype=bool) if self.N else too_long
        self.refused[too_long] = REFUSE_TOO_LONG
        self.refused[too_large] = REFUSE_TOO_LARGE
        self.servable = ~(too_long | too_large)
        self.servable_cum = np.concatenate(([0], np.cumsum(self.servable)))
        # next_servable[i]: first servable row >= i (N if none)
        idx = np.where(self.servable, np.arange(self.N), self.N)
        self.next_servable = np.minimum.accumulate(idx[::-1])[::-1] if self.N else idx
        self.next_servable = np.append(self.next_servable, self.N)

    def _fits_alone(self, needs: np.ndarray) -> dict[int, bool]:
        """For each distinct need (slots), whether the empty pool could place it."""
        largest_empty = self.alloc.largest_allocatable()
        rounded = np.array([self.alloc.rounded(int(x)) for x in needs], dtype=np.int64)
        return dict(zip(needs.tolist(), (rounded <= largest_empty).tolist(), strict=True))

    def _make_kv(self, allocator: Allocator) -> KVManager:
        """The KV manager this engine asks (a subclass may bring its own)."""
        return DenseKV(allocator)

    # --------------------------------------------------------------- bookkeeping

    def _eventual_need(self, final: np.ndarray) -> np.ndarray:
        """Slots a request holds at its largest, for a placement that grows on demand."""
        return final

    def _dup_filled(self) -> int:
        """Stored tokens that Σ filled counts more than once (only sharing runs have any)."""
        return self.kv.shared_total

    def _take(self, req: int, owned: int, delta: int = 1) -> None:
        """Request ``req``'s sequence starts (stops) owning ``owned`` slots."""
        self.kv.take(int(self.final[req]), owned, delta)

    def _finish(self, req: int) -> None:
        self.status[req] = FINISHED
        self.generated[req] = self.output[req]
        self.finish[req] = self.now
        self.num_done += 1
        if self.progress is not None and self.num_done % 256 == 0:
            self.progress(self.num_done)

    def _refuse(self, req: int, reason: int) -> None:
        self.status[req] = REFUSED
        self.refused[req] = reason
        # Unservable requests are answered on arrival; a timeout when it is noticed.
        self.finish[req] = self.now if reason == REFUSE_TIMEOUT else self.arrival[req]
        self.num_done += 1
        self.rec.counters.bump(_REFUSAL_COUNTER[reason])

    def _pull_arrivals(self) -> None:
        arrival, now = self.arrival, self.now
        while self._next < self.N and arrival[self._next] <= now:
            req = self._next
            self._next += 1
            if self.servable[req]:
                self.status[req] = WAITING
                self.waiting.append(req)
            else:
                self._refuse(req, int(self.refused[req]))

    def _expire_waiting(self) -> None:
        timeout = self.cfg.queue_timeout_s
        if timeout is None or not self.waiting:
            return
        keep: deque[int] = deque()
        for req in self.waiting:
            if self.preemptions[req] == 0 and self.now - self.arrival[req] > timeout:
                self._refuse(req, REFUSE_TIMEOUT)
            else:
                keep.append(req)
        self.waiting = keep

    def _mark_blocked(self, req: int, kind: int) -> None:
        if self.blocked[req] & kind:
            return
        self.blocked[req] |= kind
        self.rec.counters.bump(_BLOCK_COUNTER[kind])

    def _num_running(self) -> int:
        return self.batch.n + len(self.prefilling)

    # ---------------------------------------------------------------- preemption

    def _preempt_latest(self) -> int:
        """Preempt the latest-arrived running request; return its request index."""
        b = self.batch
        cand_row = int(np.argmax(b.req[: b.n])) if b.n else -1
        cand = int(b.req[cand_row]) if b.n else -1
        pre = max(self.prefilling, key=lambda p: p.req) if self.prefilling else None
        if pre is not None and pre.req > cand:
            self.prefilling.remove(pre)
            self.kv.release(pre.req, pre.owned, int(self.final[pre.req]))
            self._requeue(pre.req, 0, pre.owned)
            return pre.req
        if cand < 0:
            raise RuntimeError("growth failed with nothing running to preempt")
        filled = int(b.offset[cand_row]) + self.g
        owned = int(b.owned[cand_row])
        # Recompute re-prefills the prompt and every token generated so far.
        self.generated[cand] = filled - int(self.prompt[cand])
        self.kv.release(int(b.seq[cand_row]), owned, int(self.final[cand]))
        b.remove(cand_row)
        self._requeue(cand, filled, owned)
        return cand

    def _requeue(self, req: int, filled: int, owned: int) -> None:
        self.preemptions[req] += 1
        c = self.rec.counters
        if (self.cfg.preemption == "swap" and filled > 0
                and self.swap_used + owned <= self.cfg.swap_space_slots):
            self.swap_used += owned
            self.swapped.append((req, filled, owned))
            self.status[req] = SWAPPED
            c.num_preemptions_swap += 1
            self._step_extra += owned * self.cfg.kv_bytes_per_token / self.cfg.swap_bandwidth
        else:
            self.status[req] = WAITING
            self.waiting.appendleft(req)
            c.num_preemptions_recompute += 1
        self._freed = True

    # ---------------------------------------------------------------- one step

    def _rows_needing_room(self) -> np.ndarray:
        """Decoding rows whose next token does not fit in what they own, in request order."""
        b = self.batch
        need = (b.offset[: b.n] + (self.g + 1) > b.owned[: b.n]).nonzero()[0]
        if len(need) > 1:
            need = need[b.req[need].argsort(kind="stable")]
        return need

    def _grow_decoders(self) -> None:
        """Room for this step's token in every decoding sequence (paged: maybe a block).

        Rows grow in request order. The KV manager grows them all in one call where
        its allocator can (all or none); when it cannot, they grow one by one until
        one fails, the latest-arrived running request is preempted, and the rows that
        still need room are worked out anew. Both orders take the same blocks: the
        one call succeeds exactly when no single extend would fail.
        """
        b, kv = self.batch, self.kv
        while True:
            need = self._rows_needing_room()
            if len(need) == 0:
                return
            reqs, seqs, offsets, owned, requested, finals = b.columns(need)
            g1 = self.g + 1
            targets = [offset + g1 for offset in offsets]
            new = kv.grow_many(seqs, [t - r for t, r in zip(targets, requested, strict=True)],
                               owned, finals)
            if new is not None:
                b.owned[need] = new
                b.requested[need] = targets
                return
            for row, seq, target, old, asked, final in zip(
                    need.tolist(), seqs, targets, owned, requested, finals, strict=True):
                new_owned = kv.grow(seq, target - asked, old, final)
                if new_owned is not None:
                    b.owned[row] = new_owned
                    b.requested[row] = target
                else:
                    self._preempt_latest()
                    break  # rows moved: recompute who still needs room
            else:
                return

    def _resume_swapped(self) -> None:
        while self.swapped and self._num_running() < self.cfg.max_num_seqs and self._budget > 0:
            req, filled, cpu_slots = self.swapped[0]
            owned = self.kv.admit(req, filled + 1, int(self.final[req]))
            if owned is None:
                return
            self.swapped.popleft()
            self.swap_used -= cpu_slots
            self.batch.add(req, filled, self.g, owned, filled + 1, int(self.final[req]))
            self.status[req] = RUNNING
            self._budget -= 1
            self._step_extra += filled * self.cfg.kv_bytes_per_token / self.cfg.swap_bandwidth

    def _admit(self) -> bool:
        """Admit FCFS; True if the queue head is blocked (or the queue is empty)."""
        cfg, alloc = self.cfg, self.alloc
        while self.waiting:
            req = self.waiting[0]
            if self._num_running() >= cfg.max_num_seqs or self._budget <= 0:
                self._mark_blocked(req, _BLOCK_BATCH)
                return True
            context = int(self.prompt[req] + self.generated[req])
            if self.grows:
                need = context + 1
            else:
                need = reserve_slots(alloc.reserve, int(self.prompt[req]), int(self.output[req]),
                                     cfg.max_seq_len)
            owned = self.kv.admit(req, need, int(self.final[req]))
            if owned is None:
                frag = alloc.num_free() >= alloc.rounded(need)
                self._mark_blocked(req, _BLOCK_FRAG if frag else _BLOCK_CAP)
                return True
            self.waiting.popleft()
            self.status[req] = RUNNING
            self.prefilling.append(_Prefill(req, context, 0, owned, need))
            self._chunks.append((self.prefilling[-1], min(self._budget, context)))
            self._budget -= self._chunks[-1][1]
        return True

    def _step(self) -> float:
        """One step from ``self.now``: decisions, then its duration. Returns dt."""
        cfg = self.cfg
        self._step_extra = 0.0
        self._freed = False
        self._chunks: list[tuple[_Prefill, int]] = []
        self._pull_arrivals()
        self._expire_waiting()
        if self.grows:
            self._grow_decoders()
        self._budget = cfg.num_batched_tokens - self.batch.n
        self._resume_swapped()
        for p in self.prefilling:
            if self._budget <= 0:
                break
            if not self._chunks or all(p is not q for q, _ in self._chunks):
                chunk = min(self._budget, p.target - p.done)
                self._chunks.append((p, chunk))
                self._budget -= chunk
        head_blocked = not self.swapped and self._admit()
        swapped_blocked = bool(self.swapped)

        b = self.batch
        n = b.n
        decode_context = b.offset_sum() + n * self.g
        if self._chunks or self._step_extra:
            tokens = sum(c for _, c in self._chunks)
            units = sum(c * p.done + c * (c - 1) // 2 for p, c in self._chunks)
            dt = self.cost.step_time(tokens, units, n, decode_context) + self._step_extra
        elif n:
            if self._decode_step_time is not None:
                dt = self._decode_step_time(n, decode_context)
            else:
                dt = float(self.cost.decode_step_times(n, np.array([decode_context]))[0])
        else:
            return 0.0
        self._record_step(dt, decode_context)
        if cfg.check:
            self._check()
        if self.observer is not None:
            self.observer.before_step(self, dt)
        self.now = self.now + dt
        self.num_steps += 1
        self._end_step()
        if self.observer is not None:
            self.observer.after_step(self)
        self._quiet = (not self.prefilling and not self._freed
                       and (head_blocked or not self.waiting) and (swapped_blocked or not self.swapped))
        return dt

    def _record_step(self, dt: float, decode_context: int) -> None:
        """The split held during this step (``decode_context``: tokens the decode rows hold)."""
        token_states = decode_context
        if self.prefilling:
            token_states += sum(p.done for p in self.prefilling)
        if self.kv.shared_total:
            token_states -= self._dup_filled()
        self.kv.record(self.rec, self.now, dt, token_states, self._num_running(),
                       len(self.waiting) + len(self.swapped))

    def _end_step(self) -> None:
        self.g += 1
        g = self.g
        for p, chunk in self._chunks:
            p.done += chunk
            self.num_prefill_tokens += chunk
            if p.done < p.target:
                continue
            self.prefilling.remove(p)
            req = p.req
            self.generated[req] += 1
            if math.isnan(self.first_token[req]):
                self.first_token[req] = self.now
            self.batch.add(req, p.target + 1, g, p.owned, p.requested, int(self.final[req]))
        b = self.batch
        if g < b.end_min():
            return  # no row completes in this step
        n = b.n
        done = (b.offset[:n] + g >= b.final[:n]).nonzero()[0]
        if len(done):
            reqs, seqs, _, owned, _, finals = b.columns(done)
            release, status = self.kv.release, self.status
            for req, seq, held, final in zip(reqs, seqs, owned, finals, strict=True):
                release(seq, held, final)
                if status[req] != FINISHED:  # several rows of one request end together
                    self._finish(req)
            b.remove_rows(done)
            self._freed = True

    # ------------------------------------------------------------- stretches

    def _jump(self) -> float:
        """Advance a stretch of uneventful decode steps at once (see :mod:`fragsim.stretch`)."""
        return stretch.jump(self)

    def _static_step(self) -> float:
        return request_batching.static_step(self)

    def _static_jump(self) -> float:
        return request_batching.static_jump(self)

    # ------------------------------------------------------------------ driver

    def _idle_until_next_arrival(self) -> float:
        nxt = self._next
        if nxt >= self.N:
            return 0.0
        target = float(self.arrival[nxt])
        dt = target - self.now
        if dt > 0:
            self._record_idle(dt)
        self.now = target
        return dt

    def _record_idle(self, dt: float) -> None:
        """The split while nothing runs, until the next arrival."""
        self.kv.record(self.rec, self.now, dt, 0, 0, len(self.waiting))

    def _process(self, env: simpy.Environment):  # type: ignore[no-untyped-def]
        static = self.cfg.batching == "static"
        step, jump = (self._static_step, self._static_jump) if static else (self._step, self._jump)
        while self.num_done < self.N:
            dt = jump() or step()
            if not dt:
                busy = self._num_running() or self.waiting or self.swapped
                if busy and self._next >= self.N:
                    raise RuntimeError(
                        f"scheduler stalled at t={self.now:.3f}s with {len(self.waiting)} waiting and "
                        f"nothing running; this is a bug (please report the configuration)")
                dt = self._idle_until_next_arrival()
                if not dt and not busy:
                    continue
            self.num_events += 1
            if self.cfg.address_map_interval_s is not None and self.now >= self._map_next:
                self._sample_address_map()
            yield env.timeout(max(0.0, self.now - env.now))

    def attach(self, observer: StepObserver) -> None:
        """Follow the run with ``observer`` (needs exact steps: it must see every step)."""
        if not self.cfg.exact_steps:
            raise ValueError("an observer sees every step, so it needs exact_steps=True")
        self.observer = observer

    def live_sequences(self) -> list[LiveSequence]:
        """Every request holding KV memory now, with what it has stored (the observer's view)."""
        b, g = self.batch, self.g
        out = [LiveSequence(int(r), int(min(o + g, f)), int(f), True, int(s))
               for r, o, f, s in zip(b.req[: b.n], b.offset[: b.n], b.final[: b.n], b.seq[: b.n],
                                     strict=True)]
        out += [LiveSequence(p.req, p.done, int(self.final[p.req]), False) for p in self.prefilling]
        return out

    def memory_split(self) -> tuple[int, int, int, int]:
        """(token_states, reservation, internal, free) right now, from the engine's bookkeeping."""
        return self.kv.split(sum(s.filled for s in self.live_sequences()))

    def prefix_cache_stats(self) -> dict[str, float]:
        """Prefix-cache counts in vLLM's names, in tokens (all 0 without prefix caching)."""
        queries, hits = self.num_prefix_queries, self.num_prefix_hits
        return {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
                "prefix_cache_hit_rate": hits / queries if queries else 0.0}

    def _sample_address_map(self) -> None:
        """Who holds each slot now, binned to ``address_map_bins`` rows: the sequence id where
        its token is stored, -2 where a sequence owns the slot but has not (or never will)
        filled it (reservation and internal fragmentation), -1 where it is free."""
        cap = self.capacity
        owner = np.full(cap, -1, dtype=np.int64)
        filled = {getattr(s, "seq", s.req): s.filled for s in self.live_sequences()}
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
        bins = min(cap, self.cfg.address_map_bins)
        self._map_times.append(self.now)
        self._map_rows.append(owner[(np.arange(bins) * cap) // bins])
        interval = self.cfg.address_map_interval_s or 1.0
        self._map_next = self.now + interval

    def address_map(self) -> dict[str, np.ndarray] | None:
        """Sampled slot owners: ``time_s`` [T], ``owner`` [T, bins], ``slot`` [bins]."""
        if not self._map_times:
            return None
        bins = len(self._map_rows[0])
        return {"time_s": np.array(self._map_times), "owner": np.vstack(self._map_rows),
                "slot": (np.arange(bins) * self.capacity) // bins}

    def _check(self) -> None:
        """Recompute the split from per-sequence state and the allocator (slow; tests)."""
        b, g = self.batch, self.g
        owned = int(b.owned[: b.n].sum()) + sum(p.owned for p in self.prefilling)
        internal = int(np.maximum(0, b.owned[: b.n] - b.final[: b.n]).sum()) \
            + sum(max(0, p.owned - int(self.final[p.req])) for p in self.prefilling)
        for row in range(b.n):
            assert self.alloc.num_owned(int(b.seq[row])) == b.owned[row]
            assert int(b.offset[row]) + g <= b.final[row] or self.cfg.batching == "static"
        self.kv.check(owned, internal)

    def run(self) -> Engine:
        env = simpy.Environment(initial_time=self.now)
        env.process(self._process(env))
        env.run()
        if self.progress is not None:
            self.progress(self.num_done)
        return self
