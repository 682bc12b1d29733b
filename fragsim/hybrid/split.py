"""The byte split of a hybrid pool per row and category, integrated over time.

:class:`SplitRecorder` is :class:`fragsim.metrics.Recorder`'s companion for the
hybrid managers: the main recorder keeps the pool-wide four-way split (token
states, reservation, everything else held, free) beside running, waiting and the
external-fragmentation ratio; this one keeps the full
``rows × CATEGORIES`` matrix of :meth:`HybridManager.split
<fragsim.hybrid.manager.HybridManager.split>`, as exact time integrals and peaks,
and per time bucket for the figures.
"""

from __future__ import annotations

from operator import add
from typing import Any

import numpy as np

from fragsim.hybrid.groups import CATEGORIES


class SplitRecorder:
    """Time integrals of a ``[rows, categories]`` byte matrix."""

    def __init__(self, labels: list[str], kinds: list[str], capacity: int,
                 resolution_s: float | None, basis: np.ndarray | None = None) -> None:
        self.labels, self.kinds, self.capacity = labels, kinds, capacity
        self.resolution_s = resolution_s
        self._shape = (len(labels), len(CATEGORIES))
        size = self._shape[0] * self._shape[1]
        # Flat, row-major, in plain floats: a step's state adds to them without an array
        # (each element gets the same float operations, in the same order, as in numpy).
        self._integral = [0.0] * size
        self._span = 0.0
        self._used_blocks = 0.0
        self._buckets: dict[int, list[float]] = {}
        self._bucket_span: dict[int, float] = {}
        #: per kind, further summary keys (the engine's prefix-cache hit rates)
        self.extra_by_kind: dict[str, dict[str, float]] = {}
        # States given as sums (record_sums) are integrated as sums, and mapped to the
        # split through ``basis`` (``[sums, rows · categories]``) when it is read.
        self._basis = None if basis is None else np.asarray(basis, dtype=np.float64)
        self._sums: list[float] = [0.0] * (0 if basis is None else len(basis))
        self._sum_buckets: dict[int, list[float]] = {}

    def record(self, t: float, dt: float, split: np.ndarray | list[list[int]], used_blocks: int,
               total: int | None = None, least: int | None = None) -> None:
        """One state held for ``dt`` from ``t`` (``split``: an array or its rows as lists;
        ``total`` and ``least``: the split's sum and smallest part, when the caller has them)."""
        rows = split.tolist() if isinstance(split, np.ndarray) else split
        if total is None or least is None:
            total, least = sum(map(sum, rows)), min(map(min, rows))
        if total != self.capacity or least < 0:
            raise AssertionError(f"broken byte split at t={t}: sums to {total:,} of "
                                 f"{self.capacity:,}, least part {least:,}\n{np.array(rows)}")
        if dt <= 0:
            return
        weighted = [v * dt for row in rows for v in row]
        self._integral = list(map(add, self._integral, weighted))
        self._span += dt
        self._used_blocks += used_blocks * dt
        if self.resolution_s is not None:
            self._bucket(int(t // self.resolution_s), weighted, dt)

    def record_sums(self, t: float, dt: float, sums: list[int], used_blocks: int) -> None:
        """One state held for ``dt`` from ``t``, given as the sums the split is linear in
        (:meth:`HybridManager._basis <fragsim.hybrid.manager.HybridManager._basis>`, which
        checks the identity)."""
        if dt <= 0:
            return
        weighted = [v * dt for v in sums]
        self._sums = list(map(add, self._sums, weighted))
        self._span += dt
        self._used_blocks += used_blocks * dt
        if self.resolution_s is not None:
            b = int(t // self.resolution_s)
            acc = self._sum_buckets.get(b)
            self._sum_buckets[b] = weighted if acc is None else list(map(add, acc, weighted))
            self._bucket_span[b] = self._bucket_span.get(b, 0.0) + dt

    def record_steps(self, t0: float, dts: np.ndarray, splits: np.ndarray,
                     used_blocks: np.ndarray, totals: np.ndarray | None = None) -> None:
        """Consecutive states ``splits[j]`` lasting ``dts[j]``, the first from ``t0``
        (``totals``: each state's sum, when the caller has it)."""
        if totals is None:
            totals = splits.sum(axis=(1, 2))
        if (totals != self.capacity).any() or int(splits.min()) < 0:
            j = int(np.flatnonzero((totals != self.capacity) | (splits.min(axis=(1, 2)) < 0))[0])
            raise AssertionError(f"broken byte split in the stretch from t={t0}, step {j}: sums to "
                                 f"{int(totals[j]):,} of {self.capacity:,}\n{splits[j]}")
        shape = splits.shape[1:]
        weighted = np.dot(dts.reshape(1, -1), splits.reshape(len(dts), -1)).reshape(shape)   # tensordot's own
        flat = weighted.ravel().tolist()
        self._integral = list(map(add, self._integral, flat))
        span = float(dts.sum())
        self._span += span
        self._used_blocks += float(np.dot(dts, used_blocks))
        if self.resolution_s is None:
            return
        ends = np.cumsum(dts)
        first = t0 // self.resolution_s
        if len(dts) == 1 or (t0 + float(ends[-2])) // self.resolution_s == first:   # one bucket
            self._bucket(int(first), flat, span)
            return
        starts = t0 + np.concatenate(([0.0], ends[:-1]))
        index = (starts // self.resolution_s).astype(np.int64)
        for b in np.unique(index).tolist():
            sel = index == b
            self._bucket(b, np.tensordot(dts[sel], splits[sel], axes=(0, 0)).ravel().tolist(),
                         float(dts[sel].sum()))

    def _bucket(self, b: int, weighted: list[float], span: float) -> None:
        """Add to bucket ``b`` (``weighted``: flat, row-major; the bucket keeps a copy)."""
        acc = self._buckets.get(b)
        self._buckets[b] = list(weighted) if acc is None else list(map(add, acc, weighted))
        self._bucket_span[b] = self._bucket_span.get(b, 0.0) + span

    def _integral_of(self, full: list[float] | None, sums: list[float] | None) -> np.ndarray:
        """A time integral of the split, ``[rows, categories]``, from its parts."""
        out = np.zeros(self._shape) if full is None else np.array(full, dtype=np.float64).reshape(self._shape)
        if sums is not None and self._basis is not None:
            out = out + (np.array(sums, dtype=np.float64) @ self._basis).reshape(self._shape)
        return out

    # -- output ----------------------------------------------------------------

    def means(self) -> np.ndarray:
        """Time-weighted mean bytes, ``[rows, categories]``."""
        integral = self._integral_of(self._integral, self._sums)
        return integral / self._span if self._span > 0 else np.zeros_like(integral)

    def mean_used_blocks(self) -> float:
        return self._used_blocks / self._span if self._span > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """The ``--json`` keys: pool totals per category, then ``by_kind``."""
        means = self.means()
        cap = self.capacity
        out: dict[str, Any] = {"kv_pool_bytes": cap}
        total = means.sum(axis=0)
        for c, name in enumerate(CATEGORIES):
            out[f"mean_{name}_bytes"] = float(total[c])
        for c, name in enumerate(CATEGORIES):
            out[f"{name}_frac"] = float(total[c]) / cap if cap else 0.0
        by_kind: dict[str, dict[str, float]] = {}
        for r, kind in enumerate(self.kinds):
            entry = by_kind.setdefault(kind, {f"mean_{name}_bytes": 0.0 for name in CATEGORIES})
            for c, name in enumerate(CATEGORIES):
                entry[f"mean_{name}_bytes"] += float(means[r, c])
        for entry in by_kind.values():
            held = sum(v for k, v in entry.items() if k != "mean_free_bytes")
            entry["pool_frac"] = (held + entry["mean_free_bytes"]) / cap if cap else 0.0
            entry["token_states_frac_of_held"] = entry["mean_token_states_bytes"] / held if held else 0.0
        for kind, extra in self.extra_by_kind.items():
            by_kind.setdefault(kind, {}).update(extra)
        out["by_kind"] = by_kind
        out["by_row"] = {label: {f"mean_{name}_bytes": float(means[r, c])
                                 for c, name in enumerate(CATEGORIES)}
                         for r, label in enumerate(self.labels)}
        out["mean_used_blocks"] = self.mean_used_blocks()
        return out

    def timeseries(self) -> dict[str, np.ndarray]:
        """Per bucket: start time and the mean bytes of each kind and category
        (columns ``<kind>.<category>``)."""
        keys = sorted(self._bucket_span)
        out: dict[str, np.ndarray] = {
            "time_s": np.array(keys, dtype=np.float64) * (self.resolution_s or 0.0)}
        spans = np.array([self._bucket_span[k] for k in keys])
        buckets = {k: self._integral_of(self._buckets.get(k), self._sum_buckets.get(k)) for k in keys}
        kinds = list(dict.fromkeys(self.kinds))
        for kind in kinds:
            rows = [r for r, k in enumerate(self.kinds) if k == kind]
            for c, name in enumerate(CATEGORIES):
                vals = np.array([buckets[k][rows, c].sum() for k in keys])
                with np.errstate(divide="ignore", invalid="ignore"):
                    out[f"{kind}.{name}"] = np.where(spans > 0, vals / np.where(spans > 0, spans, 1), 0.0)
        return out
