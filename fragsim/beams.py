"""Beam search without a language model: which beams survive each step.

Survivors are chosen by score, as in the vLLM paper (§4.4) and every beam search:
each beam carries its cumulative log-probability; each decode step, before growth,
every beam proposes its ``w`` most likely next tokens, and the ``w`` best (beam
score + token log-probability) of the ``w × w`` candidates survive. A beam with no
surviving candidate is pruned, one with ``c`` of them is forked ``c − 1`` times
(the engine does both, :meth:`fragsim.engine.Engine`). The first token's ``w`` best
choices start the beams at the end of the prefill.

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

import numpy as np


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
