"""The measurements a step-cost model is fitted to, read and checked.

:class:`Measurements` is what was measured, in one of the three kinds
(:data:`KINDS`); :func:`load_measurements` tells the kind of a file by its
suffix, columns or keys (the formats are in :mod:`fragsim.calibrate`) and turns a
bad row into a :class:`~fragsim.errors.FragsimError` that names it.
:func:`point_specs` gives the run spec an operating point is replayed with, and
:func:`attention_from_kernels` the memory-bound context term from measured
decode-attention kernel times. Fitting is :mod:`fragsim.calibrate_fit`'s.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fragsim.engine_config import SCHEDULERS
from fragsim.errors import FragsimError
from fragsim.steady import requests_over

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

KINDS = ("steps", "requests", "points")
STEP_COLUMNS = ("num_prefill_tokens", "num_decode", "decode_context")


@dataclass
class Measurements:
    """What was measured, in one of the three kinds, as the fit reads it."""

    kind: str
    source: str
    table: pd.DataFrame                    # steps or requests; points: one row per point
    dropped: int = 0                        # rows left out (failed requests, ...)
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ reading


def _read_table(path: Path) -> pd.DataFrame:
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            return pd.read_parquet(path)
        if suffix in (".jsonl", ".ndjson"):
            return pd.read_json(path, lines=True)
        return pd.read_csv(path)
    except (ValueError, OSError, pd.errors.ParserError) as exc:
        raise FragsimError(f"{path}: cannot read a table: {exc}") from None


def _step_times(path: Path, df: pd.DataFrame) -> np.ndarray:
    for col, scale in (("step_time_s", 1.0), ("step_time_ms", 1e-3), ("step_time_us", 1e-6)):
        if col in df.columns:
            return df[col].to_numpy(dtype=np.float64) * scale
    raise FragsimError(f"{path}: a steps table needs step_time_s, step_time_ms or step_time_us")


def _check_rows(path: Path, df: pd.DataFrame, columns: Sequence[str], positive: Sequence[str]) -> None:
    for col in columns:
        values = pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(values) | (values < 0))
        if len(bad):
            raise FragsimError(f"{path}: row {int(bad[0]) + 1}: {col} = {df[col].iloc[bad[0]]}; "
                               "expected a number >= 0")
    for col in positive:
        values = df[col].to_numpy(dtype=np.float64)
        bad = np.flatnonzero(values <= 0)
        if len(bad):
            raise FragsimError(f"{path}: row {int(bad[0]) + 1}: {col} = {values[bad[0]]:g}; "
                               "expected a number > 0")


def _steps(path: Path, df: pd.DataFrame) -> Measurements:
    missing = [c for c in STEP_COLUMNS if c not in df.columns]
    if missing:
        raise FragsimError(f"{path}: a steps table needs {', '.join(STEP_COLUMNS)}; "
                           f"missing {', '.join(missing)}")
    out = pd.DataFrame({c: df[c] for c in STEP_COLUMNS})
    out["step_time_s"] = _step_times(path, df)
    prefill = out["num_prefill_tokens"].to_numpy(dtype=np.float64)
    out["prefill_attention_units"] = (df["prefill_attention_units"] if "prefill_attention_units" in df
                                      else prefill * (prefill - 1) / 2)
    _check_rows(path, out, [*STEP_COLUMNS, "prefill_attention_units", "step_time_s"], ["step_time_s"])
    return Measurements("steps", str(path), out.astype(np.float64).reset_index(drop=True))


def _requests(path: Path, arrival: Any, prompt: Any, output: Any, ttft: Any, tpot: Any,
              ok: np.ndarray | None = None) -> Measurements:
    df = pd.DataFrame({"arrival_s": arrival, "prompt_len": prompt, "output_len": output,
                       "ttft_s": ttft, "tpot_s": tpot})
    keep = np.ones(len(df), dtype=bool) if ok is None else np.array(ok, dtype=bool)
    for col in ("arrival_s", "prompt_len", "output_len", "ttft_s"):
        keep &= np.isfinite(pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=np.float64))
    dropped = int((~keep).sum())
    df = df[keep].astype({"prompt_len": np.int64, "output_len": np.int64}).reset_index(drop=True)
    _check_rows(path, df, ["arrival_s", "ttft_s"], ["prompt_len", "output_len", "ttft_s"])
    df = df.sort_values("arrival_s", kind="stable").reset_index(drop=True)
    df["arrival_s"] -= df["arrival_s"].iloc[0] if len(df) else 0.0
    notes = [f"{dropped:,} requests without a complete measurement left out"] if dropped else []
    return Measurements("requests", str(path), df, dropped, notes)


def _vllm_bench(path: Path, data: dict[str, Any]) -> Measurements:
    need = ("start_times", "input_lens", "output_lens", "ttfts", "itls")
    missing = [k for k in need if k not in data]
    if missing:
        raise FragsimError(f"{path}: a vLLM benchmark result needs {', '.join(need)} (run it with "
                           f"--save-result --save-detailed); missing {', '.join(missing)}")
    n = len(data["ttfts"])
    if any(len(data[k]) != n for k in need):
        raise FragsimError(f"{path}: {', '.join(need)} differ in length")
    errors = data.get("errors") or [""] * n
    # the gaps after the first token; streamed chunks may carry several tokens each
    tpot = [float(np.sum(gaps)) / (out - 1) if gaps and out > 1 else math.nan
            for gaps, out in zip(data["itls"], data["output_lens"], strict=True)]
    ok = np.array([not e for e in errors], dtype=bool)
    return _requests(path, data["start_times"], data["input_lens"], data["output_lens"],
                     data["ttfts"], tpot, ok)


def _blis_v2(path: Path, df: pd.DataFrame) -> Measurements:
    need = ("input_tokens", "output_tokens", "first_chunk_time_us", "last_chunk_time_us")
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise FragsimError(f"{path}: a BLIS trace v2 file needs {', '.join(need)}; "
                           f"missing {', '.join(missing)}")
    send = df["send_time_us"] if "send_time_us" in df else df["arrival_time_us"]
    send = send.where(send > 0, df.get("arrival_time_us", send)).to_numpy(dtype=np.float64)
    first = df["first_chunk_time_us"].to_numpy(dtype=np.float64)
    last = df["last_chunk_time_us"].to_numpy(dtype=np.float64)
    out = df["output_tokens"].to_numpy(dtype=np.float64)
    tpot = np.where(out > 1, (last - first) / np.maximum(out - 1, 1) / 1e6, np.nan)
    ok = (df["status"].astype(str) == "ok").to_numpy() if "status" in df else None
    return _requests(path, send / 1e6, df["input_tokens"], df["output_tokens"],
                     (first - send) / 1e6, tpot, ok)


def _points(path: Path, data: dict[str, Any]) -> Measurements:
    points = data.get("points")
    if not isinstance(points, list) or not points:
        raise FragsimError(f"{path}: an operating-points file needs [[points]] tables")
    rows = []
    default_duration = data.get("duration_s")
    for i, point in enumerate(points, 1):
        for key in ("trace", "allocator", "mean_running"):
            if key not in point:
                raise FragsimError(f"{path}: [[points]] #{i}: needs {key}")
        target = point["mean_running"]
        if not (isinstance(target, int | float) and target > 0):
            raise FragsimError(f"{path}: [[points]] #{i}: mean_running = {target!r}; expected > 0")
        scheduler = point.get("scheduler")
        if scheduler is not None and scheduler not in SCHEDULERS:
            raise FragsimError(f"{path}: [[points]] #{i}: scheduler = {scheduler!r}; expected one of "
                               f"{', '.join(SCHEDULERS)}")
        rows.append({"label": point.get("label", f"point {i}"), "trace": point["trace"],
                     "rate": point.get("rate"), "allocator": point["allocator"], "scheduler": scheduler,
                     "num_requests": _num_requests(path, i, point, default_duration),
                     "mean_running": float(target), "held_out": bool(point.get("held_out", False))})
    m = Measurements("points", str(path), pd.DataFrame(rows))
    m.notes = [str(n) for n in data.get("notes", [])]
    return m


def _num_requests(path: Path, i: int, point: dict[str, Any], default_duration: Any) -> int:
    """A point's requests: its ``num_requests``, or its rate times ``duration_s`` (the
    point's, else the file's): the paper's one-hour traces are ``duration_s = 3600``."""
    duration = point.get("duration_s", default_duration)
    if "num_requests" in point:
        if "duration_s" in point:
            raise FragsimError(f"{path}: [[points]] #{i}: give num_requests or duration_s, not both")
        n = point["num_requests"]
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
            raise FragsimError(f"{path}: [[points]] #{i}: num_requests = {n!r}; expected an integer >= 1")
        return n
    if duration is None:
        return 1000
    rate = point.get("rate")
    if not (isinstance(duration, int | float) and not isinstance(duration, bool) and duration > 0):
        raise FragsimError(f"{path}: [[points]] #{i}: duration_s = {duration!r}; expected seconds > 0")
    if not (isinstance(rate, int | float) and rate > 0):
        raise FragsimError(f"{path}: [[points]] #{i}: duration_s needs the point's rate (requests/s)")
    return requests_over(rate, duration)


def load_measurements(path: str | Path) -> tuple[Measurements, dict[str, Any]]:
    """The measurements in ``path`` and, for an operating-points file, its ``[system]``
    table (the run options the points were measured with)."""
    path = Path(path)
    if not path.is_file():
        raise FragsimError(f"{path}: no such measurements file")
    suffix = path.suffix.lower()
    if suffix == ".toml":
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise FragsimError(f"{path}: not valid TOML: {exc}") from None
        return _points(path, data), dict(data.get("system", {}))
    if suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise FragsimError(f"{path}: not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise FragsimError(f"{path}: expected a JSON object (a vLLM benchmark result)")
        return _vllm_bench(path, data), {}
    df = _read_table(path)
    cols = set(df.columns)
    if cols & {"step_time_s", "step_time_ms", "step_time_us"}:
        return _steps(path, df), {}
    if "first_chunk_time_us" in cols:
        return _blis_v2(path, df), {}
    need = ("arrival_s", "prompt_len", "output_len", "ttft_s", "tpot_s")
    if set(need) <= cols:
        return _requests(path, df["arrival_s"], df["prompt_len"], df["output_len"], df["ttft_s"],
                         df["tpot_s"]), {}
    raise FragsimError(
        f"{path}: not a measurements file fragsim knows: expected a steps table "
        f"({', '.join(STEP_COLUMNS)}, step_time_s), per-request latencies ({', '.join(need)}; or a "
        "BLIS trace v2 CSV; or a vLLM benchmark JSON), or an operating-points TOML; its columns "
        f"are {', '.join(map(str, df.columns))}")


def point_specs(m: Measurements, spec: Any) -> list[Any]:
    """The run spec of every operating point: the system's, with the point's workload
    (and its own scheduler, where it names one: Orca's points under ``orca``)."""
    from dataclasses import replace

    def scheduler(row: Any) -> str:
        own = getattr(row, "scheduler", None)
        return str(own) if isinstance(own, str) else spec.scheduler

    return [replace(spec, trace=row.trace, rate=(None if row.rate is None or
                                                 (isinstance(row.rate, float) and math.isnan(row.rate))
                                                 else float(row.rate)),
                    num_requests=int(row.num_requests), scheduler=scheduler(row))
            for row in m.table.itertuples()]


# ------------------------------------------------------------------ measured attention


def attention_from_kernels(path: str | Path, kv_bytes_per_token: int,
                           layout: str = "paged") -> tuple[float, dict[str, Any]]:
    """The memory-bound decode term, ``context_token_s``, from measured decode-attention
    kernel times (``kernels.json`` of ``benchmarks/gpu_check.py``, or the ``--json`` of
    ``python -m gpu_backend.kernel_bench``).

    Each row is one layer's decode attention over ``bytes`` of K/V (and q, out) in
    ``ms``; a least-squares line ``ms = launch + bytes / rate`` gives the seconds per
    byte the kernel really reads at, and a token of context costs that many seconds
    for each of the model's ``kv_bytes_per_token`` (every layer's K and V). The launch
    part is left to the per-step overhead.
    """
    path = Path(path)
    try:
        rows = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise FragsimError(f"{path}: cannot read kernel times: {exc}") from None
    if isinstance(rows, dict):  # gpu_check's report: {"kernels": {"rows": [...]}, ...}
        rows = rows.get("kernels", {}).get("rows", rows.get("rows"))
    if not isinstance(rows, list):
        raise FragsimError(f"{path}: expected a list of kernel rows (batch, context, layout, ms, bytes)")
    use = [r for r in rows if isinstance(r, dict) and r.get("layout") == layout
           and "ms" in r and "bytes" in r]
    if len(use) < 2 or len({r["bytes"] for r in use}) < 2:
        raise FragsimError(f"{path}: need at least two {layout} rows with different bytes to fit "
                           f"the kernel's read rate; found {len(use)}")
    nbytes = np.array([float(r["bytes"]) for r in use])
    seconds = np.array([float(r["ms"]) * 1e-3 for r in use])
    bad = np.flatnonzero(~(np.isfinite(seconds) & (seconds > 0)))
    if len(bad):
        raise FragsimError(f"{path}: {layout} row {int(bad[0]) + 1}: ms = {use[bad[0]]['ms']!r}; "
                           "expected a time > 0")
    design = np.column_stack([np.ones(len(nbytes)), nbytes])
    (launch, per_byte), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    if per_byte <= 0:
        raise FragsimError(f"{path}: the {layout} kernel's time does not grow with the bytes it "
                           "reads; these rows cannot give a read rate")
    pred = design @ np.array([launch, per_byte])
    info = {"rows": len(use), "layout": layout, "read_gbps": float(1e-9 / per_byte),
            "launch_s": float(launch), "mape": float(np.mean(np.abs(pred - seconds) / seconds))}
    return float(per_byte * kv_bytes_per_token), info
