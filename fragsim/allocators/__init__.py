"""KV-cache allocators: placements, reservation policies, and the presets that pair them.

``create(name, capacity_slots, **options)`` builds one. ``name`` is a placement
(how slots are laid out) or a preset (a placement with a reservation policy, the
systems the papers compare)::

    preset        placement   reserve   the system
    ft-static     static      max       FasterTransformer / HF: a max_seq_len row per request
    orca-max      buddy       max       Orca as the vLLM paper models it, reserving 2048
    orca-pow2     buddy       pow2      ... reserving the output rounded up to a power of two
    orca-oracle   buddy       oracle    ... knowing the true output length
    vllm          paged       demand    PagedAttention, 16-slot blocks, one token at a time
    vattention    vmm         demand    vAttention: virtually contiguous, 2 MiB pages mapped on demand

Options (each placement takes those its constructor names):

    max_seq_len   all           longest sequence, default 2048
    reserve       all           static/contiguous/buddy: max, pow2, oracle; paged: demand
    max_num_seqs  static        rows in the array, default capacity // max_seq_len
    fit           contiguous    "first" or "best"
    min_block     buddy         smallest block, a power of two, default 1
    block_size    paged         slots per block, default 16 (paged-shared too)
    page_bytes    vmm           bytes of one physical page, default 64 KiB (vattention: 2 MiB)
    token_bytes   vmm           bytes of one token in one K or V buffer of one layer, default 4 KiB

``paged-shared`` is ``paged`` with reference-counted blocks, fork, copy-on-write
and a prefix cache; the engine uses it in place of ``paged`` when a run shares
blocks (parallel sampling, beam search, prefix caching).

More placements are registered by adding a class to ``PLACEMENTS``: its
constructor takes ``(capacity, *, name, **options)`` with keyword-only options,
and ``create`` accepts exactly the keyword names it declares.
"""

from __future__ import annotations

import inspect
from typing import Any

from fragsim.allocators.base import Allocator, BlockTable, Extent, Placement
from fragsim.allocators.buddy import BuddyAllocator
from fragsim.allocators.contiguous import ContiguousAllocator
from fragsim.allocators.paged import PagedAllocator
from fragsim.allocators.reservation import RESERVE_POLICIES, reserve_slots
from fragsim.allocators.shared import SharedPagedAllocator
from fragsim.allocators.static import StaticAllocator
from fragsim.allocators.vmm import VMMAllocator
from fragsim.errors import FragsimError

__all__ = [
    "PLACEMENTS",
    "PRESETS",
    "RESERVE_POLICIES",
    "Allocator",
    "AllocatorConfigError",
    "BlockTable",
    "BuddyAllocator",
    "ContiguousAllocator",
    "Extent",
    "PagedAllocator",
    "Placement",
    "SharedPagedAllocator",
    "StaticAllocator",
    "VMMAllocator",
    "create",
    "options_of",
    "reserve_slots",
]

#: placement name -> class; create() builds any of them
PLACEMENTS: dict[str, type[Any]] = {
    "static": StaticAllocator,
    "contiguous": ContiguousAllocator,
    "buddy": BuddyAllocator,
    "paged": PagedAllocator,
    "paged-shared": SharedPagedAllocator,
    "vmm": VMMAllocator,
}

#: preset name -> (placement, options it fixes); options given to create() override
#: all but ``reserve``, which is what the preset stands for
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "ft-static": ("static", {"reserve": "max"}),
    "orca-max": ("buddy", {"reserve": "max"}),
    "orca-pow2": ("buddy", {"reserve": "pow2"}),
    "orca-oracle": ("buddy", {"reserve": "oracle"}),
    "vllm": ("paged", {"block_size": 16, "reserve": "demand"}),
    "vattention": ("vmm", {"page_bytes": 2 * 1024 * 1024, "reserve": "demand"}),
}


class AllocatorConfigError(FragsimError, ValueError):
    """A bad allocator name or option; a ValueError, and a one-line error on the CLI."""


def options_of(placement: str) -> list[str]:
    """The option names ``create`` accepts for ``placement``, in constructor order."""
    parameters = inspect.signature(PLACEMENTS[placement]).parameters.values()
    return [p.name for p in parameters if p.kind is p.KEYWORD_ONLY and p.name != "name"]


def create(name: str, capacity_slots: int, **options: Any) -> Allocator:
    """Build the allocator ``name`` (a placement or a preset) over ``capacity_slots`` slots."""
    if name in PRESETS:
        placement, fixed = PRESETS[name]
        if "reserve" in options and options["reserve"] != fixed.get("reserve", options["reserve"]):
            raise AllocatorConfigError(
                f"preset {name!r} reserves {fixed['reserve']!r}, got reserve={options['reserve']!r}; "
                f"use placement {placement!r} to choose another policy"
            )
        options = {**fixed, **options}
    elif name in PLACEMENTS:
        placement = name
    else:
        raise AllocatorConfigError(
            f"unknown allocator {name!r}; placements: {', '.join(PLACEMENTS)}; presets: {', '.join(PRESETS)}"
        )
    allowed = options_of(placement)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise AllocatorConfigError(
            f"allocator {name!r} ({placement}) has no option {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(allowed)}"
        )
    try:
        allocator: Allocator = PLACEMENTS[placement](capacity_slots, name=name, **options)
    except ValueError as exc:
        raise AllocatorConfigError(f"allocator {name!r}: {exc}") from None
    return allocator
