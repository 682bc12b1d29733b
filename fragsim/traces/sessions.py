"""Multi-turn chat sessions: each turn's prompt is the whole conversation so far plus a new message.

A session is a conversation of ``T`` turns. Turn ``t`` sends the system prompt (if
any), every earlier message and answer, and its own message::

    prompt_t = system + m_1 + o_1 + ... + m_(t-1) + o_(t-1) + m_t        output o_t

so the prompts of one session share ever longer prefixes, and every session
shares the system prompt. Content is given as Mooncake gives it: one hash id per
512 prompt tokens (:data:`~fragsim.traces.loaders.MOONCAKE_BLOCK_SIZE`), equal ids
for equal content. A full 512-token block of a session's conversation keeps its
id in every later turn; the partial last block of a prompt gets an id of its own
(the next turn's block at that place holds more tokens, so it differs), as does
any block that mixes the system prompt and the session's first message. Full
blocks inside the system prompt have ids shared by all sessions.

Each turn also carries the ids of its prompt and output together as the
conversation holds them (the trace's ``context_hashes``): a block the turn leaves
partial has the id the block gets once a later prompt fills it, so a block of
generated tokens keys equal to the same block of the next turn's prompt
(:mod:`fragsim.prefix`; decode stores of an offload tier hit on it).

What is drawn, each from its own stream of one seed:

- sessions start as a Poisson process at ``session_rate`` per second;
- the number of turns is geometric with mean ``turns_mean`` (at least 1, at most
  ``max_turns``);
- the gap from one turn's arrival to the next turn's is exponential with mean
  ``think_time_s``. It is the user's time between sending two messages (reading
  the answer and writing), and the trace is open-loop: a replay does not wait for
  the answer before sending the next turn;
- each turn's (message, output) lengths: drawn from a synthetic workload's
  distributions (``sharegpt-paper``, ``alpaca-paper``) or sampled, with
  replacement, from the rows of a length file or trace (any file
  :func:`~fragsim.traces.load_trace` reads).

With ``max_len`` a session ends before the first turn whose prompt and output
would not fit in that many tokens (a first turn that does not fit is dropped).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from fragsim.errors import FragsimError
from fragsim.traces.loaders import MOONCAKE_BLOCK_SIZE, load_trace
from fragsim.traces.request import Trace
from fragsim.traces.workloads import WORKLOADS, Workload, sample_lengths

DEFAULT_LENGTHS = "sharegpt-paper"


@dataclass(frozen=True)
class SessionSpec:
    """What a session trace is drawn from (see the module docstring)."""

    num_sessions: int
    session_rate: float  # sessions starting per second
    turns_mean: float = 4.0
    max_turns: int = 50
    think_time_s: float = 30.0
    lengths: str = DEFAULT_LENGTHS  # workload name or length file
    system_prompt_len: int = 0
    max_len: int | None = None
    seed: int = 0

    def check(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise FragsimError(what)

        need(self.num_sessions >= 1, f"num_sessions must be >= 1, got {self.num_sessions}")
        need(self.session_rate > 0, f"session_rate must be > 0 per second, got {self.session_rate}")
        need(self.turns_mean >= 1, f"turns_mean must be >= 1, got {self.turns_mean}")
        need(self.max_turns >= 1, f"max_turns must be >= 1, got {self.max_turns}")
        need(self.think_time_s >= 0, f"think_time_s must be >= 0, got {self.think_time_s}")
        need(self.system_prompt_len >= 0,
             f"system_prompt_len must be >= 0, got {self.system_prompt_len}")
        need(self.max_len is None or self.max_len >= 2, f"max_len must be >= 2, got {self.max_len}")


@dataclass
class Sessions:
    """A session trace and, per request, its session and turn (both from 0).

    ``session`` is the trace's own ``session`` column."""

    trace: Trace
    session: np.ndarray
    turn: np.ndarray


class _Lengths:
    """(message, output) pairs from a workload's distributions or a file's rows."""

    def __init__(self, source: str, rng: np.random.Generator) -> None:
        self.rng = rng
        self.workload: Workload | None = WORKLOADS.get(source)
        self.rows: tuple[np.ndarray, np.ndarray] | None = None
        if self.workload is None:
            trace = load_trace(source)
            self.rows = (trace.prompt_len, trace.output_len)

    def draw(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if self.workload is not None:
            return sample_lengths(self.workload, n, self.rng)
        assert self.rows is not None
        pick = self.rng.integers(0, len(self.rows[0]), size=n)
        return self.rows[0][pick], self.rows[1][pick]


def make_sessions(spec: SessionSpec) -> Sessions:
    """Draw a session trace (see the module docstring)."""
    spec.check()
    start_seed, turn_seed, gap_seed, length_seed = np.random.SeedSequence(spec.seed).spawn(4)
    n = spec.num_sessions
    starts = np.cumsum(np.random.default_rng(start_seed).exponential(1.0 / spec.session_rate, n))
    starts -= starts[0]
    turns = np.minimum(np.random.default_rng(turn_seed).geometric(1.0 / spec.turns_mean, n),
                       spec.max_turns)
    total = int(turns.sum())
    gaps = np.random.default_rng(gap_seed).exponential(spec.think_time_s, total) \
        if spec.think_time_s > 0 else np.zeros(total)
    messages, outputs = _Lengths(spec.lengths, np.random.default_rng(length_seed)).draw(total)

    H, S = MOONCAKE_BLOCK_SIZE, spec.system_prompt_len
    fresh = itertools.count(S // H)  # ids below S // H: the system prompt's full blocks
    rows: list[tuple[float, int, int, tuple[int, ...], int, int]] = []
    conversations: list[list[int]] = []  # per session, the ids of its full blocks so far
    at = 0
    for s in range(n):
        time, context = float(starts[s]), S
        full_ids: list[int] = list(range(S // H))  # ids of this session's full blocks so far
        conversations.append(full_ids)
        for t in range(int(turns[s])):
            if t:
                time += float(gaps[at + t - 1])
            m, o = int(messages[at + t]), int(outputs[at + t])
            prompt = context + m
            if spec.max_len is not None and prompt + o > spec.max_len:
                break
            while len(full_ids) < prompt // H:
                full_ids.append(next(fresh))
            partial = (next(fresh),) if prompt % H else ()
            rows.append((time, prompt, o, (*full_ids[: prompt // H], *partial), s, t))
            context = prompt + o
        at += int(turns[s])
    if not rows:
        raise FragsimError(f"no turn fits in max_len {spec.max_len} tokens")
    rows.sort(key=lambda row: row[0])
    arrival, prompt_len, output_len, hashes, session, turn = map(list, zip(*rows, strict=True))
    source = (f"sessions:n={n},rate={spec.session_rate:g},turns={spec.turns_mean:g},"
              f"think={spec.think_time_s:g}s,lengths={spec.lengths},system={S},seed={spec.seed}")
    trace = Trace("sessions", source, np.asarray(arrival), np.asarray(prompt_len),
                  np.asarray(output_len), block_hashes=hashes, block_hash_size=H,
                  session=np.asarray(session, dtype=np.int64),
                  context_hashes=_conversation_ids(conversations, prompt_len, output_len, session, fresh))
    assert trace.session is not None
    return Sessions(trace, trace.session, np.asarray(turn, dtype=np.int64))


def _conversation_ids(conversations: list[list[int]], prompt_len: list[int], output_len: list[int],
                      session: list[int], fresh: itertools.count[int]) -> list[tuple[int, ...]]:
    """Each turn's content ids over its prompt and output, as the conversation holds them:
    a block that a later turn's prompt fills has that turn's id; the blocks past the last
    prompt's full ones get ids of their own (drawn after every prompt's, so the prompts'
    ids are those of a trace without them)."""
    H = MOONCAKE_BLOCK_SIZE
    total: dict[int, int] = {}
    for s, p, o in zip(session, prompt_len, output_len, strict=True):
        total[s] = max(total.get(s, 0), p + o)
    for s in sorted(total):
        ids = conversations[s]
        while len(ids) < -(-total[s] // H):
            ids.append(next(fresh))
    return [tuple(conversations[s][: -(-(p + o) // H)])
            for s, p, o in zip(session, prompt_len, output_len, strict=True)]
