"""The per-request table: one row per trace request, from arrival to its answer.

It owns the request arrays the engine and the summaries read (arrival, prompt and
output lengths, ``final = prompt + output``, status, refusal reason, blocked
reasons, tokens generated, preemptions, prefix-cache hits, first-token and finish
times), the status codes (``PENDING`` .. ``REFUSED``), the refusal and blocked
reasons and the counters they bump, and the request-side bookkeeping: refusals that
depend only on the request (too long, too large for the pool), arrivals joining the
queue, queue timeouts, and a request's finish. Scheduling is the engine's
(:mod:`fragsim.engine`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from fragsim.engine_config import EngineConfig
from fragsim.metrics import Counters

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


class RequestTable:
    """The trace's requests as arrays, row ``i`` the ``i``-th arrival.

    ``fits_alone(prompt, output, width)``: which requests the empty pool could hold
    (the KV manager's); ``counters``: the run's, for refusals and blocked reasons."""

    def __init__(self, trace: Any, cfg: EngineConfig,
                 fits_alone: Callable[[np.ndarray, np.ndarray, int], np.ndarray],
                 counters: Counters) -> None:
        self.counters = counters
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
        self._classify(cfg, fits_alone)
        self.final = self.prompt + self.output
        self.next_row = 0               # next row to arrive
        self.num_done = 0               # rows finished or refused
        #: the rows routed here, in a cluster (:mod:`fragsim.cluster`); None: every row
        self.mine: np.ndarray | None = None
        self.num_mine = self.N
        self.num_arrived = 0            # rows of mine that reached the queue (or a refusal)
        #: rows are routed as they arrive (a router that reads the instances' state)
        self.dynamic = False
        self.routing_done = True
        #: rows handed in after their arrival (a decode instance's, once their prefill
        #: ran elsewhere), in the order they came; they join the queue at the next pull
        self.handed_in: deque[int] = deque()
        #: rows may be handed in at any time (a stretch stops at the cluster's next event)
        self.takes_hand_ins = False
        #: requests whose prefill runs elsewhere and that will be handed in here
        self.num_expected = 0

    # -- a cluster's instance --------------------------------------------------------

    def route_all(self, mine: np.ndarray) -> None:
        """Only the rows ``mine`` come here, known before the run (a static router)."""
        self.mine = np.asarray(mine, dtype=bool)
        self.num_mine = int(self.mine.sum())
        self._index_servable(self.servable & self.mine)

    def route_as_they_come(self) -> None:
        """Rows come here as a router sends them, each at its arrival (a dynamic router)."""
        self.mine = np.zeros(self.N, dtype=bool)
        self.num_mine = 0
        self.dynamic = True
        self.routing_done = False

    def route(self, req: int) -> None:
        assert self.mine is not None and self.dynamic
        self.mine[req] = True
        self.num_mine += 1

    def hand_in(self, req: int) -> None:
        """``req`` comes here now, past its arrival: it joins the queue at the next pull."""
        assert self.mine is not None and self.dynamic and not self.mine[req]
        self.num_mine += 1
        self.num_expected = max(0, self.num_expected - 1)
        self.handed_in.append(req)

    def all_done(self) -> bool:
        """Every row that comes here is finished or refused (and no more will come)."""
        return self.routing_done and self.num_done >= self.num_mine

    def next_arrival(self) -> float:
        """When the next row that may come here arrives (inf: none known). A dynamic
        router's rows are routed at their arrival, so none is known ahead."""
        row = self.next_row
        if self.mine is not None:
            if self.dynamic:
                return math.inf
            row = int(self._next_mine[row])
        return float(self.arrival[row]) if row < self.N else math.inf

    def _classify(self, cfg: EngineConfig,
                  fits_alone: Callable[[np.ndarray, np.ndarray, int], np.ndarray]) -> None:
        """Refusals that depend only on the request: too long, or too large for the pool."""
        too_long = self.prompt + self.output > cfg.max_seq_len
        if cfg.truncate_prompts:
            fixable = too_long & (self.output < cfg.max_seq_len)
            self.prompt[fixable] = cfg.max_seq_len - self.output[fixable]
            self.counters.num_truncated = int(fixable.sum())
            too_long &= ~fixable
        if cfg.whole_prompts:  # vLLM 0.1 ignores a prompt over min(max_model_len, max_num_batched_tokens)
            too_long |= self.prompt > cfg.num_batched_tokens
        fits = fits_alone(self.prompt, self.output, cfg.width) if self.N else too_long
        too_large = ~too_long & ~fits
        self.refused[too_long] = REFUSE_TOO_LONG
        self.refused[too_large] = REFUSE_TOO_LARGE
        self.servable = ~(too_long | too_large)
        self._index_servable(self.servable)

    def _index_servable(self, servable: np.ndarray) -> None:
        """Prefix counts and next-row indexes over the rows that may be served here."""
        self.servable_cum = np.concatenate(([0], np.cumsum(servable)))
        # next_servable[i]: first servable row >= i (N if none)
        idx = np.where(servable, np.arange(self.N), self.N)
        self.next_servable = np.minimum.accumulate(idx[::-1])[::-1] if self.N else idx
        self.next_servable = np.append(self.next_servable, self.N)
        mine: np.ndarray | None = getattr(self, "mine", None)
        idx = np.where(mine, np.arange(self.N), self.N) if mine is not None else np.arange(self.N)
        self._next_mine = np.append(np.minimum.accumulate(idx[::-1])[::-1] if self.N else idx, self.N)

    def arrive(self, now: float, waiting: deque[int]) -> None:
        """Rows that arrived by ``now`` join ``waiting``; those never servable are refused."""
        arrival, mine = self.arrival, self.mine
        while self.next_row < self.N and arrival[self.next_row] <= now:
            req = self.next_row
            self.next_row += 1
            if mine is not None and not mine[req]:
                continue  # routed to another instance
            self.num_arrived += 1
            self._join(req, waiting, now)
        while self.handed_in:  # each arrived before now: the scan above passed it
            req = self.handed_in.popleft()
            assert self.mine is not None and req < self.next_row
            self.mine[req] = True
            self.num_arrived += 1
            self._join(req, waiting, now)

    def _join(self, req: int, waiting: deque[int], now: float) -> None:
        if self.servable[req]:
            self.status[req] = WAITING
            waiting.append(req)
        else:
            self.refuse(req, int(self.refused[req]), now)

    def expire(self, waiting: deque[int], now: float, timeout: float) -> deque[int]:
        """``waiting`` less the requests refused for waiting past ``timeout`` (a preempted
        request is never timed out)."""
        keep: deque[int] = deque()
        for req in waiting:
            if self.preemptions[req] == 0 and now - self.arrival[req] > timeout:
                self.refuse(req, REFUSE_TIMEOUT, now)
            else:
                keep.append(req)
        return keep

    def refuse(self, req: int, reason: int, now: float) -> None:
        self.status[req] = REFUSED
        self.refused[req] = reason
        # Unservable requests are answered on arrival; a timeout when it is noticed.
        self.finish[req] = now if reason == REFUSE_TIMEOUT else self.arrival[req]
        self.num_done += 1
        self.counters.bump(_REFUSAL_COUNTER[reason])

    def finish_at(self, req: int, now: float) -> None:
        """``req`` has generated its whole output at ``now``."""
        self.status[req] = FINISHED
        self.generated[req] = self.output[req]
        self.finish[req] = now
        self.num_done += 1

    def mark_blocked(self, req: int, kind: int) -> None:
        """``req`` was kept out of the batch for reason ``kind`` (counted once per kind)."""
        if self.blocked[req] & kind:
            return
        self.blocked[req] |= kind
        self.counters.bump(_BLOCK_COUNTER[kind])
