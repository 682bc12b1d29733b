"""What a finished run comes to: the summary row (the ``--json`` keys: the memory
split, fragmentation, queue, throughput and latency) and the per-request table
(:func:`summarize`), with the sharing figures (prefix cache, blocks saved, vmm page
tails) in :func:`_sharing_summary`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from fragsim.engine import Engine
from fragsim.engine_views import prefix_cache_stats
from fragsim.request_table import FINISHED, REFUSE_REASONS, STATUS_NAMES


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def summarize(engine: Engine, allocator_name: str, wall_time_s: float,
              kv_bytes_per_token: int) -> tuple[dict[str, Any], pd.DataFrame]:
    """The summary row (the ``--json`` keys) and the per-request table of a finished run."""
    rec, reqs = engine.rec, engine.requests
    means, peaks = rec.means(), rec.peaks()
    cap = engine.capacity
    done = reqs.status == FINISHED
    arrival = reqs.arrival
    ttft = reqs.first_token - arrival
    e2e = reqs.finish - arrival
    out_len = reqs.output.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(out_len > 1, (reqs.finish - reqs.first_token) / (out_len - 1), np.nan)
    span = rec.span_s
    # Every sample or beam generates its tokens (the request returns the output length).
    out_tokens = int(reqs.output[done].sum()) * engine.cfg.width
    counters = rec.counters.to_dict()
    summary: dict[str, Any] = {
        "allocator": allocator_name,
        "num_requests": reqs.num_mine,
        "num_finished": int(done.sum()),
        **counters,
        "capacity_slots": cap,
        "capacity_bytes": cap * kv_bytes_per_token,
        "kv_bytes_per_token": kv_bytes_per_token,
    }
    for q in ("token_states", "reservation", "internal_fragmentation", "free"):
        summary[f"mean_{q}_slots"] = means[q]
    for q in ("token_states", "reservation", "internal_fragmentation", "free"):
        summary[f"{q}_frac"] = means[q] / cap if cap else 0.0
    for q in ("token_states", "reservation", "internal_fragmentation"):
        summary[f"peak_{q}_slots"] = peaks[q]
    hybrid = engine.kv.unit == "bytes"
    kv_keys = engine.kv.summary()
    if hybrid:
        # A hybrid manager's pool is bytes, not slots: the byte split replaces the slot keys.
        summary.update({k: None for k in list(summary) if k.endswith("_slots")})
        summary.update(capacity_slots=None, capacity_bytes=cap, kv_bytes_per_token=None)
        summary.update(kv_keys)
        held = rec.mean_held()  # copies held for a transfer: a part of their own, out of token states
        if held:
            summary["mean_token_states_bytes"] -= held
            summary["token_states_frac"] -= held / cap if cap else 0.0
    summary.update({
        "mean_external_fragmentation_ratio": means["external_fragmentation_ratio"],
        "peak_external_fragmentation_ratio": peaks["external_fragmentation_ratio"],
        "mean_largest_allocatable_slots": means["largest_allocatable"] if not hybrid else None,
        "mean_running": means["running"],
        "peak_running": peaks["running"],
        "mean_waiting": means["waiting"],
        "peak_waiting": peaks["waiting"],
        "throughput_tokens_per_s": out_tokens / span if span > 0 else 0.0,
        "throughput_total_tokens_per_s":
            (out_tokens + int(reqs.prompt[done].sum())) / span if span > 0 else 0.0,
        "throughput_requests_per_s": float(done.sum()) / span if span > 0 else 0.0,
        "mean_ttft_s": float(np.mean(ttft[done])) if done.any() else math.nan,
        "p50_ttft_s": _pct(ttft[done], 50),
        "p99_ttft_s": _pct(ttft[done], 99),
        "mean_tpot_s": float(np.nanmean(tpot[done])) if np.isfinite(tpot[done]).any() else math.nan,
        "mean_e2e_latency_s": float(np.mean(e2e[done])) if done.any() else math.nan,
        "p99_e2e_latency_s": _pct(e2e[done], 99),
        "mean_normalized_latency_s": float(np.mean(e2e[done] / out_len[done])) if done.any() else math.nan,
        "num_prefill_tokens": engine.num_prefill_tokens,
        **_sharing_summary(engine, means["free"], kv_keys),
        **_offload_summary(engine, kv_bytes_per_token),
        "sim_time_s": span,
        "num_steps": engine.num_steps,
        "num_events": engine.num_events,
        "wall_time_s": wall_time_s,
    })
    requests = pd.DataFrame({
        "request_id": np.arange(reqs.N),
        "arrival_s": arrival,
        "prompt_len": reqs.prompt,
        "output_len": reqs.output,
        "status": pd.Categorical.from_codes(reqs.status.astype(np.int64), STATUS_NAMES),
        "refused_reason": [REFUSE_REASONS[int(r)] for r in reqs.refused],
        "first_token_s": reqs.first_token,
        "finish_s": reqs.finish,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "e2e_latency_s": np.where(done, e2e, np.nan),
        "normalized_latency_s": np.where(done, e2e / out_len, np.nan),
        "num_preemptions": reqs.preemptions,
    })
    if reqs.mine is not None:  # an instance of a cluster: the rows routed here
        requests = requests[reqs.mine].reset_index(drop=True)
    return summary, requests


def _offload_summary(engine: Engine, kv_bytes_per_token: int) -> dict[str, Any]:
    """The tiers below the GPU pool: vLLM's external prefix-cache counts (tokens), the
    GPU slots held only for pending stores, and one entry per tier (empty without)."""
    from fragsim.connector import parts
    from fragsim.offload.connector import OffloadConnector

    connectors = parts(engine.connector)
    offload = next((c for c in connectors if isinstance(c, OffloadConnector)), None)
    sending = any(getattr(c, "sends_kv", False) for c in connectors)
    cap = engine.capacity
    held, peak = engine.rec.mean_held(), engine.rec.peak_held()
    out: dict[str, Any] = {
        "external_prefix_cache_queries": offload.queries if offload is not None else 0,
        "external_prefix_cache_hits": offload.hits if offload is not None else 0,
        "mean_store_pending_slots": held if offload is not None and not sending else 0.0,
        "store_pending_frac": held / cap if cap and offload is not None and not sending else 0.0,
        "peak_store_pending_slots": peak if offload is not None and not sending else 0,
        "tiers": offload.summary() if offload is not None else [],
    }
    if any(hasattr(c, "sends_kv") for c in connectors):  # a side of a prefill/decode split
        # A prefill instance holds for transfers (and for its stores, with a tier).
        sent = held if sending else 0.0
        out.update(mean_kv_sending_slots=sent, kv_sending_frac=sent / cap if cap else 0.0,
                   peak_kv_sending_slots=peak if sending else 0)
    return out


def _sharing_summary(engine: Engine, mean_free: float, counts: dict[str, int]) -> dict[str, Any]:
    """Prefix-cache counts (vLLM's names, in tokens), blocks saved by sharing, vmm page tails.

    ``blocks_saved_frac`` is the vLLM paper's Figure-15 quantity: blocks sharing saves
    over the blocks the same sequences would hold without it, both time-averaged.
    """
    shared = engine.rec.mean_shared()
    physical = engine.capacity - mean_free
    token_bytes = counts.get("token_bytes", 0)
    out: dict[str, Any] = dict(prefix_cache_stats(engine))
    out.update({
        "num_prefix_cache_evictions": counts.get("num_prefix_cache_evictions", 0),
        "mean_shared_slots": shared,
        "blocks_saved_frac": shared / (physical + shared) if physical + shared > 0 else 0.0,
        # the beam model's next-token concentration (fragsim.beams), when beams ran
        "beam_theta": engine.cfg.beam_theta if engine.cfg.beam_width > 1 else None,
        "vmm_tokens_per_page": counts.get("vmm_tokens_per_page", 0),
        # Bytes of the pool no token can use: the page tails of every K and V buffer.
        "page_tail_bytes": counts.get("page_tail_bytes_per_buffer", 0)
        * (engine.cfg.kv_bytes_per_token // token_bytes if token_bytes else 0),
    })
    return out
