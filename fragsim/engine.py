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
  That is today's vLLM (``--scheduler vllm-v1``). ``vllm-v0`` (vLLM 0.1, the vLLM
  paper's engine) admits whole prompts first and, if any, runs them alone while the
  decoding rows wait; else a decode-only step grows the rows. ``orca`` admits whole
  prompts beside the decodes, never a chunk (:meth:`Engine._decide`,
  :meth:`Engine._decide_v0`).
* During the step the pool holds what was decided at its start.
* At its end: each decoding sequence has stored one more token (not after a
  prompt-only step of ``vllm-v0``); a prompt whose
  last chunk ran holds ``prompt_len + 1`` tokens (its KV and the first output
  token); computed full prompt blocks join the prefix cache; a connector is offered
  the prompt chunks computed (and with decode stores, :mod:`fragsim.decode_stores`,
  the chunks decode tokens completed); a request that
  reaches ``prompt_len + output_len`` completes and frees its memory at that
  instant.

The engine schedules and keeps time; memory is the KV manager's
(:mod:`fragsim.kv.protocol`): the engine asks it to admit, grow and free, and it
records the split. The per-request table (lengths, status, times, refusals) is
:mod:`fragsim.request_table`'s, admission (and KV a connector brings in)
:mod:`fragsim.admission`'s, who is preempted and how :mod:`fragsim.preemption`'s,
and what an observer reads :mod:`fragsim.engine_views`'. A request decodes one
sequence, or ``n`` that share its prompt (parallel samples, beam search:
:mod:`fragsim.beams` picks the survivors and forks and prunes them, each step before
growth). Most steps change nothing but lengths: :mod:`fragsim.stretch` advances such
stretches in one go, and :mod:`fragsim.request_batching` holds request-level
(``static``) batching.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import simpy

from fragsim import admission, decode_stores, engine_clock, preemption, stretch
from fragsim.batch import DecodeBatch, Prefill
from fragsim.beams import BeamSearch
from fragsim.connector import KVConnector
from fragsim.costmodel import CostModel
from fragsim.engine_config import EngineConfig
from fragsim.engine_views import AddressMapSampler, StepObserver
from fragsim.kv import as_kv_manager
from fragsim.kv.protocol import KVManager
from fragsim.metrics import Recorder
from fragsim.request_table import (
    FINISHED,
    RequestTable,
)


class Engine:
    """Replays ``trace`` against a KV manager (or an allocator, which gets
    :class:`~fragsim.kv.dense.DenseKV`); call :meth:`run` once."""

    def __init__(self, trace: Any, kv: KVManager | Any, cost_model: CostModel,
                 config: EngineConfig, progress: Callable[[int], None] | None = None,
                 observer: StepObserver | None = None, connector: KVConnector | None = None,
                 prefix_keys: Any = None) -> None:
        if observer is not None and not config.exact_steps:
            raise ValueError("an observer sees every step, so it needs exact_steps=True")
        self.kv: KVManager = as_kv_manager(kv, trace, config, prefix_keys)
        self.kv.validate(config)
        self.observer, self.cfg, self.cost, self.progress = observer, config, cost_model, progress
        #: KV that comes from or goes elsewhere (:mod:`fragsim.connector`): an offload
        #: tier, or the other side of prefill/decode disaggregation; None without
        self.connector = connector
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

        #: the requests, one row each (lengths, status, times); refuses the unservable
        self.requests = reqs = RequestTable(trace, config, self.kv.fits_alone, self.rec.counters)
        #: an instance of a cluster waits on this when it has nothing to do and its next
        #: request is not routed yet (:mod:`fragsim.cluster`); None: not in a cluster
        self.wake: simpy.Event | None = None
        self.env: simpy.Environment | None = None  # the environment it runs in (once started)

        self.now = float(reqs.arrival[0]) if reqs.N else 0.0
        self.g = 0                      # steps completed
        self.num_steps = 0              # steps simulated (stretched ones included)
        self.num_events = 0             # SimPy timeouts
        self.waiting: deque[int] = deque()
        self.prefilling: list[Prefill] = []
        self.swapped: deque[tuple[int, int, int]] = deque()  # (req, filled, slots held in CPU)
        self.swap_used = 0
        self.held: dict[int, int] = {}  # sequences kept past their request for a connector: stored
        self.batch = DecodeBatch()
        self.num_prefill_tokens = 0     # prompt tokens computed (prefix-cache hits are not)
        self.num_prefix_queries = 0     # prefix caching: tokens looked up at admission (vLLM: queries)
        self.num_prefix_hits = 0        # of which found cached
        self.quiet = False              # the last step left nothing pending (a stretch may follow)
        self.backoff = stretch.Backoff()
        self.static_running = False
        self.next_seq = reqs.N         # sequence ids past the request ids (samples, beams)
        #: (parent seq, child seq, shared positions) per fork, for an observer; None: not kept
        self.fork_log: list[tuple[int, int, int]] | None = [] if observer is not None else None
        self.address_sampler = AddressMapSampler(self.kv, config.address_map_interval_s,
                                                 config.address_map_bins, self.now)

    # ---------------------------------------------------------- setup, bookkeeping

    def attach(self, observer: StepObserver) -> None:
        """Follow the run with ``observer`` (needs exact steps: it must see every step)."""
        if not self.cfg.exact_steps:
            raise ValueError("an observer sees every step, so it needs exact_steps=True")
        self.observer = observer
        self.fork_log = []

    def finish_request(self, req: int) -> None:
        """``req`` is done now: its row is closed, and the prefix cache forgets it."""
        reqs = self.requests
        reqs.finish_at(req, self.now)
        if self.kv.prefix is not None:
            self.kv.prefix.forget(req)
        if self.connector is not None:
            self.connector.finish(req, self.now)
        if self.progress is not None and reqs.num_done % 256 == 0:
            self.progress(reqs.num_done)

    def pull_arrivals(self) -> None:
        """Arrivals by now join the queue (requests that can never be served are refused)."""
        self.requests.arrive(self.now, self.waiting)

    def expire_waiting(self) -> None:
        """Refuse the waiting requests past ``queue_timeout``."""
        timeout = self.cfg.queue_timeout_s
        if timeout is None or not self.waiting:
            return
        self.waiting = self.requests.expire(self.waiting, self.now, timeout)

    def num_running(self) -> int:
        """Sequences running: decoding rows and every sequence of a prefilling request
        that is not waiting for KV to land or, landed, for a running slot (vLLM 0.33 keeps
        those out of ``running``, so ``max_num_seqs`` does not count them)."""
        return self.batch.n + sum(len(p.seqs) for p in self.prefilling if p.running)

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
            self.next_seq = self.beams.fork_and_prune(self.batch, self.kv, self.g, self.requests.final,
                                                       self.next_seq, self.fork_log)
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
                    preemption.preempt_latest(self)
                    break  # rows moved: recompute who still needs room
                b.room[row] = room
            else:
                return

    def admit_waiting(self) -> bool:
        """Admit FCFS, each request's sequences together and after its prefix-cache hit;
        True if the queue head is blocked (or the queue is empty)."""
        skipped: list[int] = []
        try:
            return admission.admit(self, skipped)
        finally:
            self.waiting.extendleft(reversed(skipped))  # back at the head, in their order

    def step(self) -> float:
        """One step from ``self.now``: decisions, then its duration. Returns dt."""
        cfg = self.cfg
        self.step_extra = 0.0
        self.freed = False
        self.chunks: list[tuple[Prefill, int]] = []
        self.pull_arrivals()
        self.expire_waiting()
        if self.connector is not None:
            admission.poll_connector(self)
        head_blocked, prompts_only = self._decide_v0() if cfg.scheduler == "vllm-v0" else (self._decide(), False)
        swapped_blocked = bool(self.swapped)

        b = self.batch
        n = b.n
        decode_context = b.offset_sum() + n * self.g
        if self.chunks or self.step_extra:
            tokens = sum(c for _, c in self.chunks)
            units = sum(c * p.done + c * (c - 1) // 2 for p, c in self.chunks)
            decoding, read = (0, 0) if prompts_only else (n, decode_context)
            dt = self.cost.step_time(tokens, units, decoding, read) + self.step_extra
        elif n:
            if self.decode_step_time is not None:
                dt = self.decode_step_time(n, decode_context)
            else:
                dt = float(self.cost.decode_step_times(n, np.array([decode_context]))[0])
        else:
            return 0.0
        self.record_step(dt, decode_context)
        if cfg.check:
            self.check()
        if self.observer is not None:
            self.observer.before_step(self, dt)
        self.now = self.now + dt
        self.num_steps += 1
        if prompts_only:
            b.pause()  # the decoding rows wait out a prompt step
        self._end_step()
        if self.observer is not None:
            self.observer.after_step(self)
        self.quiet = (not self.prefilling and not self.freed
                      and (head_blocked or not self.waiting) and (swapped_blocked or not self.swapped))
        return dt

    def _decide(self) -> bool:
        """A step as vLLM's V1 scheduler builds it (``vllm-v1``;
        ``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``: running requests
        first, then waiting ones, in one token budget), or Orca's (``orca``: Yu et al.,
        OSDI 2022, §4.2, iteration-level scheduling with selective batching, as the vLLM
        paper reimplemented it on its engine, §6.1): every decoding sequence grows,
        swapped requests resume, unfinished prompt chunks continue, then waiting
        requests are admitted; prompts and decodes share the step's token budget. Under
        ``orca`` a prompt is admitted whole or not at all, FCFS
        (:func:`fragsim.admission.admit`). True if the queue head is blocked."""
        if self.grows:
            self._grow_decoders()
        self.budget = self.cfg.num_batched_tokens - self.batch.n
        preemption.resume_swapped(self)
        for p in self.prefilling:
            if self.budget <= 0:
                break
            if not p.running:
                continue
            if not self.chunks or all(p is not q for q, _ in self.chunks):
                admission.take_chunk(self, p)
        if self.connector is not None:
            admission.unpark(self)
        return not self.swapped and self.admit_waiting()

    def _decide_v0(self) -> tuple[bool, bool]:
        """A step as vLLM 0.1's scheduler builds it (``vllm-v0``;
        ``vllm/core/scheduler.py``, ``Scheduler._schedule``): with nothing swapped out,
        waiting prompts are admitted first, whole, while the step's whole token budget,
        ``max_num_seqs`` and memory allow, and if any is, the step runs prompts only
        (the decoding rows wait). Otherwise it is a decode step: every decoding sequence
        grows (preempting the latest-arrived request when a block is missing), and
        swapped requests resume. Returns (queue head blocked, prompts only)."""
        self.budget = self.cfg.num_batched_tokens
        # Blocked: asked and refused (with requests swapped out, the queue is not asked).
        head_blocked = self.admit_waiting() if not self.swapped else not self.waiting
        if self.chunks:
            return head_blocked, True
        queued = len(self.waiting)
        if self.grows:
            self._grow_decoders()
        self.budget = self.cfg.num_batched_tokens - self.batch.n
        preemption.resume_swapped(self)
        # A request preempted to the queue's head is asked again next step.
        return head_blocked and len(self.waiting) == queued, False

    def record_step(self, dt: float, decode_context: int) -> None:
        """The split held during this step (``decode_context``: tokens the decode rows hold)."""
        stored = decode_context
        if self.prefilling:
            stored += sum(p.done for p in self.prefilling)
        if self.kv.shared_slots:
            stored -= self.duplicate_stored()
        if self.connector is not None:
            held_stored, self.rec.held = self.kv.held_units(self.held, self) if self.held else (0, 0)
            stored += held_stored
        self.kv.record(self.rec, self.now, dt, stored, self, self.num_running(),
                       len(self.waiting) + len(self.swapped))

    def duplicate_stored(self) -> int:
        """Stored tokens that Σ filled counts more than once: shared slots, less those a
        prefilling request's own sequences share (its stored tokens count once)."""
        return self.kv.shared_slots - sum(p.shared for p in self.prefilling)

    def _end_step(self) -> None:
        self.g += 1
        g, prefix, reqs = self.g, self.kv.prefix, self.requests
        for p, chunk in self.chunks:
            p.done += chunk
            self.num_prefill_tokens += chunk
            req = p.req
            if prefix is not None:
                prefix.cache(req, int(reqs.prompt[req]), p.done)
            if self.connector is not None:
                self.connector.store(req, int(reqs.prompt[req]), p.done, self.now)
            if p.done < p.target:
                continue
            self.prefilling.remove(p)
            reqs.generated[req] += 1
            if math.isnan(reqs.first_token[req]):
                reqs.first_token[req] = self.now
            final = int(reqs.final[req])
            for seq, room in zip(p.seqs, p.rooms, strict=True):
                self.batch.add(req, p.target + 1, g, room, final, seq)
            if self.beams is not None:
                self.beams.start(p.seqs)
        decode_stores.offer(self)  # before any row finishes: its last chunk goes first
        b = self.batch
        if g < b.end_min():
            return  # no row completes in this step
        done = (b.offset[: b.n] + g >= b.final[: b.n]).nonzero()[0]
        if len(done):
            status, free, connector = reqs.status, self.kv.free, self.connector
            for req, seq in zip(b.req[done].tolist(), b.seq[done].tolist(), strict=True):
                if connector is not None and connector.must_hold(req):
                    connector.hold(req, seq)  # read elsewhere: freed when that is done
                    self.held[seq] = int(reqs.final[req])
                else:
                    free(seq)
                if self.beams is not None:
                    self.beams.forget(seq)
                if status[req] != FINISHED:  # several rows of one request end together
                    self.finish_request(req)
            b.remove_rows(done)
            self.freed = True

    # ------------------------------------------------------------------ driver

    def poke(self) -> None:
        """Something changed for an instance that may be idle: it looks again."""
        if self.wake is not None and not self.wake.triggered:
            self.wake.succeed()

    def start(self, env: simpy.Environment) -> simpy.Process:
        """Run as a process of ``env`` (a cluster runs its instances in one environment)."""
        self.env = env
        if self.connector is not None:
            self.connector.bind(env)
        return env.process(engine_clock.process(self, env))

    def finish_run(self) -> None:
        """The run is over: close what integrates over time, report the last progress."""
        if self.connector is not None:
            self.connector.close(self.now)
        if self.progress is not None:
            self.progress(self.requests.num_done)

    def run(self) -> Engine:
        env = simpy.Environment(initial_time=self.now)
        self.start(env)
        env.run()
        self.finish_run()
        return self

    # ------------------------------------------------- what holds memory (LiveView)

    def free_held(self, seq: int) -> Any:
        """A connector is done with a sequence it held: its blocks go back."""
        del self.held[seq]
        return self.kv.free(seq)

    def seqs(self) -> np.ndarray:
        """Ids of every sequence holding memory now, in :meth:`computed`'s order."""
        b = self.batch
        seqs = b.seq[: b.n]
        if self.prefilling or self.held:
            seqs = np.concatenate((seqs, [p.req for p in self.prefilling], list(self.held)))
        return seqs.astype(np.int64, copy=False)

    def computed(self) -> np.ndarray:
        """Tokens stored by every sequence holding memory now: the decoding rows', each
        prefilling request's (its first sequence), then the held ones'."""
        b = self.batch
        computed = b.offset[: b.n] + self.g
        if self.prefilling or self.held:
            computed = np.concatenate((computed, [p.done for p in self.prefilling], list(self.held.values())))
        return computed.astype(np.int64, copy=False)

    def receiving(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids, tokens stored) of the requests waiting for KV to arrive; None: none."""
        waiting = [p for p in self.prefilling if p.loading] if self.connector is not None else None
        if not waiting:
            return None
        return (np.array([p.req for p in waiting], dtype=np.int64),
                np.array([p.done for p in waiting], dtype=np.int64))

    def check(self) -> None:
        """Each row's room against the KV manager's, then the KV manager's own checks
        (slow; tests) and any added :attr:`checks`."""
        b, g, kv = self.batch, self.g, self.kv
        for row in range(b.n):
            seq = int(b.seq[row])
            assert kv.room(seq) == b.room[row], f"seq {seq}: the engine's room is not the KV manager's"
            assert int(b.offset[row]) + g <= b.final[row] or self.cfg.batching == "static"
        kv.check(self)
        if self.connector is not None:
            self.connector.check()
        for fn in self.checks:
            fn(self)
