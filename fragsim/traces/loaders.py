"""Read a trace file of any supported format; the format is told by the content.

The header line (CSV) or the first record (JSON lines) decides the format, never
the file extension, so a renamed or extension-less copy loads the same way.

Formats (extra columns or keys are ignored):

- **Azure CSV** ``TIMESTAMP,ContextTokens,GeneratedTokens``: absolute date-times
  (``2023-11-16 18:15:46.6805900``), prompt and output tokens.
- **Vidur CSV** ``arrived_at,num_prefill_tokens,num_decode_tokens``: arrivals in seconds.
- **plain CSV** ``arrival_time_s,prompt_len,output_len[,block_hashes]``: fragsim's own.
- **length-only CSV** ``num_prefill_tokens,num_decode_tokens``: no arrivals at all.
- **Mooncake JSONL** one object per line, ``{"timestamp": ms, "input_length": n,
  "output_length": n, "hash_ids": [...]}``; ``hash_ids`` (one per 512 prompt
  tokens, equal ids meaning identical content) is optional but, once the first
  line has it, required on every line. Its length is not checked against
  ``input_length``.

Session ids (:attr:`Trace.session <fragsim.traces.request.Trace.session>`, the
conversation a request belongs to) are read when the file has them: in JSON lines
from the first of the keys ``session``, ``session_id``, ``conversation_id``,
``chat_id`` that any record has (then every record needs it), in any CSV format
from a ``session_id`` (else ``session``) column. Each must be an integer >= 0.

The *plain CSV* is fragsim's own (:func:`save_trace` writes it): one request per
row, ``arrival_time_s`` in seconds, ``prompt_len`` and ``output_len`` in tokens,
an optional ``block_hashes`` column holding the request's prefix-block hashes
as space-separated integers (``"0 14 15"``), one per 512 prompt tokens as in
Mooncake's ``hash_ids``, and an optional ``session_id`` column.

Every loaded trace starts at 0.0: arrivals are seconds since the earliest one.
Rows out of time order are sorted (stably) with a ``UserWarning`` saying how many
were out of order. Length-only files get ``has_timestamps=False`` and all-zero
arrivals until :func:`fragsim.traces.assign_arrivals` gives them some. Any bad
input raises :class:`~fragsim.errors.FragsimError` with a one-line message naming
the file, the row or line, and the field (see :mod:`fragsim.traces.columns`).
"""

from __future__ import annotations

import csv
import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import pandas as pd

from fragsim.errors import FragsimError
from fragsim.files import write_atomically
from fragsim.traces import columns as col
from fragsim.traces.request import Trace

DATA_DIR = Path(__file__).with_name("data")

#: Traces shipped inside the package: name -> file in ``fragsim/traces/data``.
BUNDLED_TRACES: dict[str, str] = {
    "azure-conv": "azure_conv_2023.csv",
    "azure-code": "azure_code_2023.csv",
}

MOONCAKE_BLOCK_SIZE = 512  # tokens per hash id in Mooncake's traces
_HEAD_BYTES = 65536


@dataclass(frozen=True)
class CsvFormat:
    """Which columns a CSV dialect uses; ``keys`` are the columns that identify it."""

    title: str
    keys: tuple[str, ...]
    prompt: str
    output: str
    arrival: str | None = None
    arrival_is_datetime: bool = False
    hashes: str | None = None  # optional column

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(c for c in (self.arrival, self.prompt, self.output) if c)


# Checked in order: the first whose key column appears in the header wins.
CSV_FORMATS = (
    CsvFormat("Azure CSV", ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
              "ContextTokens", "GeneratedTokens", "TIMESTAMP", arrival_is_datetime=True),
    CsvFormat("Vidur CSV", ("arrived_at",), "num_prefill_tokens", "num_decode_tokens", "arrived_at"),
    CsvFormat("plain CSV", ("arrival_time_s", "prompt_len", "output_len"),
              "prompt_len", "output_len", "arrival_time_s", hashes="block_hashes"),
    CsvFormat("length-only CSV", ("num_prefill_tokens", "num_decode_tokens"),
              "num_prefill_tokens", "num_decode_tokens"),
)  # fmt: skip
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")
#: Record keys read as the session id, in order of preference.
SESSION_KEYS = ("session", "session_id", "conversation_id", "chat_id")
#: CSV columns read as the session id, in order of preference.
SESSION_COLUMNS = ("session_id", "session")
SUPPORTED = "; ".join(
    [f"{f.title} ({','.join(f.required)})" for f in CSV_FORMATS]
    + [f"Mooncake JSONL ({{{', '.join(MOONCAKE_KEYS)}, hash_ids}})"]
)


def load_trace(name_or_path: str | os.PathLike[str]) -> Trace:
    """Load a bundled trace by name (``"azure-conv"``) or any trace file by path."""
    name = str(name_or_path)
    if name in BUNDLED_TRACES:
        path = DATA_DIR / BUNDLED_TRACES[name]
        trace_name, label, source = name, BUNDLED_TRACES[name], name
    else:
        path = Path(name_or_path)
        trace_name, label, source = path.stem, name, name
        if not path.exists():
            bundled = ", ".join(BUNDLED_TRACES)
            raise FragsimError(f"{label}: no such file (and not a bundled trace: {bundled})")
    head = _read_head(path, label)
    first = next((line for line in head.splitlines() if line.strip()), "")
    if first.lstrip().startswith(("{", "[")):
        return _load_mooncake(path, label, trace_name, source)
    return _load_csv(path, label, trace_name, source, first)


def save_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write ``trace`` as a plain CSV (atomically), which :func:`load_trace` reads back.

    Session ids, when the trace has them, go in a ``session_id`` column."""
    _check_hash_size(trace)
    frame = trace.to_frame()
    if trace.block_hashes is not None:
        frame["block_hashes"] = [" ".join(map(str, h)) for h in trace.block_hashes]
    write_atomically(path, lambda out: frame.to_csv(out, index=False))


def save_mooncake(trace: Trace, path: str | os.PathLike[str],
                  extra: dict[str, Sequence[int] | np.ndarray] | None = None) -> None:
    """Write ``trace`` as Mooncake JSON lines (timestamps in whole milliseconds), atomically.

    Session ids, when the trace has them, go in each record's ``session``, and a
    conversation's content ids over each turn's prompt and output (a session trace's
    ``context_hashes``) in ``context_hash_ids``. ``extra`` adds integer fields per
    record (e.g. a turn number); readers ignore them."""
    _check_hash_size(trace)
    columns: dict[str, list] = {
        "timestamp": np.rint(trace.arrival_s * 1000.0).astype(np.int64).tolist(),
        "input_length": trace.prompt_len.tolist(),
        "output_length": trace.output_len.tolist(),
    }
    if trace.block_hashes is not None:
        columns["hash_ids"] = [list(h) for h in trace.block_hashes]
    if trace.session is not None:
        columns["session"] = trace.session.tolist()
    if trace.context_hashes is not None:
        columns["context_hash_ids"] = [list(h) for h in trace.context_hashes]
    for key, values in (extra or {}).items():
        if key in columns or key in SESSION_KEYS or key == "context_hash_ids":
            raise ValueError(f"extra field {key!r} would clash with the trace's own fields")
        columns[key] = [int(v) for v in values]
    keys = list(columns)
    lines = (json.dumps(dict(zip(keys, row, strict=True))) for row in zip(*columns.values(), strict=True))
    write_atomically(path, lambda out: out.write(("\n".join(lines) + "\n").encode()), "the trace")


def _check_hash_size(trace: Trace) -> None:
    if trace.block_hashes is not None and trace.block_hash_size != MOONCAKE_BLOCK_SIZE:
        raise ValueError(f"{trace.name}: trace files hold one hash per {MOONCAKE_BLOCK_SIZE} "
                         f"tokens; this trace has one per {trace.block_hash_size}")


def _read_head(path: Path, label: str) -> str:
    try:
        with open(path, encoding="utf-8-sig") as file:
            head = file.read(_HEAD_BYTES)
    except IsADirectoryError:
        raise FragsimError(f"{label}: is a directory, not a trace file") from None
    except UnicodeDecodeError:
        raise FragsimError(f"{label}: not a UTF-8 text file") from None
    except OSError as exc:
        raise FragsimError(f"{label}: cannot read: {exc.strerror or exc}") from None
    if not head.strip():
        raise FragsimError(f"{label}: empty file")
    return head


def _detect_csv(header: list[str], label: str) -> CsvFormat:
    for fmt in CSV_FORMATS:
        if any(key in header for key in fmt.keys):
            missing = [c for c in fmt.required if c not in header]
            if missing:
                raise FragsimError(
                    f"{label}: looks like {fmt.title} but lacks column(s) {', '.join(missing)}; "
                    f"expected columns {','.join(fmt.required)}"
                )
            return fmt
    raise FragsimError(
        f"{label}: unknown trace format (header {','.join(header)!r}); supported: {SUPPORTED}"
    )


def _load_csv(path: Path, label: str, trace_name: str, source: str, first: str) -> Trace:
    header = [h.strip() for h in next(csv.reader([first]))]
    fmt = _detect_csv(header, label)
    try:
        frame = pd.read_csv(path, dtype=str, na_filter=False, encoding="utf-8-sig")
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as exc:
        raise FragsimError(f"{label}: malformed CSV: {_one_line(exc)}") from None
    frame.columns = [str(c).strip() for c in frame.columns]
    if len(frame) == 0:
        raise FragsimError(f"{label}: no data rows after the header")
    at = col.Locator(label, "row")
    prompt = _csv_lengths(frame, fmt.prompt, at)
    output = _csv_lengths(frame, fmt.output, at)
    hashes = None
    if fmt.hashes and fmt.hashes in frame.columns:
        cells = frame[fmt.hashes].str.split().tolist()
        hashes = col.hash_tuples(cells, col.csv_raw(frame[fmt.hashes]), fmt.hashes, at)
        col.hash_counts(hashes, prompt, MOONCAKE_BLOCK_SIZE, fmt.hashes, fmt.prompt, at)
    session = None
    session_column = next((c for c in SESSION_COLUMNS if c in frame.columns), None)
    if session_column is not None:
        cells = frame[session_column]
        session = col.session_ids(cells.tolist(), col.csv_raw(cells), session_column, at,
                                  text=True)
    if fmt.arrival is None:
        return Trace(trace_name, source, np.zeros(len(frame)), prompt, output, has_timestamps=False,
                     session=session)
    raw = frame[fmt.arrival]
    if fmt.arrival_is_datetime:
        arrival = col.datetime_seconds(raw, fmt.arrival, at)
    else:
        arrival = col.finite_seconds(col.csv_numbers(raw), col.csv_raw(raw), fmt.arrival, at)
    block_size = MOONCAKE_BLOCK_SIZE if hashes is not None else None
    return _sorted_trace(trace_name, source, label, arrival, prompt, output, hashes, block_size,
                         session)


def _csv_lengths(frame: pd.DataFrame, field: str, at: col.Locator) -> np.ndarray:
    raw = frame[field]
    return col.positive_ints(col.csv_numbers(raw), col.csv_raw(raw), field, at)


def _load_mooncake(path: Path, label: str, trace_name: str, source: str) -> Trace:
    records, line_numbers = _read_json_lines(path, label)
    at = col.Locator(label, "line", line_numbers)
    if not any(key in records[0] for key in (*MOONCAKE_KEYS, "hash_ids")):
        keys = ", ".join(map(str, records[0]))
        raise FragsimError(
            f"{at.where(0)}: unknown trace format (keys {keys}); supported: {SUPPORTED}"
        )
    # hash_ids is optional, but once the first record has it every record must.
    wanted = (*MOONCAKE_KEYS, "hash_ids") if "hash_ids" in records[0] else MOONCAKE_KEYS
    fields = {}
    for key in wanted:
        values = [r.get(key, _MISSING) for r in records]
        absent = next((i for i, v in enumerate(values) if v is _MISSING), None)
        if absent is not None:
            raise FragsimError(
                f"{at.where(absent)}: field '{key}': missing (Mooncake JSONL needs "
                f"{', '.join(wanted)})"
            )
        fields[key] = values
    stamps = fields["timestamp"]
    arrival = col.finite_seconds(col.json_numbers(stamps), col.json_raw(stamps), "timestamp", at,
                                 unit="milliseconds")
    prompt, output = (
        col.positive_ints(col.json_numbers(fields[k]), col.json_raw(fields[k]), k, at)
        for k in ("input_length", "output_length")
    )
    hashes = None
    if "hash_ids" in fields:
        hashes = _hash_lists(fields["hash_ids"], "hash_ids", prompt, "input_length", at)
    block_size = MOONCAKE_BLOCK_SIZE if hashes is not None else None
    seconds = arrival / 1000.0
    session = _mooncake_sessions(records, at)
    context = _context_ids(records, prompt + output, hashes is not None, at)
    return _sorted_trace(trace_name, source, label, seconds, prompt, output, hashes, block_size,
                         session, context)


def _context_ids(records: list[dict[str, object]], total: np.ndarray, has_hashes: bool,
                 at: col.Locator) -> list[tuple[int, ...]] | None:
    """The records' ``context_hash_ids`` (a session trace's content ids over each turn's
    prompt and output, one per 512 tokens), on every record or on none."""
    key = "context_hash_ids"
    if not any(key in r for r in records):
        return None
    cells = [r.get(key, _MISSING) for r in records]
    absent = next((i for i, c in enumerate(cells) if c is _MISSING), None)
    if absent is not None:
        raise FragsimError(f"{at.where(absent)}: field '{key}': missing (it goes on every record or on none)")
    if not has_hashes:
        raise FragsimError(f"{at.where(0)}: field '{key}' needs 'hash_ids' on every record")
    return _hash_lists(cells, key, total, "input_length + output_length", at)


def _hash_lists(cells: list[object], field: str, tokens: np.ndarray, tokens_field: str,
                at: col.Locator) -> list[tuple[int, ...]]:
    """A field of one integer list per record, one id per 512 of ``tokens``; a row that
    breaks that is named."""
    not_list = next((i for i, c in enumerate(cells) if type(c) is not list), None)
    if not_list is not None:
        raise at.error(not_list, field, "a list of integers", col.json_raw(cells)(not_list))
    hashes = col.hash_tuples(cast("list[list[object]]", cells), col.json_raw(cells), field, at)
    col.hash_counts(hashes, tokens, MOONCAKE_BLOCK_SIZE, field, tokens_field, at)
    return hashes


def _mooncake_sessions(records: list[dict[str, object]], at: col.Locator) -> np.ndarray | None:
    """The records' session ids under the first of :data:`SESSION_KEYS` any record has."""
    key = next((k for k in SESSION_KEYS if any(k in r for r in records)), None)
    if key is None:
        return None
    values = [r.get(key, _MISSING) for r in records]
    absent = next((i for i, v in enumerate(values) if v is _MISSING), None)
    if absent is not None:
        present = next(i for i, v in enumerate(values) if v is not _MISSING)
        other = at.where(present)[len(at.label) + 2:]  # "line 3"
        raise FragsimError(
            f"{at.where(absent)}: field '{key}': missing ({other} has it; a session id goes "
            "on every record or on none)"
        )
    return col.session_ids(values, col.json_raw(values), key, at)


_MISSING = object()
_JSON_TYPES = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def _read_json_lines(path: Path, label: str) -> tuple[list[dict[str, object]], list[int]]:
    records: list[dict[str, object]] = []
    line_numbers: list[int] = []
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise FragsimError(f"{label}: cannot read: {_one_line(exc)}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise FragsimError(
                f"{label}: line {number}: bad JSON: {exc.msg} (column {exc.colno})"
            ) from None
        if not isinstance(record, dict):
            kind = _JSON_TYPES.get(type(record), type(record).__name__)
            raise FragsimError(f"{label}: line {number}: expected a JSON object, got {kind}")
        records.append(record)
        line_numbers.append(number)
    if not records:
        raise FragsimError(f"{label}: empty file")
    return records, line_numbers


def _sorted_trace(
    trace_name: str,
    source: str,
    label: str,
    arrival: np.ndarray,
    prompt: np.ndarray,
    output: np.ndarray,
    hashes: list[tuple[int, ...]] | None,
    block_hash_size: int | None,
    session: np.ndarray | None = None,
    context: list[tuple[int, ...]] | None = None,
) -> Trace:
    """Sort rows by arrival (warning if they were not) and re-zero the arrival times."""
    num_out_of_order = int(np.count_nonzero(np.diff(arrival) < 0))
    if num_out_of_order:
        warnings.warn(
            f"{label}: {num_out_of_order} of {len(arrival)} rows arrive earlier than the row "
            "before them; sorted the trace by arrival time",
            UserWarning,
            stacklevel=4,  # load_trace's caller
        )
        order = np.argsort(arrival, kind="stable")
        arrival, prompt, output = arrival[order], prompt[order], output[order]
        if hashes is not None:
            hashes = [hashes[i] for i in order.tolist()]
        if session is not None:
            session = session[order]
        if context is not None:
            context = [context[i] for i in order.tolist()]
    return Trace(
        trace_name,
        source,
        arrival - arrival[0],
        prompt,
        output,
        block_hashes=hashes,
        block_hash_size=block_hash_size,
        session=session,
        context_hashes=context,
    )


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
