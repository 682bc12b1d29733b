"""The ``fragsim`` command line.

Each subcommand lives in its own module of this package and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to a
``main(args) -> int``. Modules import heavy dependencies inside ``main`` so that
``fragsim --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from fragsim import __version__
from fragsim.errors import FragsimError

# Order is the order shown by --help.
COMMANDS = ["run", "cluster", "capacity", "trace", "validate", "sweep", "calibrate", "snapshot", "caching"]  # modules of this package


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fragsim",
        description=(
            "Replay LLM request traces against KV-cache allocators and see where "
            "the memory goes: token states, reservation, internal and external "
            "fragmentation, and what that costs in throughput and latency."
        ),
    )
    parser.add_argument("--version", action="version", version=f"fragsim {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"fragsim.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"fragsim.cli.{name}":
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except FragsimError as exc:
        print(f"fragsim: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fragsim: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
