"""The committed reference results still come out of the code.

Each ``results/reference/<study>/`` was written by the command in its
``sweep.json``. Here every study is rerun at that scale and its table compared
with the committed one, row by row (rows keyed by case, swept parameters and
allocator): integer columns exactly, floating-point ones to 1e-9 relative (the
order of a floating-point sum is the only thing allowed to differ), strings
exactly. ``wall_time_s`` is the host's, not the model's, and is skipped;
``point_id`` is skipped too, since it hashes every RunSpec field and a new field
with a default moves it without changing any result. A summary key that is new
since the reference was written is reported, not failed; a missing one fails.

When a change to the simulator is meant to move the numbers, regenerate the
reference with the command in results/README.md and commit it with the change.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fragsim.experiments import draw, load_study, run_study

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "results" / "reference"
STUDIES = sorted(p.parent.name for p in REFERENCE.glob("*/results.parquet"))
SKIP = {"wall_time_s", "point_id"}
RTOL = 1e-9


def test_every_study_has_a_committed_reference() -> None:
    studies = sorted(p.stem for p in (REPO / "experiments").glob("*.toml") if p.stem != "catalog_example")
    assert STUDIES == studies


def assert_same_columns(committed: pd.DataFrame, fresh: pd.DataFrame, what: str) -> None:
    missing = sorted(set(committed.columns) - set(fresh.columns) - SKIP)
    assert not missing, f"{what}: columns gone since the reference was written: {missing}"
    for column in committed.columns:
        if column in SKIP:
            continue
        old, new = committed[column], fresh[column]
        if pd.api.types.is_integer_dtype(old) and pd.api.types.is_integer_dtype(new):
            bad = np.flatnonzero(old.to_numpy() != new.to_numpy())
        elif pd.api.types.is_numeric_dtype(old) and pd.api.types.is_numeric_dtype(new):
            a, b = old.to_numpy(dtype=np.float64), new.to_numpy(dtype=np.float64)
            close = np.isclose(a, b, rtol=RTOL, atol=1e-12) | (np.isnan(a) & np.isnan(b))
            bad = np.flatnonzero(~close)
        else:
            a_obj, b_obj = old.astype(object).where(old.notna(), None), new.astype(object).where(new.notna(), None)
            bad = np.flatnonzero([x != y for x, y in zip(a_obj, b_obj, strict=True)])
        assert not len(bad), (f"{what}: column {column!r} differs in row {bad[0]}: "
                              f"reference {old.iloc[bad[0]]!r}, now {new.iloc[bad[0]]!r}")


@pytest.mark.parametrize("name", STUDIES)
def test_reference_reproduces(name: str, request: pytest.FixtureRequest) -> None:
    folder = REFERENCE / name
    manifest = json.loads((folder / "sweep.json").read_text())
    toml = REPO / "experiments" / f"{name}.toml"
    # Only studies on the public trace files need them (the fixture skips without).
    traces = request.getfixturevalue("shared_traces") if "${SHARED_TRACES}" in toml.read_text() else None
    study = load_study(toml)
    result = run_study(study, scale=manifest["scale"], min_requests=manifest["min_requests"],
                       traces_dir=traces, executor="local", workers=2, figures=False)
    committed = pd.read_parquet(folder / "results.parquet")
    keys = manifest["key_columns"]
    assert committed[keys].astype(str).values.tolist() == result.table[keys].astype(str).values.tolist()
    assert_same_columns(committed, result.table, f"{name}/results.parquet")
    if (folder / "timeseries.parquet").is_file():
        assert result.timeseries is not None
        series = pd.read_parquet(folder / "timeseries.parquet")
        assert len(series) == len(result.timeseries)
        assert_same_columns(series, result.timeseries, f"{name}/timeseries.parquet")
    for spec in study.figures:
        assert spec.file in manifest["figures"]
        assert (folder / spec.file).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert draw(spec, result.table, result.timeseries, study).axes
