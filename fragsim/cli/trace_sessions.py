"""``fragsim trace sessions``: write a multi-turn session trace with content hashes.

The trace (:mod:`fragsim.traces.sessions`) is Mooncake JSON lines, so every command
that takes a trace file reads it: ``fragsim run --trace``, ``fragsim trace stats``,
``fragsim trace hits``. Each record also carries its ``session`` and ``turn``.
"""

from __future__ import annotations

import argparse

from fragsim.cli.args import positive_float, positive_int

DESCRIPTION = (
    "Draw multi-turn chat sessions and write them as a Mooncake JSONL trace: each turn's "
    "prompt is the whole conversation so far (system prompt, earlier messages and answers) "
    "plus a new message, with one content hash per 512 prompt tokens so that turns of a "
    "session, and sessions sharing a system prompt, share prefix blocks. Sessions start as "
    "a Poisson process; turns per session are geometric; the gap between a session's turns "
    "is exponential (open loop: a replay does not wait for the answer)."
)


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _at_least_one(text: str) -> float:
    value = positive_float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def register(commands: argparse._SubParsersAction) -> None:
    from fragsim.traces.sessions import DEFAULT_LENGTHS, SessionSpec

    d = SessionSpec(1, 1.0)
    p = commands.add_parser("sessions", help="write a multi-turn session trace (Mooncake JSONL)",
                            description=DESCRIPTION)
    p.add_argument("out", metavar="OUT.jsonl", help="trace file to write")
    p.add_argument("--num-sessions", type=positive_int, default=1000, metavar="N",
                   help="sessions (default 1000)")
    p.add_argument("--session-rate", type=positive_float, default=1.0, metavar="R",
                   help="sessions starting per second (default 1)")
    p.add_argument("--turns-mean", type=_at_least_one, default=d.turns_mean, metavar="T",
                   help=f"mean turns per session, geometric (default {d.turns_mean:g})")
    p.add_argument("--max-turns", type=positive_int, default=d.max_turns, metavar="K",
                   help=f"most turns per session (default {d.max_turns})")
    p.add_argument("--think-time", type=_non_negative, default=d.think_time_s, metavar="S",
                   help=f"mean seconds between a session's turns, exponential "
                        f"(default {d.think_time_s:g})")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, metavar="WORKLOAD|FILE",
                   help="message and output lengths: a workload (sharegpt-paper, alpaca-paper) "
                        "or a length file or trace whose rows are sampled "
                        f"(default {DEFAULT_LENGTHS})")
    p.add_argument("--system-prompt-len", type=int, default=0, metavar="S",
                   help="tokens of one system prompt that starts every session (default 0)")
    p.add_argument("--max-len", type=positive_int, metavar="L",
                   help="end a session before a turn whose prompt + output exceed L tokens")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from fragsim.offload.replay import chunk_keys, prefix_seen
    from fragsim.traces.loaders import save_mooncake
    from fragsim.traces.sessions import SessionSpec, make_sessions

    spec = SessionSpec(args.num_sessions, args.session_rate, args.turns_mean, args.max_turns,
                       args.think_time, args.lengths, args.system_prompt_len, args.max_len,
                       args.seed)
    sessions = make_sessions(spec)
    trace = sessions.trace
    save_mooncake(trace, args.out, {"turn": sessions.turn})  # the trace writes its session
    keys = chunk_keys(trace, 512)
    refs = sum(len(k) for k in keys)
    prefix, _ = prefix_seen(keys)
    sessions_kept = len(set(sessions.session.tolist()))
    print(f"wrote {args.out}: {len(trace):,} requests in {sessions_kept:,} sessions "
          f"({len(trace) / sessions_kept:.2f} turns each), {trace.duration_s:,.1f} s")
    print(f"prompt tokens mean {trace.prompt_len.mean():,.0f}, max {trace.prompt_len.max():,}; "
          f"output mean {trace.output_len.mean():,.0f}")
    if refs:
        print(f"full 512-token prompt chunks: {refs:,}, {prefix / refs:.1%} of them a prefix "
              "seen before (the hit rate of an unbounded cache)")
    return 0
