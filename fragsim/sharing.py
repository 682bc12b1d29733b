"""Block sharing in the engine: parallel sampling, beam search, prefix caching.

:class:`SharingEngine` is the :class:`~fragsim.engine.Engine` with its admission,
growth, completion and preemption taught to share blocks of a paged allocator
that can fork (:class:`~fragsim.allocators.shared.SharedPagedAllocator`). The
step semantics are the engine's; what changes is what a request holds.

Parallel sampling (``num_samples = n``)
    The prompt is prefilled once; its request then decodes ``n`` sequences (batch
    rows) that share the prompt's full blocks. At admission the request's own
    sequence takes ``prompt + 1`` slots (prompt and first token, as always) and
    each of the ``n − 1`` others is forked from it over the prompt and takes room
    for its own first token: copy-on-write of the prompt's partial last block
    (which stays the request's own sequence's), or a fresh block when the prompt
    ends on a block boundary. Either way a sample costs one block at admission,
    so an admitted request never fails at the end of its prefill; the device
    copy itself waits until the prompt is written (the GPU backend's business).
    Every sample has the request's output length: they finish together.

Beam search (``beam_width = w``)
    Admitted like ``w`` samples. Survivors are chosen by score, as in the vLLM
    paper (§4.4) and every beam search: each beam carries its cumulative
    log-probability; each decode step, before growth, every beam proposes its
    ``w`` most likely next tokens, and the ``w`` best (beam score + token
    log-probability) of the ``w × w`` candidates survive. A beam with no
    surviving candidate is pruned (freed), one with ``c`` of them is forked
    ``c − 1`` times, and every beam then takes room for its token, copying its
    last block if it is shared and partly filled. The first token's ``w`` best
    choices start the beams at the end of the prefill.

    With no language model to ask, each beam's next-token distribution is drawn
    from a Poisson–Dirichlet(θ) law (GEM stick-breaking: stick ``k`` is
    ``V_k Π_{j<k} (1 − V_j)`` with ``V ~ Beta(1, θ)``; the ``2w`` first sticks,
    sorted, give the top ``w``), θ = ``beam_theta``. The likeliest token's
    probability averages 0.98 at θ = 0.03, 0.94 at 0.1, 0.88 at 0.2 and 0.62 at 1
    (the Golomb–Dickman constant). A small θ is a confident model: each beam's
    own continuation usually outscores the others' alternatives, beams live
    long, and their histories part far back; a large θ a flat one: the best
    beams' children crowd out the rest every step, and the beams share almost
    all they hold. θ is a property of the text, fitted per synthetic workload
    against the paper's Figure 15 (:mod:`fragsim.traces.workloads`), 0.1 for
    other traces. Draws are seeded by ``sharing_seed``, request by request in
    arrival order; a preempted group restarts from its prompt and draws anew.

Prefix caching (``prefix_caching``)
    At admission the leading full prompt blocks whose keys
    (:mod:`fragsim.prefix`) are cached are reused (at most ``(context − 1) //
    block_size`` of them: one token is always computed), and prefill starts
    after them: fewer prompt tokens, a shorter step, an earlier first token.
    Computed full prompt blocks are registered at the end of the step that
    computed them, so a request admitted in the same step as another with the
    same prefix computes it too (vLLM v1 does the same). Freed cached blocks stay
    in the free queue with their keys until taken again: in the split they are
    *free* (they can be handed out at once); ``num_evictable_blocks`` counts them.

Counting with sharing
    A slot is counted once whatever the number of sequences holding it. The
    engine's KV manager (:class:`~fragsim.kv_manager.DenseKV`) keeps ``owned_total``
    (Σ over sequences) and ``internal_total`` as before and subtracts
    ``shared_total = block_size × Σ_b max(0, ref_cnt − 1)`` (the allocator's
    ``num_shared_slots``)::

        owned (physical) = owned_total − shared_total
        token_states     = Σ filled(seq) − (shared_total − Σ_prefilling shared)
        internal         = Σ max(0, owned(seq) − final)        (as before)
        reservation      = owned − token_states − internal

    That holds because every block held more than once is full and stored in
    each holder whenever the split is recorded: forks copy a partly filled last
    block before the step runs, prefix hits are full computed blocks. A prefilling
    request counts its stored tokens once (``done``), so the shares among its own
    not-yet-decoding sequences (``shared`` of the prefill) are not subtracted from
    them. Per slot, then: stored → token state; not stored, at a position below
    the largest final length of its holders → reservation; otherwise internal.
    ``check=True`` recomputes this slot by slot from the block tables.

Preemption and stretches
    A request with several sequences is preempted whole and recomputed from its
    prompt (its samples or beams restart; swap applies to single sequences).
    Parallel samples decode in stretches like any sequence (shares stay put
    while nothing is admitted, forked or freed). Beam search forks every step,
    so while beams decode the engine runs step by step in both modes: the
    documented fallback, exact by construction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fragsim.allocators import SharedPagedAllocator
from fragsim.engine import (
    _BLOCK_BATCH,
    _BLOCK_CAP,
    FINISHED,
    RUNNING,
    Engine,
    EngineConfig,
    LiveSequence,
    StepObserver,
    _Prefill,
)
from fragsim.prefix import PrefixKeys


class SharingEngine(Engine):
    """The engine over a forking paged allocator: samples, beams, prefix caching."""

    alloc: SharedPagedAllocator  # type: ignore[assignment]  # (checked in __init__)

    def __init__(self, trace: Any, allocator: Any, cost_model: Any, config: EngineConfig,
                 progress: Callable[[int], None] | None = None,
                 observer: StepObserver | None = None) -> None:
        if not hasattr(allocator, "fork"):
            raise ValueError(f"block sharing needs a paged allocator that can fork "
                             f"(paged-shared), got {type(allocator).__name__}")
        self.width = config.width
        self.beam = config.beam_width > 1
        self.block_size = int(allocator.block_size)
        super().__init__(trace, allocator, cost_model, config, progress=progress, observer=observer)
        self.prefix = PrefixKeys(trace, self.block_size) if config.prefix_caching else None
        self._next_seq = self.N            # sequence ids past the request ids
        self._rng = np.random.default_rng(config.sharing_seed)
        self.theta = config.beam_theta
        self._score: dict[int, float] = {}  # beam seq -> cumulative log-probability (beams only)
        self.cached = np.zeros(self.N, dtype=np.int64)  # tokens found cached at its last admission
        #: (parent seq, child seq, shared positions) per fork, for an observer; None: not kept
        self.fork_log: list[tuple[int, int, int]] | None = [] if observer is not None else None
        if observer is not None:
            self.alloc.log_copies = True

    def attach(self, observer: StepObserver) -> None:
        super().attach(observer)
        self.fork_log = []
        self.alloc.log_copies = True

    # ------------------------------------------------------------------ counts

    def _eventual_need(self, final: np.ndarray) -> np.ndarray:
        """The prompt's full blocks once, then each sequence's own blocks, all diverged."""
        B = self.block_size
        shared = (self.prompt // B) * B
        return shared + self.width * (-(-(final - shared) // B) * B)

    def _dup_filled(self) -> int:
        return self.kv.shared_total - sum(p.shared for p in self.prefilling)

    def _num_running(self) -> int:
        return self.batch.n + sum(len(p.seqs) for p in self.prefilling)

    def _refresh_shared(self) -> None:
        self.kv.refresh_shared()

    # --------------------------------------------------------------- admission

    def _admit(self) -> bool:
        """FCFS like the plain engine; a request's sequences are admitted together."""
        cfg, alloc, B, width = self.cfg, self.alloc, self.block_size, self.width
        while self.waiting:
            req = self.waiting[0]
            if self._num_running() + width > cfg.max_num_seqs or self._budget <= 0:
                self._mark_blocked(req, _BLOCK_BATCH)
                return True
            prompt = int(self.prompt[req])
            # A group restarts from its prompt after a preemption; one sequence resumes.
            context = prompt if width > 1 else prompt + int(self.generated[req])
            cached: list[int] = []
            hits = from_free = 0
            if self.prefix is not None:
                keys = self.prefix.keys(req, prompt)
                usable = keys[: min(len(keys), (context - 1) // B)]
                hits, from_free = alloc.cache_hits(usable)
                cached = usable[:hits]
            first = context + 1
            blocks = -(-first // B) - hits + from_free + (width - 1)
            if blocks > alloc.num_free_blocks():
                self._mark_blocked(req, _BLOCK_CAP)  # paged: never fragmentation
                return True
            if alloc.allocate(req, first, cached) is None:
                raise AssertionError(f"request {req}: {blocks} blocks were free but allocate failed")
            seqs = [req]
            for _ in range(width - 1):
                child = self._next_seq
                self._next_seq += 1
                alloc.fork(req, child, prompt)
                if not alloc.extend(child, 1):
                    raise AssertionError(f"request {req}: no block for sample {child}'s first token")
                if self.fork_log is not None:
                    self.fork_log.append((req, child, prompt))
                seqs.append(child)
            self.waiting.popleft()
            owned = 0
            for seq in seqs:
                seq_owned = alloc.num_owned(seq)
                self._take(req, seq_owned)
                owned += seq_owned
            self._refresh_shared()
            self.status[req] = RUNNING
            done = hits * B
            p = _Prefill(req, context, done, owned, first, tuple(seqs),
                         (width - 1) * B * (prompt // B), done)
            self.prefilling.append(p)
            chunk = min(self._budget, context - done)
            self._chunks.append((p, chunk))
            self._budget -= chunk
            if self.prefix is not None:
                self.num_prefix_queries += context
                self.num_prefix_hits += done
                self.cached[req] = done
        return True

    # ------------------------------------------------------------------ growth

    def _grow_decoders(self) -> None:
        if self.beam:
            self._beam_step()
        else:
            super()._grow_decoders()  # samples' last blocks are their own: no copies here

    def _token_logprobs(self, num_beams: int) -> np.ndarray:
        """``[num_beams, w]``: log-probabilities of each beam's ``w`` likeliest next tokens,
        best first, from a Poisson–Dirichlet(θ) next-token distribution per beam.

        Stick-breaking in log space: ``1 − V ~ Beta(θ, 1)`` is ``U^(1/θ)``, so
        ``log(1 − V) = log(U) / θ`` exactly, however close to 1 a confident V is."""
        w = self.width
        log_rest = np.log1p(-self._rng.random((num_beams, 2 * w))) / self.theta
        with np.errstate(divide="ignore"):
            log_v = np.log1p(-np.exp(log_rest))
        log_p = log_v
        log_p[:, 1:] += np.cumsum(log_rest, axis=1)[:, :-1]
        return -np.sort(-log_p, axis=1)[:, :w]

    def _start_beams(self, seqs: tuple[int, ...]) -> None:
        """The first token's ``w`` best choices start the ``w`` beams."""
        for seq, score in zip(seqs, self._token_logprobs(1)[0].tolist(), strict=True):
            self._score[seq] = score

    def _prune_and_fork(self, req: int, seqs: list[int], parents: list[int],
                        kept: list[float]) -> None:
        """One group's survivors: ``parents[k]`` (an index into ``seqs``) carries on with
        score ``kept[k]``, best first. A beam with no survivor is freed; one with ``c``
        keeps the best and forks ``c − 1`` children, in sequence order."""
        b, alloc, g = self.batch, self.alloc, self.g
        picked: list[list[float]] = [[] for _ in seqs]
        for parent, score in zip(parents, kept, strict=True):
            picked[parent].append(score)
        rows = np.flatnonzero(b.req[: b.n] == req)
        rows = rows[np.argsort(b.seq[rows])]
        final = int(self.final[req])
        pruned = [i for i in range(len(seqs)) if not picked[i]]
        for i in pruned:  # pruned first: their blocks come free
            self.kv.release(seqs[i], int(b.owned[rows[i]]), final)
            del self._score[seqs[i]]
        for row, seq, scores in zip(rows.tolist(), seqs, picked, strict=True):
            if not scores:
                continue
            self._score[seq] = scores[0]
            filled = int(b.offset[row]) + g
            for child_score in scores[1:]:
                child = self._next_seq
                self._next_seq += 1
                alloc.fork(seq, child, filled)
                self._score[child] = child_score
                if self.fork_log is not None:
                    self.fork_log.append((seq, child, filled))
                owned = alloc.num_owned(child)
                self._take(req, owned)
                b.add(req, filled, g, owned, filled, final, child)
        b.remove_rows(rows[pruned])

    def _beam_step(self) -> None:
        """Prune and fork every beam group by score, then give every beam room for its token."""
        b, w = self.batch, self.width
        if b.n:
            # The candidates of every group at once: rows grouped by request, then by sequence.
            n = b.n
            order = np.lexsort((b.seq[:n], b.req[:n]))
            rows = order.reshape(-1, w) if n % w == 0 else order[:, None]
            reqs = b.req[rows[:, 0]]
            if n % w or not bool(np.all(b.req[rows] == reqs[:, None])):
                raise AssertionError(f"beam groups of other than {w} beams: {np.bincount(b.req[:n])}")
            seqs = b.seq[rows]
            scores = np.array([self._score[s] for s in seqs.ravel().tolist()]).reshape(-1, w)
            log_p = self._token_logprobs(len(reqs) * w).reshape(-1, w, w)
            cand = (scores[:, :, None] + log_p).reshape(-1, w * w)
            best = np.argsort(-cand, axis=1, kind="stable")[:, :w]
            parents = best // w
            kept = np.take_along_axis(cand, best, axis=1)
            kept -= kept[:, :1]  # scores stay near 0: only differences matter
            # Each beam's own best token survives and nothing else: scores move, blocks stay.
            steady = np.all(np.sort(parents, axis=1) == np.arange(w), axis=1)
            self._score.update(zip(np.take_along_axis(seqs, parents, axis=1)[steady].ravel().tolist(),
                                   kept[steady].ravel().tolist(), strict=True))
            for k in np.flatnonzero(~steady).tolist():
                self._prune_and_fork(int(reqs[k]), seqs[k].tolist(), parents[k].tolist(),
                                     kept[k].tolist())
        super()._grow_decoders()
        self._refresh_shared()

    def _rows_needing_room(self) -> np.ndarray:
        """Beams extend every step, room or not: a forked beam's shared last block must be
        copied before it writes (the allocator does that in extend)."""
        if not self.beam:
            return super()._rows_needing_room()
        b = self.batch
        need = np.flatnonzero(b.requested[: b.n] < b.offset[: b.n] + self.g + 1)
        return need[np.lexsort((b.seq[need], b.req[need]))]

    def _jump(self) -> float:
        if self.beam and self.batch.n:
            return 0.0  # beams fork every step: no stretches while they decode
        return super()._jump()

    # -------------------------------------------------------------- preemption

    def _preempt_latest(self) -> int:
        """Preempt the latest-arrived running request, all of its sequences."""
        b, alloc = self.batch, self.alloc
        cand = int(b.req[: b.n].max()) if b.n else -1
        pre = max(self.prefilling, key=lambda p: p.req) if self.prefilling else None
        if pre is not None and pre.req > cand:
            self.cached[pre.req] = 0  # its next placement finds the cache anew (or resumes from swap)
            self.prefilling.remove(pre)
            final = int(self.final[pre.req])
            for seq in pre.seqs:
                self.kv.release(seq, alloc.num_owned(seq), final)
            self._refresh_shared()
            self._requeue(pre.req, 0, pre.owned)
            return pre.req
        if cand < 0:
            raise RuntimeError("growth failed with nothing running to preempt")
        self.cached[cand] = 0
        rows = np.flatnonzero(b.req[: b.n] == cand)
        rows = rows[np.argsort(b.seq[rows])]
        filled = int(b.offset[rows[0]]) + self.g
        owned = 0
        for row in rows.tolist():
            self.kv.release(int(b.seq[row]), int(b.owned[row]), int(b.final[row]))
            self._score.pop(int(b.seq[row]), None)  # a group restarts from its prompt
            owned += int(b.owned[row])
        b.remove_rows(rows)
        self._refresh_shared()
        if len(rows) == 1 and self.width == 1:
            # Recompute re-prefills the prompt and every token generated so far.
            self.generated[cand] = filled - int(self.prompt[cand])
        # filled 0: a group is recomputed, never swapped
        self._requeue(cand, filled if len(rows) == 1 and self.width == 1 else 0, owned)
        return cand

    # ---------------------------------------------------------------- step end

    def _end_step(self) -> None:
        self.g += 1
        g, alloc, B = self.g, self.alloc, self.block_size
        for p, chunk in self._chunks:
            p.done += chunk
            self.num_prefill_tokens += chunk
            req = p.req
            if self.prefix is not None:
                prompt = int(self.prompt[req])
                computed = min(p.done, prompt) // B
                if computed:
                    alloc.cache_blocks(req, self.prefix.keys(req, prompt)[:computed])
            if p.done < p.target:
                continue
            self.prefilling.remove(p)
            self.generated[req] += 1
            if np.isnan(self.first_token[req]):
                self.first_token[req] = self.now
            final = int(self.final[req])
            for seq in p.seqs:
                self.batch.add(req, p.target + 1, g, alloc.num_owned(seq), alloc.num_requested(seq),
                               final, seq)
            if self.beam:
                self._start_beams(p.seqs)
        b = self.batch
        done = np.flatnonzero(b.offset[: b.n] + g >= b.final[: b.n])
        if len(done):
            for row in done.tolist():
                req, seq = int(b.req[row]), int(b.seq[row])
                self.kv.release(seq, int(b.owned[row]), int(b.final[row]))
                self._score.pop(seq, None)
                if self.status[req] != FINISHED:
                    self._finish(req)
                    if self.prefix is not None:
                        self.prefix.forget(req)
            b.remove_rows(done)
            self._refresh_shared()
            self._freed = True

    # ---------------------------------------------------------------- observers

    def live_sequences(self) -> list[LiveSequence]:
        b, g = self.batch, self.g
        cached = self.cached
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
        b = self.batch
        token = int(np.minimum(b.offset[: b.n] + self.g, b.final[: b.n]).sum()) \
            + sum(p.done for p in self.prefilling) - self._dup_filled()
        return self.kv.split(token)

    # ------------------------------------------------------------------- check

    def _check(self) -> None:
        """The bookkeeping against the allocator, and the split recomputed slot by slot."""
        b, g, alloc, B = self.batch, self.g, self.alloc, self.block_size
        holders: list[tuple[int, int, int]] = []  # (seq, positions stored, final)
        owned = internal = 0
        for row in range(b.n):
            seq, final = int(b.seq[row]), int(b.final[row])
            assert alloc.num_owned(seq) == b.owned[row], f"seq {seq}: owned drifted"
            assert alloc.num_requested(seq) == b.requested[row], f"seq {seq}: requested drifted"
            assert int(b.offset[row]) + g <= final
            owned += int(b.owned[row])
            internal += max(0, int(b.owned[row]) - final)
            holders.append((seq, int(b.offset[row]) + g, final))
        for p in self.prefilling:
            final = int(self.final[p.req])
            assert p.seqs[0] == p.req and len(p.seqs) == self.width
            assert sum(alloc.num_owned(s) for s in p.seqs) == p.owned
            for i, seq in enumerate(p.seqs):
                owned += alloc.num_owned(seq)
                internal += max(0, alloc.num_owned(seq) - final)
                holders.append((seq, p.done if i == 0 else 0, final))
        assert self.kv.shared_total == alloc.num_shared_slots(), "shared slots drifted"
        self.kv.check(owned, internal)
        assert sorted(s for s, _, _ in holders) == sorted(alloc.seq_ids()), "sequences drifted"
        cap = self.capacity
        position = np.full(cap, -1, dtype=np.int64)
        held = np.zeros(cap, dtype=bool)
        stored = np.zeros(cap, dtype=bool)
        top_final = np.zeros(cap, dtype=np.int64)
        within = np.arange(B, dtype=np.int64)
        for seq, filled, final in holders:
            ids = np.asarray(alloc.placement(seq).block_ids, dtype=np.int64)
            slots = (ids[:, None] * B + within[None, :]).ravel()
            pos = np.arange(len(slots), dtype=np.int64)
            seen = position[slots]
            assert bool(np.all((seen < 0) | (seen == pos))), f"seq {seq} shares a block at another position"
            position[slots] = pos
            held[slots] = True
            stored[slots[:filled]] = True
            np.maximum.at(top_final, slots, final)
        token = int(stored.sum())
        slot_internal = int((held & ~stored & (position >= top_final)).sum())
        physical = int(held.sum())
        want = (token, physical - token - slot_internal, slot_internal, cap - physical)
        assert self.memory_split() == want, f"split {self.memory_split()} but slot by slot {want}"
