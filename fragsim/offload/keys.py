"""The keys of a request's chunks in the offload tiers, by chunk index.

Full chunks are keyed as the GPU prefix cache keys blocks (:class:`~fragsim.prefix.PrefixKeys`,
built over the tier's chunk size). The lmcache backend stores a prompt's partial
last chunk too, under a *tail* key: equal for prompts of equal content and length.
A hybrid model's chunks are keyed once per KV cache group. With decode stores
(``--no-kv-offloading-prompt-only``) the chunks of the output are
keyed too, and every chunk by :meth:`~fragsim.prefix.PrefixKeys.context_keys`
(a session turn's output chunks then equal the next turn's prompt chunks)::

    chunk 16, prompt 40, output 30 (lmcache, decode stores):
    prompt   [k0, k1, tail(40)]              looked up by a new request, stored at its end
    context  [k0, k1, k2, k3]                full chunks of the 70 tokens; k2, k3 decode
    access   [k0, k1, tail(40), k2, k3]      every key in the order of its tokens
"""

from __future__ import annotations

import numpy as np

from fragsim.prefix import KEY_STRIDE, PrefixKeys

#: keys of partial last chunks (lmcache) live above every key PrefixKeys makes
TAIL_KEYS = 1 << 62


class ChunkKeys:
    """A request's chunk keys for lookups, stores and the tiers' policies."""

    def __init__(self, keys: PrefixKeys, output_len: np.ndarray, tails: bool, decode: bool,
                 groups: int = 1) -> None:
        self.prefix = keys
        self.groups = groups        # KV cache groups: a hybrid model keys each chunk per group
        self.chunk = keys.block_size
        self.output_len = output_len
        self.tails = tails          # lmcache: a prompt's partial last chunk is stored too
        self.decode = decode
        self._access: dict[int, list[int]] = {}

    def prompt(self, req: int, prompt: int) -> list[int]:
        """The prompt's full chunks (and its tail)."""
        keys = self.prefix.keys(req, prompt)
        if self.tails and prompt % self.chunk:
            keys = [*keys, self.tail(req, prompt)]
        return keys

    def context(self, req: int, prompt: int) -> list[int]:
        """Decode stores: every full chunk of the prompt and output."""
        return self.prefix.context_keys(req, prompt, prompt + int(self.output_len[req]))

    def lookup(self, req: int, prompt: int, context: int) -> list[int]:
        """The chunks a lookup of ``context`` tokens walks: the prompt's; with decode
        stores, the full chunks of ``context`` (a request recomputed after a preemption
        finds its stored output chunks too), and the tail of a prompt looked up whole."""
        if not self.decode:
            return self.prompt(req, prompt)
        keys = self.context(req, prompt)[: context // self.chunk]
        if self.tails and context == prompt and prompt % self.chunk:
            keys = [*keys, self.tail(req, prompt)]
        return keys

    def access(self, req: int, prompt: int) -> list[int]:
        """Every key of ``req`` in the order of its tokens (the tiers' policies order by it)."""
        if not self.decode:
            return self.prompt(req, prompt)
        keys = self._access.get(req)
        if keys is None:
            keys = self.context(req, prompt)
            if self.tails and prompt % self.chunk:
                i = prompt // self.chunk
                keys = [*keys[:i], self.tail(req, prompt), *keys[i:]]
            self._access[req] = keys
        return keys

    def tail(self, req: int, prompt: int) -> int:
        """A partial last chunk's key: equal for prompts of equal content and length. A
        prompt whose content hashes cover its end has a shared tail; otherwise its own."""
        hashes = self.prefix.hashes
        covered = hashes is not None and len(hashes[req]) * self.prefix.hash_size >= prompt
        if not covered:
            return TAIL_KEYS + req * KEY_STRIDE + prompt % KEY_STRIDE
        assert hashes is not None
        return TAIL_KEYS + (hash((tuple(hashes[req]), prompt)) & (TAIL_KEYS - 1)) // 2

    def key(self, key: int, group: int) -> int:
        """A chunk's key in one KV cache group (one group: the chunk's own)."""
        return key * self.groups + group if self.groups > 1 else key

    def of_groups(self, keys: list[int]) -> list[int]:
        """Each chunk's key in every group, chunk by chunk (one group: ``keys``)."""
        if self.groups == 1:
            return keys
        return [key * self.groups + g for key in keys for g in range(self.groups)]

    def forget(self, req: int) -> None:
        self.prefix.forget(req)
        self._access.pop(req, None)
