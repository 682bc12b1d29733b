"""What a cluster's run comes to: one row per request (where it ended), the cluster's
figures under the keys of one run, a summary per pool, and the transfers of a
prefill/decode split.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from fragsim.cluster.disagg import KVLink
from fragsim.request_table import FINISHED

#: split quantities added over instances (slots or bytes; means over each instance's span)
_SPLIT = ("token_states", "reservation", "internal_fragmentation", "free")


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def requests_table(results: list[Any], roles: list[str], link: KVLink | None, trace: Any) -> pd.DataFrame:
    """One row per request: where it ended. A disaggregated request's row is its decode
    instance's, with its prefill instance and its transfer; one that ended on its
    prefill instance (refused there) keeps that row."""
    frames = [r.requests for r in results]
    if link is None:
        return pd.concat(frames).sort_values("request_id").reset_index(drop=True)
    prefill = pd.concat([f for f, role in zip(frames, roles, strict=True) if role == "prefill"])
    rest = pd.concat([f for f, role in zip(frames, roles, strict=True) if role != "prefill"])
    where = prefill.set_index("request_id")["instance"]
    rest["prefill_instance"] = rest["request_id"].map(where).fillna(-1).astype(np.int64)
    stuck = prefill[~prefill["request_id"].isin(rest["request_id"])].copy()
    stuck["output_len"] = np.asarray(trace.output_len)[stuck["request_id"].to_numpy()]
    stuck["prefill_instance"] = stuck["instance"]
    out = pd.concat([rest, stuck]).sort_values("request_id").reset_index(drop=True)
    moved = {job.req: job for job in link.done}
    ids = out["request_id"].tolist()
    out["kv_transfer_bytes"] = [moved[r].bytes if r in moved else 0 for r in ids]
    out["kv_transfer_s"] = [(moved[r].end or 0.0) - moved[r].ready if r in moved else math.nan for r in ids]
    return out


def cluster_summary(allocator: str, engines: list[Any], results: list[Any], requests: pd.DataFrame,
                     wall: float, router: str, slo_ttft_s: float, slo_tpot_s: float) -> dict[str, Any]:
    """The cluster's figures under the keys of one run: counts summed, the split over
    every instance's pool together, latencies over every request (where it ended)."""
    per = [r.summary for r in results]
    cap = sum(engine.capacity for engine in engines)
    done = requests["status"] == "finished"
    # Every instance starts at the trace's first arrival and records until its last
    # request is done: the cluster's span is the longest.
    span = max(engine.rec.span_s for engine in engines)
    ttft, tpot, e2e = (requests[c].to_numpy(dtype=np.float64) for c in ("ttft_s", "tpot_s", "e2e_latency_s"))
    norm = requests["normalized_latency_s"].to_numpy(dtype=np.float64)
    d = done.to_numpy()
    out_tokens = int(requests.loc[done, "output_len"].sum()) * engines[0].cfg.width
    good = d & (ttft <= slo_ttft_s) & ~(tpot > slo_tpot_s)  # a one-token answer has no TPOT

    def pct(values: np.ndarray, q: float) -> float:
        return float(np.percentile(values, q)) if len(values) else math.nan

    summary: dict[str, Any] = {"allocator": allocator, "router": router, "num_instances": len(engines)}
    for key in per[0]:
        values = [s.get(key) for s in per]
        if key.startswith(("num_", "prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache")) \
                and all(isinstance(v, int | np.integer) for v in values):
            summary[key] = int(sum(values))
    # A disaggregated request also finishes on its prefill instance: it counts where it ends.
    ends = [s for s in per if s.get("role") != "prefill"] or per  # a prefill pool alone: its own
    for key in ("num_finished", "num_truncated"):
        summary[key] = int(sum(s[key] for s in ends))
    summary["num_requests"] = len(requests)
    summary["capacity_slots"] = sum(s["capacity_slots"] or 0 for s in per) or None
    summary["capacity_bytes"] = sum(s["capacity_bytes"] or 0 for s in per)
    means = {q: sum(e.rec.means()[q] for e in engines) for q in _SPLIT}
    held = sum(e.rec.mean_held() for e in engines)
    for q in _SPLIT:
        summary[f"{q}_frac"] = _share([s[f"{q}_frac"] for s in per], engines, cap)
    # Held on a prefill instance: for a transfer (and its stores, with a tier); elsewhere for stores.
    prefill = [e for e, s in zip(engines, per, strict=True) if s.get("role") == "prefill"]
    sent = sum(e.rec.mean_held() for e in prefill)
    summary["store_pending_frac"] = (held - sent) / cap if cap else 0.0
    if prefill:
        summary["mean_kv_sending_slots"] = sent
        summary["kv_sending_frac"] = sent / cap if cap else 0.0
    if per[0].get("mean_token_states_slots") is not None:
        for q in _SPLIT:
            summary[f"mean_{q}_slots"] = means[q]
    shared = sum(e.rec.mean_shared() for e in engines)
    physical = cap - means["free"]
    summary["mean_shared_slots"] = shared
    summary["blocks_saved_frac"] = shared / (physical + shared) if physical + shared > 0 else 0.0
    queries, hits = summary.get("prefix_cache_queries", 0), summary.get("prefix_cache_hits", 0)
    summary.update({
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "mean_running": sum(s["mean_running"] for s in per),
        "peak_running": sum(s["peak_running"] for s in per),
        "mean_waiting": sum(s["mean_waiting"] for s in per),
        "mean_external_fragmentation_ratio": float(np.mean([s["mean_external_fragmentation_ratio"] for s in per])),
        "peak_external_fragmentation_ratio": max(s["peak_external_fragmentation_ratio"] for s in per),
        "throughput_tokens_per_s": out_tokens / span if span > 0 else 0.0,
        "throughput_requests_per_s": float(d.sum()) / span if span > 0 else 0.0,
        "goodput_rps": float(good.sum()) / span if span > 0 else 0.0,
        "slo_ttft_s": slo_ttft_s,
        "slo_tpot_s": slo_tpot_s,
        "mean_ttft_s": float(np.mean(ttft[d])) if d.any() else math.nan,
        "p50_ttft_s": pct(ttft[d], 50),
        "p99_ttft_s": pct(ttft[d], 99),
        "mean_tpot_s": float(np.nanmean(tpot[d])) if np.isfinite(tpot[d]).any() else math.nan,
        "p99_tpot_s": pct(tpot[d][np.isfinite(tpot[d])], 99),
        "mean_e2e_latency_s": float(np.mean(e2e[d])) if d.any() else math.nan,
        "p99_e2e_latency_s": pct(e2e[d], 99),
        "mean_normalized_latency_s": float(np.mean(norm[d])) if d.any() else math.nan,
        "load_imbalance": _imbalance(per),
        "sim_time_s": span,
        "wall_time_s": wall,
        "instances": per,
    })
    # Other keys of one run: a share of the pool over every pool together (the hybrid
    # managers' padding, out of window, ...), else the instances' common value, or None
    # where they differ (a per-instance figure that does not add up; see "instances").
    for key in per[0]:
        if key in summary:
            continue
        values = [s.get(key) for s in per]
        if key.endswith("_frac") and all(isinstance(v, float | int) for v in values):
            summary[key] = _share(values, engines, cap)
            continue
        same = all(_equal(v, values[0]) for v in values[1:])
        summary[key] = values[0] if same else None
    assert int((requests["status"] == "finished").sum()) == sum(
        int((e.requests.status == FINISHED).sum()) for e, s in zip(engines, per, strict=True) if s in ends)
    return summary


def _share(fracs: list[float], engines: list[Any], cap: int) -> float:
    """A share of every pool together, from each pool's share (one pool: its own)."""
    if len(fracs) == 1:
        return fracs[0]
    return sum(f * e.capacity for f, e in zip(fracs, engines, strict=True)) / cap if cap else 0.0


def _imbalance(per: list[dict[str, Any]]) -> float:
    """How unevenly the work spread: in each pool, the busiest instance's requests over
    the pool's mean; the largest of those."""
    worst = 1.0
    for role in {s.get("role", "mixed") for s in per}:
        counts = [s["num_requests"] for s in per if s.get("role", "mixed") == role]
        if sum(counts):
            worst = max(worst, max(counts) / (sum(counts) / len(counts)))
    return worst


def pool_summaries(allocator: str, engines: list[Any], results: list[Any], pools: list[str],
                   roles: list[str], wall: float, router: str, slo_ttft_s: float,
                   slo_tpot_s: float) -> list[dict[str, Any]]:
    """One summary per pool (``pools``: each instance's pool name), with the cluster's
    keys; a prefill pool's latencies are its own (the first token its prefill makes)."""
    out = []
    for name in dict.fromkeys(pools):
        members = [i for i, pool in enumerate(pools) if pool == name]
        part = [results[i] for i in members]
        requests = pd.concat([r.requests for r in part], ignore_index=True)
        summary = cluster_summary(allocator, [engines[i] for i in members], part, requests, wall,
                                  router, slo_ttft_s, slo_tpot_s)
        summary.pop("instances")
        summary.update(pool=name, role=roles[members[0]], instance_ids=members)
        out.append(summary)
    return out


def transfer_summary(link: KVLink, engines: list[Any], summary: dict[str, Any]) -> dict[str, Any]:
    """Where the bytes are while requests change instance, besides the prefill side's
    copies held for a transfer (``kv_sending_frac``, a part of the split): the decode
    side's blocks reserved for one (part of ``reservation``), and the bytes at both
    ends (counted in both)."""
    cap = sum(engine.capacity for engine in engines)
    span = summary["sim_time_s"]
    out = link.summary(span)
    out.update({
        "kv_receiving_frac": out["mean_kv_receiving_slots"] / cap if cap else 0.0,
        "kv_duplicated_frac": out["mean_kv_duplicated_slots"] / cap if cap else 0.0,
    })
    return out
