"""Raw trace columns to validated numpy arrays, naming the first bad row when they are not.

Validation is vectorised: a whole column is converted at once (bad cells become
NaN), one mask marks every bad value, and only the first one is turned into the
message. A 30,000-row file costs milliseconds whether it is clean or not.

Every message has the shape the CLI prints on one line::

    azure_conv_2023.csv: row 17: field 'ContextTokens': expected a positive integer, got '-3'

where *row* counts data rows from 1 (the header is not a row) in CSV files, and
*line* counts physical lines from 1 in JSON-lines files.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import cast

import numpy as np
import pandas as pd

from fragsim.errors import FragsimError


@dataclass(frozen=True)
class Locator:
    """Turns a 0-based record index into the place a person finds it in the file."""

    label: str  # the file as the user named it
    unit: str  # "row" (CSV data rows) or "line" (JSON-lines physical lines)
    numbers: Sequence[int] | None = None  # line number per record when records skip lines

    def where(self, index: int) -> str:
        number = self.numbers[index] if self.numbers is not None else index + 1
        return f"{self.label}: {self.unit} {number}"

    def error(self, index: int, field: str, expected: str, got: str) -> FragsimError:
        return FragsimError(f"{self.where(index)}: field '{field}': expected {expected}, got {got}")


RawValue = Callable[[int], str]


def _first(mask: np.ndarray) -> int | None:
    return int(np.argmax(mask)) if mask.any() else None


def csv_raw(series: pd.Series) -> RawValue:
    """Show a CSV cell as it was written, quoted."""
    return lambda i: repr(str(series.iloc[i]))


def json_raw(values: Sequence[object]) -> RawValue:
    """Show a JSON value as it was written (strings keep their quotes)."""
    return lambda i: f"'{json.dumps(values[i])}'"


def csv_numbers(series: pd.Series) -> np.ndarray:
    """Parse a column of strings to float64; anything unparsable becomes NaN."""
    return pd.to_numeric(series.str.strip(), errors="coerce").to_numpy(dtype=np.float64)


def json_numbers(values: Sequence[object]) -> np.ndarray:
    """JSON numbers to float64; strings, null, booleans and lists become NaN."""
    # type() rather than isinstance(): a JSON true must not pass as the number 1.
    return np.fromiter(
        (v if type(v) in (int, float) else np.nan for v in values),
        dtype=np.float64,
        count=len(values),
    )


def positive_ints(values: np.ndarray, raw: RawValue, field: str, at: Locator) -> np.ndarray:
    """Check that every value is a whole number >= 1 and return them as int64."""
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(values) | (values < 1) | (values != np.floor(values))
    index = _first(bad)
    if index is not None:
        raise at.error(index, field, "a positive integer", raw(index))
    return values.astype(np.int64)


def finite_seconds(values: np.ndarray, raw: RawValue, field: str, at: Locator,
                   unit: str = "seconds") -> np.ndarray:
    """Check that every arrival time is a finite, non-negative number of ``unit``."""
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(values) | (values < 0)
    index = _first(bad)
    if index is not None:
        raise at.error(index, field, f"a number of {unit} >= 0", raw(index))
    return values


def datetime_seconds(series: pd.Series, field: str, at: Locator) -> np.ndarray:
    """Parse absolute date-times (any number of fractional digits) to seconds since the earliest.

    Azure's ``2023-11-16 18:15:46.6805900`` has seven fractional digits, more than
    ``%f`` promises; ISO 8601 parsing in pandas reads them at nanosecond resolution.
    """
    try:
        stamps = pd.to_datetime(series.str.strip(), format="ISO8601", errors="coerce")
    except (ValueError, TypeError) as exc:  # e.g. time zones mixed across rows
        raise FragsimError(
            f"{at.label}: field '{field}': cannot parse the date-times: {' '.join(str(exc).split())}"
        ) from None
    index = _first(stamps.isna().to_numpy())
    if index is not None:
        raise at.error(
            index, field, "a date-time like '2023-11-16 18:15:46.68059'", csv_raw(series)(index)
        )
    return (stamps - stamps.min()).dt.total_seconds().to_numpy(dtype=np.float64)


def hash_tuples(
    cells: Sequence[Sequence[object]], raw: RawValue, field: str, at: Locator
) -> list[tuple[int, ...]]:
    """Check that every row's block hashes are integers; return one tuple per row.

    ``cells`` holds one sequence per row: JSON lists as parsed, or the CSV cell
    split on whitespace. All values are checked in one flat array, and a bad one
    is traced back to its row through the per-row counts.
    """
    counts = np.fromiter((len(c) for c in cells), dtype=np.int64, count=len(cells))
    ends = np.cumsum(counts)
    values = list(chain.from_iterable(cells))
    if all(type(v) is int for v in values):  # JSON ints pass here; CSV text is converted
        flat = cast("list[int]", values)
    else:
        converted = [_as_int(v) for v in values]
        bad = next((i for i, v in enumerate(converted) if v is None), None)
        if bad is not None:
            row = int(np.searchsorted(ends, bad, side="right"))
            raise at.error(row, field, "integer block hashes", raw(row))
        flat = cast("list[int]", converted)
    bounds = ends.tolist()
    return [tuple(flat[s:e]) for s, e in zip([0, *bounds[:-1]], bounds, strict=True)]


def hash_counts(hashes: Sequence[Sequence[int]], prompt: np.ndarray, block_size: int,
                field: str, prompt_field: str, at: Locator) -> None:
    """Check that every row has one hash per ``block_size`` prompt tokens (the last may be partial)."""
    counts = np.fromiter((len(h) for h in hashes), dtype=np.int64, count=len(hashes))
    want = -(-prompt // block_size)
    index = _first(counts != want)
    if index is not None:
        raise FragsimError(
            f"{at.where(index)}: field '{field}': expected {int(want[index])} hashes (one per "
            f"{block_size} tokens of {prompt_field} {int(prompt[index])}), got {int(counts[index])}")


def session_ids(values: Sequence[object], raw: RawValue, field: str, at: Locator,
                text: bool = False) -> np.ndarray:
    """Check that every session id is an integer in ``[0, 2**63)``; return them as int64.

    JSON values must be integers (not ``3.0``, ``"3"`` or ``true``); with ``text``
    the values are CSV cells, integer text.
    """
    ids = [_as_int(v) if text else v if type(v) is int else None for v in values]
    top = int(np.iinfo(np.int64).max)
    index = next((i for i, v in enumerate(ids) if v is None or not 0 <= v <= top), None)
    if index is not None:
        raise at.error(index, field, "a non-negative integer", raw(index))
    return np.array(ids, dtype=np.int64)


def _as_int(value: object) -> int | None:
    if type(value) is int:
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None
