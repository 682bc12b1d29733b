"""Admission: waiting requests join the running batch, first come first served.

Each request starts after its prefix-cache hit and whatever the engine's KV connector
(:mod:`fragsim.connector`) supplies past it: an offload tier's blocks, or the KV a
prefill instance made. Its sequences are placed by the KV manager (which may place
only what reading past KV still arriving needs), and a request with KV on the way
waits for it (vLLM: ``WAITING_FOR_REMOTE_KVS``) until :func:`poll_connector` sees it
land. The engine (:mod:`fragsim.engine`) calls both once a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fragsim.batch import Prefill
from fragsim.request_table import BLOCK_BATCH, BLOCK_CAP, BLOCK_FRAG, REFUSE_TOO_LONG, RUNNING

if TYPE_CHECKING:
    from fragsim.engine import Engine


def admit(engine: Engine, skipped: list[int]) -> bool:
    """Admit FCFS from ``engine.waiting`` (see :meth:`Engine.admit_waiting`); requests a
    connector asks to skip go to ``skipped``."""
    cfg, kv, width, reqs, connector = engine.cfg, engine.kv, engine.width, engine.requests, engine.connector
    prefix = kv.prefix
    running = engine.num_running()
    while engine.waiting:
        req = engine.waiting[0]
        if running + width > cfg.max_num_seqs or engine.budget <= 0:
            reqs.mark_blocked(req, BLOCK_BATCH)
            return True
        prompt = int(reqs.prompt[req])
        # A group restarts from its prompt after a preemption; one sequence resumes.
        context = prompt if width > 1 else prompt + int(reqs.generated[req])
        hit = prefix.lookup(req, prompt, context) if prefix is not None else None
        gpu_hit = hit.tokens if hit is not None else 0
        if cfg.whole_prompts and context - gpu_hit > engine.budget:  # never chunked (vllm-v0, orca)
            if context - gpu_hit > cfg.num_batched_tokens:
                # Recomputed after a preemption, it outgrew any step: vLLM 0.1 ignores it.
                engine.waiting.popleft()
                reqs.refuse(req, REFUSE_TOO_LONG, engine.now)
                continue
            reqs.mark_blocked(req, BLOCK_BATCH)
            return True
        external = connector.probe(req, prompt, context, gpu_hit) if connector is not None else 0
        if external is None:
            # Part of its hit in a tier is still being written: vLLM skips it this step.
            skipped.append(engine.waiting.popleft())
            continue
        tokens = kv.admission_tokens(prompt, int(reqs.output[req]), context)
        seqs = (req,) if width == 1 else (req, *range(engine.next_seq, engine.next_seq + width - 1))
        admitted = kv.admit(seqs, tokens, int(reqs.final[req]), prompt, hit,
                            min(external, context - 1 - gpu_hit))
        if admitted is None:
            frag = kv.blocked_by_fragmentation(tokens)
            reqs.mark_blocked(req, BLOCK_FRAG if frag else BLOCK_CAP)
            return True
        engine.next_seq += width - 1
        if engine.fork_log is not None:
            engine.fork_log += [(req, child, prompt) for child in seqs[1:]]
        engine.waiting.popleft()
        reqs.status[req] = RUNNING
        done = gpu_hit
        p = Prefill(req, context, done, seqs, admitted.rooms, admitted.shared, done)
        engine.prefilling.append(p)
        if prefix is not None:
            engine.num_prefix_queries += context
            engine.num_prefix_hits += done
            reqs.cached[req] = done
        if connector is not None:
            p.loading = connector.start_load(req, prompt, context, done, engine.now)
            if p.loading:
                continue  # out of the running set until it lands (vLLM: WAITING_FOR_REMOTE_KVS)
        running += width
        take_chunk(engine, p)
    return True


def take_chunk(engine: Engine, p: Prefill) -> None:
    """The next chunk of ``p``'s prompt in this step, as much as the token budget allows."""
    chunk = min(engine.budget, p.target - p.done)
    engine.chunks.append((p, chunk))
    engine.budget -= chunk


def poll_connector(engine: Engine) -> None:
    """Transfers that landed by now: loaded requests may prefill the rest, and held
    blocks are freed."""
    assert engine.connector is not None
    ready, freed = engine.connector.poll(engine.now, engine.free_held)
    engine.freed |= freed
    if not ready:
        return
    loaded = set(ready)
    for p in engine.prefilling:
        if p.req in loaded:
            # A load of the whole request leaves its last token to compute (vLLM).
            loaded_tokens = min(p.loading, p.target - 1 - p.done)
            p.done += loaded_tokens
            p.cached += loaded_tokens
            engine.requests.cached[p.req] += loaded_tokens
            p.loading = 0
            p.parked = True  # until a running slot is free (:func:`unpark`)


def unpark(engine: Engine) -> None:
    """Requests whose KV landed join the running set, in the order they were admitted,
    while ``max_num_seqs`` and the step's token budget allow: before any waiting request,
    as vLLM 0.33's scheduler drains ``kv_holding_waiting`` before ``waiting``."""
    running = engine.num_running()
    for p in engine.prefilling:
        if not p.parked:
            continue
        if running + len(p.seqs) > engine.cfg.max_num_seqs or engine.budget <= 0:
            return
        p.parked = False
        running += len(p.seqs)
        take_chunk(engine, p)
