"""How close ``fragsim capacity`` comes to vLLM's own start-up figures, term by term.

    python benchmarks/capacity_accuracy.py          # table per log and term, then the summary
    python benchmarks/capacity_accuracy.py --json   # one JSON object: rows, summary, skipped

Every published start-up log in ``benchmarks/capacity_logs/logs.jsonl`` whose model
fragsim can build (:data:`MODELS_BY_HUB_ID`) and whose GPU maps to a preset
(:data:`GPUS_BY_NAME`) is planned with that log's settings (tp,
gpu_memory_utilization, max_model_len, max_num_batched_tokens, KV dtype, block
size, prefix caching) and each figure the log printed is set beside fragsim's::

    term              fragsim                                 vLLM's log
    total             GPU preset's driver total (else nvidia-smi's)  total_gpu_memory
    weights           weight bytes / tp                      Model loading took / model weights take
    activation        activation_peak_bytes estimate         PyTorch activation peak memory
    non_torch         0: fragsim does not model it           non_torch_memory
    act+non_torch     activation estimate                    activation + non_torch
    available_kv      KV budget                              Available KV cache memory
    num_gpu_blocks    vLLM plan's num_gpu_blocks             # GPU blocks
    kv_tokens         vLLM plan's kv_cache_tokens            GPU KV cache size
    max_concurrency   vLLM plan's max_concurrency            Maximum concurrency for N tokens

The relative error is ``(fragsim − log) / |log|``. Then, per term, the mean of its
absolute value and the worst one; then the logs skipped and why, and the figures a
computed log did not print. A benchmark: it prints, it asserts nothing.

V0 logs (vLLM < 0.8) print ``peak_torch_memory`` with the weights in it; their
activation peak is that less the weights. V0 profiled ``max(max_model_len, 2048)``
tokens when chunked prefill was off, as it was by default up to 32K tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from fragsim.capacity import plan_capacity
from fragsim.catalog import get_gpu, get_model, with_kv_cache_dtype
from fragsim.errors import FragsimError

REPO = Path(__file__).resolve().parents[1]
LOGS = REPO / "benchmarks" / "capacity_logs" / "logs.jsonl"
GiB = 1 << 30

#: hub id → (what fragsim builds: a preset or a config.json, why it stands for the hub model).
#: An Instruct model has its base's architecture; the twins below have the same config.json
#: dimensions under another name.
MODELS_BY_HUB_ID: dict[str, tuple[str, str]] = {
    "meta-llama/Llama-3.1-8B-Instruct": ("llama-3.1-8b", "Instruct of llama-3.1-8b"),
    "Qwen/Qwen3-32B": ("qwen3-32b", ""),
    "openai/gpt-oss-20b": ("gpt-oss-20b", ""),
    "openai/gpt-oss-120b": ("gpt-oss-120b", ""),
    "Qwen/Qwen2-7B-Instruct": ("qwen2.5-7b", "Qwen2-7B has Qwen2.5-7B's dimensions"),
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": ("tests/fixtures/configs/qwen3-30b-a3b.json",
                                          "Qwen3-30B-A3B's architecture"),
}

#: pattern of the log's GPU text → preset; the first that matches wins.
GPUS_BY_NAME: list[tuple[str, str | None]] = [
    (r"GB10|DGX Spark", None),          # unified memory: no preset
    (r"H200", "h200-141gb"),
    (r"H100", "h100-80gb"),
    (r"A100 40GB", "a100-40gb"),
    (r"A100", "a100-80gb"),             # 80GB stated or inferred in every other A100 log
    (r"L40S", "l40s"),
    (r"A10G", "a10g"),
    (r"RTX 3090", "rtx-3090"),
    (r"RTX 4090", "rtx-4090"),
    (r"RTX 5090", "rtx-5090"),
    (r"\bL4\b", "l4"),
]

TERMS = ["total", "weights", "activation", "non_torch", "act+non_torch", "available_kv",
         "num_gpu_blocks", "kv_tokens", "max_concurrency"]
UNITS = {"num_gpu_blocks": "", "kv_tokens": "", "max_concurrency": "x"}


def _leading_number(value: Any) -> float | None:
    """``0.9 (default)`` → 0.9; None stays None."""
    if value is None or isinstance(value, (int, float)):
        return value
    match = re.match(r"\s*([0-9]+(?:\.[0-9]+)?)", str(value))
    return float(match.group(1)) if match else None


def _gpu_preset(text: str) -> str | None:
    for pattern, preset in GPUS_BY_NAME:
        if re.search(pattern, text):
            return preset
    return None


def _prefix_caching(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return not re.search(r"\boff\b", str(value))


def _settings(log: dict[str, Any], max_position_embeddings: int) -> dict[str, Any]:
    """plan_capacity's keyword arguments for the log's settings."""
    max_model_len = _leading_number(log.get("max_model_len"))
    max_seq_len = int(max_model_len) if max_model_len else max_position_embeddings
    tokens = _leading_number(log.get("max_num_batched_tokens"))
    if tokens is None and "V0" in str(log.get("vllm_version")) and max_seq_len <= 32768:
        tokens = max(max_seq_len, 2048)
    block = re.search(r"--block-size[= ](\d+)", str(log.get("other_flags") or ""))
    return {
        "tp": int(log["tp"]),
        "gpu_memory_utilization": _leading_number(log["gpu_memory_utilization"]),
        "max_seq_len": max_seq_len,
        "max_num_batched_tokens": None if tokens is None else int(tokens),
        "prefix_caching": _prefix_caching(log.get("prefix_caching")),
        "vllm_block_size": int(block.group(1)) if block else None,
    }


def _log_figures(log: dict[str, Any]) -> dict[str, float]:
    """The log's figure per term (GiB, or a count); terms it did not print are absent."""
    f = log["figures"]
    out: dict[str, float] = {}
    for term, key in (("total", "total_gpu_memory_gib"), ("weights", "weights_gib"),
                      ("activation", "activation_peak_gib"), ("non_torch", "non_torch_gib"),
                      ("available_kv", "available_kv_gib"), ("num_gpu_blocks", "num_gpu_blocks"),
                      ("kv_tokens", "kv_cache_tokens"), ("max_concurrency", "max_concurrency")):
        if f.get(key) is not None:
            out[term] = float(f[key])
    if "activation" not in out and "weights" in out:
        for line in log["lines"]:
            peak = re.search(r"peak_torch_memory=([0-9.]+)GiB", line)
            if peak:
                out["activation"] = float(peak.group(1)) - out["weights"]
    if "activation" in out and "non_torch" in out:
        out["act+non_torch"] = out["activation"] + out["non_torch"]
    return out


def _fragsim_figures(report: Any) -> dict[str, float]:
    d = report.to_dict()
    return {
        "total": report.gpu_memory_bytes / GiB,
        "weights": report.weight_bytes_per_gpu / GiB,
        "activation": report.activation_bytes / GiB,
        "non_torch": 0.0,
        "act+non_torch": report.activation_bytes / GiB,
        "available_kv": report.kv_budget_bytes / GiB,
        "num_gpu_blocks": float(d["num_gpu_blocks"]),
        "kv_tokens": float(d["kv_cache_tokens"]),
        "max_concurrency": float(d["max_concurrency"]),
    }


def compare(logs: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows (one per log and printed term), the summary per term, and what was skipped."""
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    not_printed: list[dict[str, Any]] = []
    for log in logs:
        where = MODELS_BY_HUB_ID.get(log["model"])
        gpu_name = _gpu_preset(log["gpu"])
        if where is None:
            skipped.append({"id": log["id"], "reason": f"model not buildable: {log['model']} "
                            "has no preset or config.json here"})
            continue
        if gpu_name is None:
            skipped.append({"id": log["id"], "reason": f"GPU unknown: {log['gpu']}"})
            continue
        try:
            model = with_kv_cache_dtype(get_model(str(REPO / where[0]) if where[0].endswith(".json")
                                                  else where[0]), log.get("kv_cache_dtype"))
            settings = _settings(log, model.max_position_embeddings)
            report = plan_capacity(model, get_gpu(gpu_name), **settings)
        except FragsimError as exc:
            skipped.append({"id": log["id"], "reason": f"fragsim refused the plan: {exc}"})
            continue
        ours, theirs = _fragsim_figures(report), _log_figures(log)
        for term in TERMS:
            if term not in theirs:
                continue
            value = theirs[term]
            error = (ours[term] - value) / abs(value) if value else None
            rows.append({"id": log["id"], "model": model.name, "via": where[1], "gpu": gpu_name,
                         "term": term, "fragsim": ours[term], "log": value, "rel_error": error})
        missing = [t for t in TERMS if t not in theirs]
        if missing:
            not_printed.append({"id": log["id"], "terms": missing})
    return {"rows": rows, "summary": summarize(rows), "skipped": skipped,
            "not_printed": not_printed}


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per term: how many logs, the mean absolute relative error, the worst one (signed)."""
    out: dict[str, dict[str, Any]] = {}
    for term in TERMS:
        errors = [r for r in rows if r["term"] == term and r["rel_error"] is not None]
        if not errors:
            continue
        worst = max(errors, key=lambda r: abs(r["rel_error"]))
        out[term] = {"n": len(errors),
                     "mean_abs_rel_error": math.fsum(abs(r["rel_error"]) for r in errors) / len(errors),
                     "worst_rel_error": worst["rel_error"], "worst_id": worst["id"]}
    return out


def _cell(term: str, value: float) -> str:
    unit = UNITS.get(term, " GiB")
    if unit == "":
        return f"{value:,.0f}"
    return f"{value:,.2f}{unit}"


def print_text(result: dict[str, Any]) -> None:
    rows = result["rows"]
    width = max((len(r["id"]) for r in rows), default=10)
    print(f"{'source id':<{width}}  {'term':<15} {'fragsim':>13} {'vLLM log':>13} {'rel. error':>10}")
    last = None
    for r in rows:
        if last is not None and r["id"] != last:
            print()
        if r["id"] != last:
            via = f", {r['via']}" if r["via"] else ""
            print(f"# {r['id']}: {r['model']} on {r['gpu']}{via}")
        last = r["id"]
        error = "" if r["rel_error"] is None else f"{r['rel_error']:+.1%}"
        print(f"{r['id']:<{width}}  {r['term']:<15} {_cell(r['term'], r['fragsim']):>13} "
              f"{_cell(r['term'], r['log']):>13} {error:>10}")
    print("\nper term: logs, mean |relative error|, worst relative error (source id)")
    for term, s in result["summary"].items():
        print(f"  {term:<15} {s['n']:>3}  {s['mean_abs_rel_error']:>8.1%}  "
              f"{s['worst_rel_error']:>+9.1%}  ({s['worst_id']})")
    print(f"\nskipped ({len(result['skipped'])} logs):")
    for s in result["skipped"]:
        print(f"  {s['id']}: {s['reason']}")
    print("\nfigures not printed by a computed log:")
    for s in result["not_printed"]:
        print(f"  {s['id']}: {', '.join(s['terms'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the tables")
    parser.add_argument("--logs", type=Path, default=LOGS, help="the JSONL file of start-up logs")
    args = parser.parse_args(argv)
    with open(args.logs, encoding="utf-8") as f:
        logs = [json.loads(line) for line in f if line.strip()]
    result = compare(logs)
    if args.json:
        print(json.dumps(result))
    else:
        print_text(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
