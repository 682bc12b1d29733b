"""Block sharing over a dense paged allocator that can fork: a request's sequences at
admission, and the prefix cache.

The allocator is :class:`~fragsim.allocators.shared.SharedPagedAllocator`
(reference-counted blocks, fork, copy-on-write, cached keys); what the engine
does with several sequences per request (parallel samples, beams) is
:mod:`fragsim.engine`'s and :mod:`fragsim.beams`'.

Admission (:func:`admit_group`)
    The request's first sequence takes ``context + 1`` slots, its leading cached
    blocks reused; each of the other ``n − 1`` sequences is forked from it over the
    prompt and takes room for its own first token: copy-on-write of the prompt's
    partial last block (which stays the first sequence's), or a fresh block when the
    prompt ends on a block boundary. Either way a sample costs one block at
    admission, so an admitted request never fails at the end of its prefill. All of
    it is checked against the free blocks first: all or nothing.

Prefix caching (:class:`DensePrefixCache`)
    At admission the leading full prompt blocks whose keys (:mod:`fragsim.prefix`)
    are cached are reused (at most ``(context − 1) // block_size`` of them: one
    token is always computed), and prefill starts after them. Computed full prompt
    blocks are registered at the end of the step that computed them, so a request
    admitted in the same step as another with the same prefix computes it too
    (vLLM v1 does the same). Freed cached blocks stay in the free queue with their
    keys until taken again: in the split they are *free*.

Counting with sharing: a slot is counted once whatever the number of sequences
holding it; :class:`~fragsim.kv.dense.DenseKV` subtracts ``shared_slots`` (the
allocator's ``num_shared_slots``) from Σ owned. That holds because every block held
more than once is full and stored in each holder whenever the split is recorded:
forks copy a partly filled last block before the step runs, prefix hits are full
computed blocks. A prefilling request counts its stored tokens once, so the slots
its own not-yet-decoding sequences share (:attr:`Admitted.shared`) are not
subtracted from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fragsim.kv.protocol import Admitted, Hit
from fragsim.prefix import PrefixKeys


class DensePrefixCache:
    """vLLM's automatic prefix caching over a forking paged allocator."""

    def __init__(self, allocator: Any, keys: PrefixKeys) -> None:
        self.alloc = allocator
        self._keys = keys

    def keys(self, req: int, prompt_len: int) -> list[int]:
        return self._keys.keys(req, prompt_len)

    def lookup(self, req: int, prompt_len: int, context: int) -> Hit:
        """The leading cached blocks of the request's prompt (one token is always
        computed): ``detail`` is (their keys, how many of them are free blocks now)."""
        B = self.alloc.block_size
        keys = self._keys.keys(req, prompt_len)
        usable = keys[: min(len(keys), (context - 1) // B)]
        hits, from_free = self.alloc.cache_hits(usable)
        return Hit(hits * B, (usable[:hits], from_free))

    def cache(self, req: int, prompt_len: int, computed: int) -> None:
        blocks = min(computed, prompt_len) // self.alloc.block_size
        if blocks:
            self.alloc.cache_blocks(req, self._keys.keys(req, prompt_len)[:blocks])

    def forget(self, req: int) -> None:
        self._keys.forget(req)

    def summary(self) -> dict[str, Any]:
        return {}


def admit_group(alloc: Any, seqs: Sequence[int], tokens: int, prompt: int,
                hit: Hit | None) -> Admitted | None:
    """The request's sequences placed together (see the module docstring); None, with
    nothing changed, when the free blocks do not hold them all."""
    B = alloc.block_size
    cached, from_free = hit.detail if hit is not None else ((), 0)
    blocks = -(-tokens // B) - len(cached) + from_free + (len(seqs) - 1)
    if blocks > alloc.num_free_blocks():
        return None
    first, *others = seqs
    if alloc.allocate(first, tokens, cached) is None:
        raise AssertionError(f"request {first}: {blocks} blocks were free but allocate failed")
    for child in others:
        alloc.fork(first, child, prompt)
        if not alloc.extend(child, 1):
            raise AssertionError(f"request {first}: no block for sample {child}'s first token")
    return Admitted(tuple(alloc.room(seq) for seq in seqs), len(others) * B * (prompt // B))
