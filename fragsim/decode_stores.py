"""Decode stores: chunks that generated tokens complete go to the engine's connector.

With ``--no-kv-offloading-prompt-only`` an offload tier stores the chunks a request's
generated tokens complete as well as its prompt's (vLLM 0.33's ``OffloadingConnector``
with ``offload_prompt_only`` off: its offloadable tokens are the request's computed
ones, not capped at the prompt). A chunk is offered at the end of the step that
computed its last token's KV, as a prompt chunk is.

A decoding row holds ``offset + g`` tokens (:mod:`fragsim.batch`), the newest of
them sampled in the step now ending and its KV not yet computed, so its KV covers
``offset + g − 1`` tokens::

    chunk C = 16, a 40-token prompt: the prefill step ends with 41 tokens, KV of 40;
    steps 8 and 24 after it end with KV of 48 and 64 tokens: chunks 2 and 3 are offered

and a request that finishes with ``prompt + output`` tokens has KV of one fewer: a
chunk its last token would complete is never stored (vLLM: the final sampled token's
slot is never committed). Its last partial chunk is not stored either.

A stretch of decode steps (:mod:`fragsim.stretch`) stops before the first step that
completes a chunk, so that step runs on its own and its store starts when it ends;
the link is then busy and the engine steps one at a time until the store lands.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fragsim.engine import Engine


def offer(engine: Engine) -> None:
    """End of a step (``engine.g`` counts it): offer the connector every decoding row
    whose computed tokens reached a multiple of its chunk in this step."""
    connector, b = engine.connector, engine.batch
    if connector is None or connector.decode_chunk is None or not b.n:
        return
    computed = b.offset[: b.n] + (engine.g - 1)
    rows = (computed % connector.decode_chunk == 0).nonzero()[0]
    if not len(rows):
        return
    prompt, now = engine.requests.prompt, engine.now
    for req, done in zip(b.req[rows].tolist(), computed[rows].tolist(), strict=True):
        connector.store(req, int(prompt[req]), done, now)


def steps_before(engine: Engine) -> int | None:
    """Decode steps from now before the first that completes a chunk of a decoding row
    (None: the connector stores prompt chunks only). Step ``j`` from now leaves a row
    with KV of ``offset + g + j`` tokens."""
    connector, b = engine.connector, engine.batch
    if connector is None or connector.decode_chunk is None or not b.n:
        return None
    return int((-(b.offset[: b.n] + engine.g) % connector.decode_chunk).min())
