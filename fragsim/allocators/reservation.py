"""Reservation policies: how many slots a request asks for when it is admitted.

The placement decides *where* slots go; the policy decides *how many* are asked
for up front. A request of ``prompt_len`` tokens that will generate
``output_len`` more, under ``max_seq_len = 2048``::

    policy   reserves                               prompt 100, output 25
    max      max_seq_len                            2048   (FasterTransformer, Orca Max)
    pow2     prompt_len + next_pow2(output_len)     132    (Orca Pow2: 25 -> 32)
    oracle   prompt_len + output_len                125    (Orca Oracle: knows the future)
    demand   prompt_len + 1                         101    (vLLM: the rest one extend at a time)

Every policy is capped at ``max_seq_len``: a request longer than that is the
engine's to refuse, never the allocator's to over-reserve for.

The small option checks shared by the allocator constructors live here too, so
that every bad value gets the same shape of message: the option, the allowed
values, what was given.
"""

from __future__ import annotations

from collections.abc import Iterable

#: every policy reserve_slots() knows, in the order the CLI lists them
RESERVE_POLICIES: tuple[str, ...] = ("max", "pow2", "oracle", "demand")
#: policies for placements that cannot grow a sequence after allocate()
UPFRONT_POLICIES: tuple[str, ...] = ("max", "pow2", "oracle")


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (``next_pow2(25) == 32``, ``next_pow2(0) == 0``)."""
    if n <= 0:
        return 0
    return 1 << (n - 1).bit_length()


def reserve_slots(policy: str, prompt_len: int, output_len: int, max_seq_len: int) -> int:
    """Slots a request asks for at admission under ``policy`` (see the module table)."""
    check_int("prompt_len", prompt_len, 1)
    check_int("output_len", output_len, 0)
    check_int("max_seq_len", max_seq_len, 1)
    if policy == "max":
        wanted = max_seq_len
    elif policy == "pow2":
        wanted = prompt_len + next_pow2(output_len)
    elif policy == "oracle":
        wanted = prompt_len + output_len
    elif policy == "demand":
        wanted = prompt_len + 1
    else:
        raise ValueError(
            f"unknown reservation policy {policy!r}; allowed: {_listing(RESERVE_POLICIES)}"
        )
    return min(wanted, max_seq_len)


def check_int(option: str, value: object, minimum: int) -> int:
    """Return ``value`` if it is an int >= ``minimum``; ValueError naming ``option`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{option} must be an integer >= {minimum}, got {value!r}")
    return value


def check_choice(option: str, value: object, allowed: Iterable[str]) -> str:
    """Return ``value`` if it is one of ``allowed``; ValueError listing them otherwise."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{option} must be one of {_listing(allowed)}, got {value!r}")
    return str(value)


def _listing(names: Iterable[str]) -> str:
    return ", ".join(repr(name) for name in names)
