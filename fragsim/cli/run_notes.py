"""What ``fragsim run`` says beside its table: a hybrid model run as full attention
(:func:`full_attention_note`), and which allocators could not keep up and why
(:func:`overload_notes`, with :data:`HYBRID_WHY` for the hybrid KV managers).
"""

from __future__ import annotations

from typing import Any


def full_attention_note(model: Any, gpu: Any, spec: Any) -> str:
    """What a run of a hybrid model is: every layer simulated as full attention,
    beside the pool vLLM would plan for its layer kinds."""
    from fragsim.capacity import plan_capacity
    from fragsim.simulate import pool_slots

    kinds = sorted({layer.label() for layer in model.layer_specs})
    slots = pool_slots(spec)
    text = (f"{model.name} has {', '.join(kinds)} layers, but this run treats every layer as full "
            f"attention: {model.kv_bytes_per_token_per_gpu(spec.tp):,} B per token, a pool of "
            f"{slots:,} slots")
    try:
        plan = plan_capacity(model, gpu, tp=spec.tp, max_seq_len=spec.max_seq_len,
                             gpu_memory_utilization=spec.gpu_memory_utilization,
                             max_num_batched_tokens=spec.max_num_batched_tokens,
                             kv_cache_memory_bytes=slots * model.kv_bytes_per_token_per_gpu(spec.tp))
    except Exception:  # the note must never stop a run
        return text
    vllm = plan.to_dict()
    naive = slots / spec.max_seq_len
    return (text + f" ({naive:,.1f} requests of {spec.max_seq_len:,} tokens); vLLM's hybrid "
            f"manager would fit {vllm['max_concurrency']:,.1f} in the same memory "
            f"(fragsim capacity --model {spec.model} --gpu {spec.gpu} shows its groups)")


#: why a hybrid KV manager holds more per request than the others (the overload note)
HYBRID_WHY = {
    "paged-uniform": "paged-uniform keeps every layer's KV for every token, a window's old blocks too",
    "static-partition": "static-partition sizes a pool per kind up front, and one kind's free pages "
                        "cannot serve another",
    "vllm-hybrid": "vllm-hybrid pads its groups to one page size",
    "jenga": "jenga strands free small pages in large pages carved for one kind",
}


def _overloaded(s: dict[str, Any]) -> bool:
    return bool(s["mean_waiting"] > 4 * max(s["mean_running"], 1.0))


def overload_notes(summaries: list[dict[str, Any]], spec: Any) -> list[str]:
    """Which allocators could not keep up, and whether the GPU or their reservations are why."""
    over = [s for s in summaries if _overloaded(s)]
    if not over:
        return []
    worst = max(over, key=lambda s: s["mean_waiting"])
    names = ", ".join(s["allocator"] for s in over)
    served = [s for s in summaries if not _overloaded(s)]
    if served:
        paged = [s for s in served if s["allocator"] == "vllm"]
        best = paged[0] if paged else max(served, key=lambda s: s["throughput_requests_per_s"])
        if all(s["allocator"] in HYBRID_WHY for s in over):
            why = ("how each lays out the layer kinds, not the GPU, limits the batch ("
                   + "; ".join(HYBRID_WHY[s["allocator"]] for s in over) + ")")
        else:
            why = ("what each reserves, not the GPU, limits the batch (a max-length reservation is "
                   f"--max-seq-len, {spec.max_seq_len:,} tokens, per request)")
        return [f"{names} could not keep up: {worst['allocator']}'s queue held "
                f"{worst['mean_waiting']:,.0f} requests on average and its p99 time to first token "
                f"was {worst['p99_ttft_s']:,.0f} s, while {best['allocator']} served the same trace "
                f"with {best['mean_waiting']:,.1f} waiting (p99 TTFT {best['p99_ttft_s']:,.2f} s): {why}"]
    return [f"the trace offers more load than this GPU serves: {worst['allocator']}'s queue held "
            f"{worst['mean_waiting']:,.0f} requests on average, so latencies grow over the run "
            "(--rate, --time-window, a larger --gpu or --tp eases it)"]
