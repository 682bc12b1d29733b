"""Content keys of prompt blocks, for prefix caching.

vLLM identifies a full block by ``hash(parent block's hash, the block's tokens)``,
so two prompts share a cached block exactly when they agree on every token up to
its end. Traces carry no tokens; what they may carry is a hash per *content
block* (Mooncake's ``hash_ids``, one per 512 prompt tokens, equal ids = equal
content). An engine block (``block_size`` tokens, 16 by default) is mapped onto
them: it covers tokens ``[k·B, (k+1)·B)``, i.e. content blocks ``c0 .. c1`` with
``c1 = ((k+1)·B − 1) // H``, and its content is fixed by the chain of content
hashes up to ``c1`` and its index ``k``::

    H = 512, B = 16: engine blocks 0..31 lie in content block 0, 32..63 in block 1
    key(k) = (chain id of hash_ids[0..c1], k)

Chains are interned (``(parent chain id, hash) -> chain id``), so a key is two
small integers packed into one (``chain × 2**32 + k``) and equal prefixes give
equal keys with no hash collisions. Engine blocks not covered by content hashes
get a key of their own request (negative, never equal to another request's): a
request can then still hit its own blocks when it is readmitted after a
preemption, and nobody else can.

The prefix cache keys *prompt* blocks only. vLLM also caches blocks of generated
tokens; in a trace those are never equal across requests, so the only hits they
could give are a preempted request's own, which this model recomputes instead.
An offload tier that stores decode blocks keys them too (:meth:`PrefixKeys.context_keys`):
by the trace's ``context_hashes`` where it has them (sessions: a block of one turn's
output keys equal to the same block of the next turn's prompt), else as the
request's own.
"""

from __future__ import annotations

import numpy as np

from fragsim.traces import Trace

KEY_STRIDE = 1 << 32  # engine blocks per chain id in a packed key


class PrefixKeys:
    """Per-request keys of the full prompt blocks (memoised until :meth:`forget`)."""

    def __init__(self, trace: Trace, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.hashes = trace.block_hashes
        self.hash_size = trace.block_hash_size or 1
        self._chains: dict[tuple[int, int], int] = {}
        self._memo: dict[int, list[int]] = {}
        self._context_memo: dict[int, list[int]] = {}
        self.context = trace.context_hashes

    def _chain_ids(self, hashes: tuple[int, ...]) -> list[int]:
        chains, out, parent = self._chains, [], 0
        for h in hashes:
            parent = chains.setdefault((parent, h), len(chains) + 1)
            out.append(parent)
        return out

    def keys(self, req: int, prompt_len: int) -> list[int]:
        """Keys of the ``prompt_len // block_size`` full blocks of request ``req``'s prompt."""
        memo = self._memo.get(req)
        if memo is not None and len(memo) == prompt_len // self.block_size:
            return memo
        hashes = self.hashes[req] if self.hashes is not None else ()
        keys = self._keys(req, hashes, prompt_len // self.block_size)
        self._memo[req] = keys
        return keys

    def context_keys(self, req: int, prompt_len: int, num_tokens: int) -> list[int]:
        """Keys of the ``num_tokens // block_size`` full blocks of ``req``'s prompt and
        output. With the trace's ``context_hashes`` every block is keyed by them (the
        conversation's ids, prompt blocks included, so that a turn's prompt blocks in a
        content block it leaves partial match the next turn's too); without, the prompt's
        full blocks are keyed as :meth:`keys` keys them and the rest are the request's own."""
        memo = self._context_memo.get(req)
        if memo is not None and len(memo) == num_tokens // self.block_size:
            return memo
        n = num_tokens // self.block_size
        if self.context is not None:
            keys = self._keys(req, self.context[req], n)
        else:
            prompt = self.keys(req, min(prompt_len, num_tokens))
            keys = prompt + self._keys(req, (), n)[len(prompt):]
        self._context_memo[req] = keys
        return keys

    def _keys(self, req: int, hashes: tuple[int, ...], n: int) -> list[int]:
        """Keys of blocks ``0 .. n-1`` under content ``hashes`` (the request's own past them)."""
        B = self.block_size
        k = np.arange(n, dtype=np.int64)
        own = -(req * KEY_STRIDE + k) - 1
        if hashes:
            chain = np.array(self._chain_ids(hashes), dtype=np.int64)
            c1 = ((k + 1) * B - 1) // self.hash_size
            inside = np.minimum(c1, len(chain) - 1)
            out = np.where(c1 < len(chain), chain[inside] * KEY_STRIDE + k, own)
        else:
            out = own
        keys: list[int] = out.tolist()
        return keys

    def forget(self, req: int) -> None:
        self._memo.pop(req, None)
        self._context_memo.pop(req, None)


def with_system_prompt(trace: Trace, system_prompt_len: int) -> Trace:
    """Every prompt preceded by the same ``system_prompt_len`` tokens, as content hashes say.

    The prompt lengths grow by ``system_prompt_len``; each request gets one content
    hash, ``0``, covering its first ``system_prompt_len`` tokens (``block_hash_size``
    = the system prompt), so the engine blocks inside it are shared by every request
    and the rest are each request's own.
    """
    if system_prompt_len < 1:
        raise ValueError(f"system_prompt_len must be >= 1, got {system_prompt_len}")
    if trace.block_hashes is not None:
        raise ValueError(f"{trace.name} already has content hashes; a system prompt would replace them")
    return Trace(f"{trace.name}+sys{system_prompt_len}", f"{trace.source}+system_prompt={system_prompt_len}",
                 trace.arrival_s, trace.prompt_len + system_prompt_len, trace.output_len,
                 block_hashes=[(0,)] * len(trace), block_hash_size=system_prompt_len,
                 has_timestamps=trace.has_timestamps, session=trace.session)
