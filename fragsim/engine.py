"""The serving engine: a SimPy process that replays a trace against one KV manager.

Step semantics (the contract every figure rests on)
---------------------------------------------------
A step starts at time ``t`` and lasts the cost model's step time ``dt``.

* At its start, in this order: arrivals with ``arrival_time <= t`` join the
  queue (requests that can never be served are refused on the spot); waiting
  requests past ``queue_timeout`` are refused; every decoding sequence gets room
  for the token it generates in this step (the KV manager may take a block or free
  one a window left behind; when it cannot, the latest-arrived running request is
  preempted); swapped-out requests are resumed, earliest first; unfinished prompt
  chunks continue; then waiting requests are admitted first-come first-served
  while the KV manager and the batch limits (``max_num_seqs``,
  ``max_num_batched_tokens``) allow, each starting after its prefix-cache hit.
* During the step the pool holds what was decided at its start.
* At its end: each decoding sequence has stored one more token; a prompt whose
  last chunk ran holds ``prompt_len + 1`` tokens (its KV and the first output
  token); computed full prompt blocks join the prefix cache; a request that
  reaches ``prompt_len + output_len`` completes and frees its memory at that
  instant.

The engine schedules and keeps time; memory is the KV manager's
(:mod:`fragsim.kv.protocol`): the engine asks it to admit, grow and free, and it
records the split. A request decodes one sequence, or ``n`` that share its prompt
(parallel samples, beam search: :mod:`fragsim.beams` picks the survivors and the
engine forks and prunes them). Most steps change nothing but lengths:
:mod:`fragsim.stretch` advances such stretches in one go, and
:mod:`fragsim.request_batching` holds request-level (``static``) batching.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import simpy

from fragsim import request_batching, stretch
from fragsim.batch import DecodeBatch
from fragsim.beams import BeamSearch
from fragsim.costmodel import CostModel
from fragsim.engine_config import EngineConfig
from fragsim.kv import as_kv_manager
from fragsim.kv.protocol import KVManager
from fragsim.metrics import Recorder

# Request status codes in the per-request arrays.
PENDING, WAITING, RUNNING, SWAPPED, FINISHED, REFUSED = range(6)
STATUS_NAMES = ["pending", "waiting", "running", "swapped", "finished", "refused"]
REFUSE_TOO_LONG, REFUSE_TOO_LARGE, REFUSE_TIMEOUT = 1, 2, 3
REFUSE_REASONS = {0: "", REFUSE_TOO_LONG: "too_long", REFUSE_TOO_LARGE: "too_large",
                  REFUSE_TIMEOUT: "timeout"}
BLOCK_FRAG, BLOCK_CAP, BLOCK_BATCH = 1, 2, 4
_REFUSAL_COUNTER = {REFUSE_TOO_LONG: "num_refused_too_long", REFUSE_TOO_LARGE: "num_refused_too_large",
                    REFUSE_TIMEOUT: "num_refused_timeout"}
_BLOCK_COUNTER = {BLOCK_FRAG: "num_blocked_fragmentation", BLOCK_CAP: "num_blocked_capacity",
                  BLOCK_BATCH: "num_blocked_batch_limit"}


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


@dataclass(slots=True)
class Prefill:
    """A request whose prompt (or, after recompute, prompt + generated) is being processed."""

    req: int
    target: int                 # tokens to process
    done: int                   # processed so far; filled == done until the last chunk
    seqs: tuple[int, ...]       # its sequences, the request's own first
    rooms: tuple[int, ...]      # their rooms (KV manager)
    shared: int = 0             # slots its sequences share among themselves
    cached: int = 0             # leading tokens found in the prefix cache (done started there)


class Engine:
    """Replays ``trace`` against a KV manager (or an allocator, which gets
    :class:`~fragsim.kv.dense.DenseKV`); call :meth:`run` once."""

    def __init__(self, trace: Any, kv: KVManager | Any, cost_model: CostModel,
                 config: EngineConfig, progress: Callable[[int], None] | None = None,
                 observer: StepObserver | None = None) -> None:
        if observer is not None and not config.exact_steps:
            raise ValueError("an observer sees every step, so it needs exact_steps=True")
        self.kv: KVManager = as_kv_manager(kv, trace, config)
        self.kv.validate(config)
        self.observer, self.cfg, self.cost, self.progress = observer, config, cost_model, progress
        self.grows = self.kv.grows_on_demand
        self.width = config.width
        self.beams = BeamSearch(config.width, config.beam_theta, config.sharing_seed) \
            if config.beam_width > 1 else None
        # Optional fast path; a cost model that implements only the protocol goes without.
        self.decode_step_time: Callable[[int, int], float] | None = \
            getattr(cost_model, "decode_step_time", None)
        self.capacity = self.kv.capacity
        self.rec = Recorder(self.capacity, config.timeseries_resolution_s, free_probe=self.kv.free_probe)
        #: further checks run wherever ``check=True`` checks (tests add oracles here)
        self.checks: list[Callable[[Engine], None]] = []

        self.arrival = np.asarray(trace.arrival_s, dtype=np.float64)
        self.prompt = np.asarray(trace.prompt_len, dtype=np.int64).copy()
        self.output = np.asarray(trace.output_len, dtype=np.int64).copy()
        self.N = N = len(self.arrival)
        self.status = np.full(N, PENDING, dtype=np.int8)
        self.refused = np.zeros(N, dtype=np.int8)
        self.blocked = np.zeros(N, dtype=np.int8)
        self.generated = np.zeros(N, dtype=np.int64)
        self.preemptions = np.zeros(N, dtype=np.int32)
        self.cached = np.zeros(N, dtype=np.int64)  # tokens found cached at its last admission
        self.first_token = np.full(N, np.nan)
        self.finish = np.full(N, np.nan)
        self._classify_requests()
        self.final = self.prompt + self.output

        self.now = float(self.arrival[0]) if N else 0.0
        self.g = 0                      # steps completed
        self.num_steps = 0              # steps simulated (stretched ones included)
        self.num_events = 0             # SimPy timeouts
        self.next_row = 0               # next trace row to pull
        self.waiting: deque[int] = deque()
        self.prefilling: list[Prefill] = []
        self.swapped: deque[tuple[int, int, int]] = deque()  # (req, filled, slots held in CPU)
        self.swap_used = 0
        self.batch = DecodeBatch()
        self.num_prefill_tokens = 0     # prompt tokens computed (prefix-cache hits are not)
        self.num_prefix_queries = 0     # prefix caching: tokens looked up at admission (vLLM: queries)
        self.num_prefix_hits = 0        # of which found cached
        self.num_done = 0
        self.quiet = False              # the last step left nothing pending (a stretch may follow)
        self.backoff = stretch.Backoff()
        self.static_running = False
        self._next_seq = N              # sequence ids past the request ids (samples, beams)
        #: (parent seq, child seq, shared positions) per fork, for an observer; None: not kept
        self.fork_log: list[tuple[int, int, int]] | None = [] if observer is not None else None
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
        fits = self.kv.fits_alone(self.prompt, self.output, self.width) if self.N else too_long
        too_large = ~too_long & ~fits
        self.refused[too_long] = REFUSE_TOO_LONG
        self.refused[too_large] = REFUSE_TOO_LARGE
        self.servable = ~(too_long | too_large)
        self.servable_cum = np.concatenate(([0], np.cumsum(self.servable)))
        # next_servable[i]: first servable row >= i (N if none)
        idx = np.where(self.servable, np.arange(self.N), self.N)
        self.next_servable = np.minimum.accumulate(idx[::-1])[::-1] if self.N else idx
        self.next_servable = np.append(self.next_servable, self.N)

    def attach(self, observer: StepObserver) -> None:
        """Follow the run with ``observer`` (needs exact steps: it must see every step)."""
        if not self.cfg.exact_steps:
            raise ValueError("an observer sees every step, so it needs exact_steps=True")
        self.observer = observer
        self.fork_log = []

    # --------------------------------------------------------------- bookkeeping

    def finish_request(self, req: int) -> None:
        self.status[req] = FINISHED
        self.generated[req] = self.output[req]
        self.finish[req] = self.now
        self.num_done += 1
        if self.kv.prefix is not None:
            self.kv.prefix.forget(req)
        if self.progress is not None and self.num_done % 256 == 0:
            self.progress(self.num_done)

    def _refuse(self, req: int, reason: int) -> None:
        self.status[req] = REFUSED
        self.refused[req] = reason
        # Unservable requests are answered on arrival; a timeout when it is noticed.
        self.finish[req] = self.now if reason == REFUSE_TIMEOUT else self.arrival[req]
        self.num_done += 1
        self.rec.counters.bump(_REFUSAL_COUNTER[reason])

    def pull_arrivals(self) -> None:
        arrival, now = self.arrival, self.now
        while self.next_row < self.N and arrival[self.next_row] <= now:
            req = self.next_row
            self.next_row += 1
            if self.servable[req]:
                self.status[req] = WAITING
                self.waiting.append(req)
            else:
                self._refuse(req, int(self.refused[req]))

    def expire_waiting(self) -> None:
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

    def num_running(self) -> int:
        """Sequences running: decoding rows and every sequence of a prefilling request."""
        return self.batch.n + sum(len(p.seqs) for p in self.prefilling)

    # ---------------------------------------------------------------- preemption

    def _preempt_latest(self) -> int:
        """Preempt the latest-arrived running request, all of its sequences."""
        b, kv = self.batch, self.kv
        cand = int(b.req[: b.n].max()) if b.n else -1
        pre = max(self.prefilling, key=lambda p: p.req) if self.prefilling else None
        if pre is not None and pre.req > cand:
            self.cached[pre.req] = 0  # its next placement finds the cache anew
            self.prefilling.remove(pre)
            held = sum(kv.free(seq) for seq in pre.seqs)
            self._requeue(pre.req, 0, held)
            return pre.req
        if cand < 0:
            raise RuntimeError("growth failed with nothing running to preempt")
        self.cached[cand] = 0
        rows = np.flatnonzero(b.req[: b.n] == cand)
        rows = rows[np.argsort(b.seq[rows])]
        filled = int(b.offset[rows[0]]) + self.g
        held = 0
        for seq in b.seq[rows].tolist():
            held += kv.free(seq)
            if self.beams is not None:
                self.beams.forget(seq)  # a group restarts from its prompt
        b.remove_rows(rows)
        alone = len(rows) == 1 and self.width == 1
        if alone:
            # Recompute re-prefills the prompt and every token generated so far.
            self.generated[cand] = filled - int(self.prompt[cand])
        self._requeue(cand, filled if alone else 0, held)  # a group is recomputed, never swapped
        return cand

    def _requeue(self, req: int, filled: int, held: int) -> None:
        self.preemptions[req] += 1
        c = self.rec.counters
        if (self.cfg.preemption == "swap" and filled > 0
                and self.swap_used + held <= self.cfg.swap_space_slots):
            self.swap_used += held
            self.swapped.append((req, filled, held))
            self.status[req] = SWAPPED
            c.num_preemptions_swap += 1
            self.step_extra += held * self.cfg.kv_bytes_per_token / self.cfg.swap_bandwidth
        else:
            self.status[req] = WAITING
            self.waiting.appendleft(req)
            c.num_preemptions_recompute += 1
        self.freed = True

    # ---------------------------------------------------------------- one step

    def _rows_needing_room(self) -> np.ndarray:
        """Decoding rows whose next token passes their room, in request (then sequence) order."""
        b = self.batch
        need = (b.offset[: b.n] + (self.g + 1) > b.room[: b.n]).nonzero()[0]
        if len(need) > 1:
            need = need[np.lexsort((b.seq[need], b.req[need]))]
        return need

    def _grow_decoders(self) -> None:
        """Room for this step's token in every decoding sequence.

        Rows grow in request order. The KV manager grows them all in one call where it
        can (all or none); when it cannot, they grow one by one until one fails, the
        latest-arrived running request is preempted, and the rows that still need room
        are worked out anew. Both orders take the same blocks: the one call succeeds
        only when no single growth would fail.
        """
        if self.beams is not None and self.batch.n:
            self._beam_step()
        b, kv = self.batch, self.kv
        while True:
            need = self._rows_needing_room()
            if len(need) == 0:
                return
            _, seqs, offsets, rooms, finals = b.columns(need)
            g1 = self.g + 1
            targets = [offset + g1 for offset in offsets]
            new = kv.grow_many(seqs, targets, rooms, finals)
            if new is not None:
                b.room[need] = new
                return
            for row, seq, target in zip(need.tolist(), seqs, targets, strict=True):
                room = kv.grow(seq, target)
                if room is None:
                    self._preempt_latest()
                    break  # rows moved: recompute who still needs room
                b.room[row] = room
            else:
                return

    def _beam_step(self) -> None:
        """Prune and fork every beam group whose survivors are not its own beams."""
        assert self.beams is not None
        b, kv, g = self.batch, self.kv, self.g
        n = b.n
        for group in self.beams.step(b.req[:n], b.seq[:n]):
            picked: list[list[float]] = [[] for _ in group.seqs]
            for parent, score in zip(group.parents, group.scores, strict=True):
                picked[parent].append(score)
            rows = np.flatnonzero(b.req[: b.n] == group.req)
            rows = rows[np.argsort(b.seq[rows])]
            final = int(self.final[group.req])
            pruned = [i for i in range(len(group.seqs)) if not picked[i]]
            for i in pruned:  # pruned first: their blocks come free
                kv.free(group.seqs[i])
                self.beams.forget(group.seqs[i])
            for row, seq, scores in zip(rows.tolist(), group.seqs, picked, strict=True):
                if not scores:
                    continue
                self.beams.scores[seq] = scores[0]
                filled = int(b.offset[row]) + g
                for child_score in scores[1:]:
                    child = self._next_seq
                    self._next_seq += 1
                    room = kv.fork(seq, child, filled)  # type: ignore[attr-defined]
                    self.beams.scores[child] = child_score
                    if self.fork_log is not None:
                        self.fork_log.append((seq, child, filled))
                    b.add(group.req, filled, g, room, final, child)
                b.room[row] = kv.room(seq)  # its last block may be shared now
            b.remove_rows(rows[pruned])

    def _resume_swapped(self) -> None:
        while self.swapped and self.num_running() < self.cfg.max_num_seqs and self.budget > 0:
            req, filled, cpu_slots = self.swapped[0]
            final = int(self.final[req])
            admitted = self.kv.admit((req,), filled + 1, final, int(self.prompt[req]), None)
            if admitted is None:
                return
            self.swapped.popleft()
            self.swap_used -= cpu_slots
            self.batch.add(req, filled, self.g, admitted.rooms[0], final)
            self.status[req] = RUNNING
            self.budget -= 1
            self.step_extra += filled * self.cfg.kv_bytes_per_token / self.cfg.swap_bandwidth

    def admit_waiting(self) -> bool:
        """Admit FCFS, each request's sequences together and after its prefix-cache hit;
        True if the queue head is blocked (or the queue is empty)."""
        cfg, kv, width = self.cfg, self.kv, self.width
        prefix = kv.prefix
        while self.waiting:
            req = self.waiting[0]
            if self.num_running() + width > cfg.max_num_seqs or self.budget <= 0:
                self._mark_blocked(req, BLOCK_BATCH)
                return True
            prompt = int(self.prompt[req])
            # A group restarts from its prompt after a preemption; one sequence resumes.
            context = prompt if width > 1 else prompt + int(self.generated[req])
            hit = prefix.lookup(req, prompt, context) if prefix is not None else None
            tokens = kv.admission_tokens(prompt, int(self.output[req]), context)
            seqs = (req, *range(self._next_seq, self._next_seq + width - 1))
            admitted = kv.admit(seqs, tokens, int(self.final[req]), prompt, hit)
            if admitted is None:
                frag = kv.blocked_by_fragmentation(tokens)
                self._mark_blocked(req, BLOCK_FRAG if frag else BLOCK_CAP)
                return True
            self._next_seq += width - 1
            if self.fork_log is not None:
                self.fork_log += [(req, child, prompt) for child in seqs[1:]]
            self.waiting.popleft()
            self.status[req] = RUNNING
            done = hit.tokens if hit is not None else 0
            p = Prefill(req, context, done, seqs, admitted.rooms, admitted.shared, done)
            self.prefilling.append(p)
            chunk = min(self.budget, context - done)
            self.chunks.append((p, chunk))
            self.budget -= chunk
            if prefix is not None:
                self.num_prefix_queries += context
                self.num_prefix_hits += done
                self.cached[req] = done
        return True

    def _step(self) -> float:
        """One step from ``self.now``: decisions, then its duration. Returns dt."""
        cfg = self.cfg
        self.step_extra = 0.0
        self.freed = False
        self.chunks: list[tuple[Prefill, int]] = []
        self.pull_arrivals()
        self.expire_waiting()
        if self.grows:
            self._grow_decoders()
        self.budget = cfg.num_batched_tokens - self.batch.n
        self._resume_swapped()
        for p in self.prefilling:
            if self.budget <= 0:
                break
            if not self.chunks or all(p is not q for q, _ in self.chunks):
                chunk = min(self.budget, p.target - p.done)
                self.chunks.append((p, chunk))
                self.budget -= chunk
        head_blocked = not self.swapped and self.admit_waiting()
        swapped_blocked = bool(self.swapped)

        b = self.batch
        n = b.n
        decode_context = b.offset_sum() + n * self.g
        if self.chunks or self.step_extra:
            tokens = sum(c for _, c in self.chunks)
            units = sum(c * p.done + c * (c - 1) // 2 for p, c in self.chunks)
            dt = self.cost.step_time(tokens, units, n, decode_context) + self.step_extra
        elif n:
            if self.decode_step_time is not None:
                dt = self.decode_step_time(n, decode_context)
            else:
                dt = float(self.cost.decode_step_times(n, np.array([decode_context]))[0])
        else:
            return 0.0
        self._record_step(dt, decode_context)
        if cfg.check:
            self.check()
        if self.observer is not None:
            self.observer.before_step(self, dt)
        self.now = self.now + dt
        self.num_steps += 1
        self._end_step()
        if self.observer is not None:
            self.observer.after_step(self)
        self.quiet = (not self.prefilling and not self.freed
                      and (head_blocked or not self.waiting) and (swapped_blocked or not self.swapped))
        return dt

    def _record_step(self, dt: float, decode_context: int) -> None:
        """The split held during this step (``decode_context``: tokens the decode rows hold)."""
        stored = decode_context
        if self.prefilling:
            stored += sum(p.done for p in self.prefilling)
        if self.kv.shared_slots:
            stored -= self.duplicate_stored()
        self.kv.record(self.rec, self.now, dt, stored, self, self.num_running(),
                       len(self.waiting) + len(self.swapped))

    def duplicate_stored(self) -> int:
        """Stored tokens that Σ filled counts more than once: shared slots, less those a
        prefilling request's own sequences share (its stored tokens count once)."""
        return self.kv.shared_slots - sum(p.shared for p in self.prefilling)

    def _end_step(self) -> None:
        self.g += 1
        g, prefix = self.g, self.kv.prefix
        for p, chunk in self.chunks:
            p.done += chunk
            self.num_prefill_tokens += chunk
            req = p.req
            if prefix is not None:
                prefix.cache(req, int(self.prompt[req]), p.done)
            if p.done < p.target:
                continue
            self.prefilling.remove(p)
            self.generated[req] += 1
            if math.isnan(self.first_token[req]):
                self.first_token[req] = self.now
            final = int(self.final[req])
            for seq, room in zip(p.seqs, p.rooms, strict=True):
                self.batch.add(req, p.target + 1, g, room, final, seq)
            if self.beams is not None:
                self.beams.start(p.seqs)
        b = self.batch
        if g < b.end_min():
            return  # no row completes in this step
        done = (b.offset[: b.n] + g >= b.final[: b.n]).nonzero()[0]
        if len(done):
            status, free = self.status, self.kv.free
            for req, seq in zip(b.req[done].tolist(), b.seq[done].tolist(), strict=True):
                free(seq)
                if self.beams is not None:
                    self.beams.forget(seq)
                if status[req] != FINISHED:  # several rows of one request end together
                    self.finish_request(req)
            b.remove_rows(done)
            self.freed = True

    # ------------------------------------------------------------------ driver

    def _idle_until_next_arrival(self) -> float:
        nxt = self.next_row
        if nxt >= self.N:
            return 0.0
        target = float(self.arrival[nxt])
        dt = target - self.now
        if dt > 0:
            self.kv.record(self.rec, self.now, dt, 0, self, 0, len(self.waiting))
        self.now = target
        return dt

    def _process(self, env: simpy.Environment):  # type: ignore[no-untyped-def]
        static = self.cfg.batching == "static"
        step, jump = (request_batching.static_step, request_batching.static_jump) if static \
            else (Engine._step, stretch.jump)
        while self.num_done < self.N:
            dt = jump(self) or step(self)
            if not dt:
                busy = self.num_running() or self.waiting or self.swapped
                if busy and self.next_row >= self.N:
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

    def run(self) -> Engine:
        env = simpy.Environment(initial_time=self.now)
        env.process(self._process(env))
        env.run()
        if self.progress is not None:
            self.progress(self.num_done)
        return self

    # ------------------------------------------------------------------ views

    def seqs(self) -> np.ndarray:
        """Ids of every sequence holding memory now, in :meth:`computed`'s order."""
        b = self.batch
        seqs = b.seq[: b.n]
        if self.prefilling:
            seqs = np.concatenate((seqs, [p.req for p in self.prefilling]))
        return seqs.astype(np.int64, copy=False)

    def computed(self) -> np.ndarray:
        """Tokens stored by every sequence holding memory now: the decoding rows', then
        each prefilling request's (its first sequence)."""
        b = self.batch
        computed = b.offset[: b.n] + self.g
        if self.prefilling:
            computed = np.concatenate((computed, [p.done for p in self.prefilling]))
        return computed.astype(np.int64, copy=False)

    def live_sequences(self) -> list[LiveSequence]:
        """Every sequence holding KV memory now, with what it has stored (the observer's view)."""
        b, g, cached = self.batch, self.g, self.cached
        out = [LiveSequence(int(r), int(min(o + g, f)), int(f), True, int(s), int(cached[r]) if s == r else 0)
               for r, o, f, s in zip(b.req[: b.n], b.offset[: b.n], b.final[: b.n], b.seq[: b.n],
                                     strict=True)]
        for p in self.prefilling:
            final = int(self.final[p.req])
            out.append(LiveSequence(p.req, p.done, final, False, p.req, p.cached))
            # The other sequences of a prefilling group store nothing of their own yet.
            out += [LiveSequence(p.req, 0, final, False, seq) for seq in p.seqs[1:]]
        return out

    def memory_split(self) -> tuple[int, int, int, int]:
        """(token_states, reservation, internal, free) right now, in the KV manager's unit."""
        b = self.batch
        stored = int(np.minimum(b.offset[: b.n] + self.g, b.final[: b.n]).sum()) \
            + sum(p.done for p in self.prefilling) - (self.duplicate_stored() if self.kv.shared_slots else 0)
        return self.kv.split(stored, self)

    def prefix_cache_stats(self) -> dict[str, float]:
        """Prefix-cache counts in vLLM's names, in tokens (all 0 without prefix caching)."""
        queries, hits = self.num_prefix_queries, self.num_prefix_hits
        return {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
                "prefix_cache_hit_rate": hits / queries if queries else 0.0}

    def _sample_address_map(self) -> None:
        """The KV manager's units now, binned to ``address_map_bins`` (a bin shows its first unit)."""
        units = self.kv.sample_units({s.seq_id: s.filled for s in self.live_sequences()})
        bins = min(len(units), self.cfg.address_map_bins)
        self._map_times.append(self.now)
        self._map_rows.append(units[(np.arange(bins) * len(units)) // bins])
        self._map_next = self.now + (self.cfg.address_map_interval_s or 1.0)

    def address_map(self) -> dict[str, Any] | None:
        """Sampled owners of the pool's units over time (:meth:`KVManager.address_map`)."""
        if not self._map_times:
            return None
        return self.kv.address_map(self._map_times, self._map_rows)

    def check(self) -> None:
        """Each row's room against the KV manager's, then the KV manager's own checks
        (slow; tests) and any added :attr:`checks`."""
        b, g, kv = self.batch, self.g, self.kv
        for row in range(b.n):
            seq = int(b.seq[row])
            assert kv.room(seq) == b.room[row], f"seq {seq}: the engine's room is not the KV manager's"
            assert int(b.offset[row]) + g <= b.final[row] or self.cfg.batching == "static"
        kv.check(self)
        for fn in self.checks:
            fn(self)
