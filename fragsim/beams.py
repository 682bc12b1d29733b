"""Beam search without a language model: which beams survive each step.

Survivors are chosen by score, as in the vLLM paper (§4.4) and every beam search:
each beam carries its cumulative log-probability; each decode step, before growth,
every beam proposes its ``w`` most likely next tokens, and the ``w`` best (beam
score + token log-probability) of the ``w × w`` candidates survive. A beam with no
surviving candidate is pruned, one with ``c`` of them is forked ``c − 1`` times
(:meth:`BeamSearch.fork_and_prune` does both in the decode batch and the KV manager,
each step before growth). The first token's ``w`` best choices start the beams at
the end of the prefill.

With no language model to ask, each beam's next-token distribution is drawn from a
Poisson–Dirichlet(θ) law (GEM stick-breaking: stick ``k`` is ``V_k Π_{j<k} (1 −
V_j)`` with ``V ~ Beta(1, θ)``; the ``2w`` first sticks, sorted, give the top
``w``), θ = ``beam_theta``. The likeliest token's probability averages 0.98 at
θ = 0.03, 0.94 at 0.1, 0.88 at 0.2 and 0.62 at 1 (the Golomb–Dickman constant). A
small θ is a confident model: each beam's own continuation usually outscores the
others' alternatives, beams live long, and their histories part far back; a large
θ a flat one: the best beams' children crowd out the rest every step, and the beams
share almost all they hold. θ is a property of the text, fitted per synthetic
workload against the paper's Figure 15 (:mod:`fragsim.traces.workloads`), 0.1 for
other traces. Draws are seeded, request by request in arrival order; a preempted
group restarts from its prompt and draws anew.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fragsim.batch import DecodeBatch
    from fragsim.kv.protocol import KVManager


@dataclass(frozen=True)
class Survivors:
    """One group's survivors: ``parents[k]`` (an index into ``seqs``, which are in
    sequence order) carries on with score ``scores[k]``, best first."""

    req: int
    seqs: list[int]
    parents: list[int]
    scores: list[float]


class BeamSearch:
    """Scores of every live beam, and the survivors of each step."""

    def __init__(self, width: int, theta: float, seed: int) -> None:
        self.width, self.theta = width, theta
        self.rng = np.random.default_rng(seed)
        self.scores: dict[int, float] = {}

    def token_logprobs(self, num_beams: int) -> np.ndarray:
        """``[num_beams, w]``: log-probabilities of each beam's ``w`` likeliest next tokens,
        best first, from a Poisson–Dirichlet(θ) next-token distribution per beam.

        Stick-breaking in log space: ``1 − V ~ Beta(θ, 1)`` is ``U^(1/θ)``, so
        ``log(1 − V) = log(U) / θ`` exactly, however close to 1 a confident V is."""
        w = self.width
        log_rest = np.log1p(-self.rng.random((num_beams, 2 * w))) / self.theta
        with np.errstate(divide="ignore"):
            log_v = np.log1p(-np.exp(log_rest))
        log_p = log_v
        log_p[:, 1:] += np.cumsum(log_rest, axis=1)[:, :-1]
        return -np.sort(-log_p, axis=1)[:, :w]

    def start(self, seqs: tuple[int, ...]) -> None:
        """The first token's ``w`` best choices start the ``w`` beams."""
        for seq, score in zip(seqs, self.token_logprobs(1)[0].tolist(), strict=True):
            self.scores[seq] = score

    def forget(self, seq: int) -> None:
        self.scores.pop(seq, None)

    def step(self, reqs: np.ndarray, seqs: np.ndarray) -> list[Survivors]:
        """The survivors of every group whose beams do not simply carry on (each beam's
        own best token, and nothing else: scores move, blocks stay). ``reqs``, ``seqs``:
        the decoding rows."""
        w, n = self.width, len(reqs)
        order = np.lexsort((seqs, reqs))
        rows = order.reshape(-1, w) if n % w == 0 else order[:, None]
        group_reqs = reqs[rows[:, 0]]
        if n % w or not bool(np.all(reqs[rows] == group_reqs[:, None])):
            raise AssertionError(f"beam groups of other than {w} beams: {np.bincount(reqs)}")
        group_seqs = seqs[rows]
        scores = np.array([self.scores[s] for s in group_seqs.ravel().tolist()]).reshape(-1, w)
        log_p = self.token_logprobs(len(group_reqs) * w).reshape(-1, w, w)
        cand = (scores[:, :, None] + log_p).reshape(-1, w * w)
        best = np.argsort(-cand, axis=1, kind="stable")[:, :w]
        parents = best // w
        kept = np.take_along_axis(cand, best, axis=1)
        kept -= kept[:, :1]  # scores stay near 0: only differences matter
        steady = np.all(np.sort(parents, axis=1) == np.arange(w), axis=1)
        self.scores.update(zip(np.take_along_axis(group_seqs, parents, axis=1)[steady].ravel().tolist(),
                               kept[steady].ravel().tolist(), strict=True))
        return [Survivors(int(group_reqs[k]), group_seqs[k].tolist(), parents[k].tolist(), kept[k].tolist())
                for k in np.flatnonzero(~steady).tolist()]

    def fork_and_prune(self, batch: DecodeBatch, kv: KVManager, g: int, final: np.ndarray,
                       next_seq: int, fork_log: list[tuple[int, int, int]] | None) -> int:
        """Prune and fork every beam group whose survivors are not its own beams, in the
        decode batch (``g``: its step counter) and the KV manager; returns the next free
        sequence id. Children take ids from ``next_seq`` on; ``final``: each request's
        final length; each fork is logged in ``fork_log`` (parent, child, shared
        positions) unless it is None."""
        b = batch
        n = b.n
        for group in self.step(b.req[:n], b.seq[:n]):
            picked: list[list[float]] = [[] for _ in group.seqs]
            for parent, score in zip(group.parents, group.scores, strict=True):
                picked[parent].append(score)
            rows = np.flatnonzero(b.req[: b.n] == group.req)
            rows = rows[np.argsort(b.seq[rows])]
            end = int(final[group.req])
            pruned = [i for i in range(len(group.seqs)) if not picked[i]]
            for i in pruned:  # pruned first: their blocks come free
                kv.free(group.seqs[i])
                self.forget(group.seqs[i])
            for row, seq, scores in zip(rows.tolist(), group.seqs, picked, strict=True):
                if not scores:
                    continue
                self.scores[seq] = scores[0]
                filled = int(b.offset[row]) + g
                for child_score in scores[1:]:
                    child = next_seq
                    next_seq += 1
                    room = kv.fork(seq, child, filled)  # type: ignore[attr-defined]
                    self.scores[child] = child_score
                    if fork_log is not None:
                        fork_log.append((seq, child, filled))
                    b.add(group.req, filled, g, room, end, child)
                b.room[row] = kv.room(seq)  # its last block may be shared now
            b.remove_rows(rows[pruned])
        return next_seq
