"""One request, and a whole trace of them held column by column.

A trace of a million requests is three numpy arrays (and, for Mooncake traces, a
list of block-hash tuples; for traces that record conversations, a session-id
array), not a million objects: the engine and the statistics
read the columns directly, and :meth:`Trace.requests` builds :class:`Request`
objects only for whoever iterates.

Invariants, checked when a :class:`Trace` is built::

    arrival_s    float64, sorted ascending; all zeros when has_timestamps is False
    prompt_len   int64, every value >= 1
    output_len   int64, every value >= 1
    block_hashes None, or one tuple per row (row i covers prompt tokens
                 [k * block_hash_size, (k + 1) * block_hash_size) with its k-th hash)
    session      None, or int64 with every value >= 0: the conversation each row
                 belongs to (equal ids, same session; the ids need not be dense)
    context_hashes
                 None, or one tuple per row (with block_hashes): the content ids of the
                 row's prompt and output together, as the conversation that goes on
                 from it sees them (a block the row leaves partial has the id it has
                 once full). Session traces have them; they key decode blocks
                 (:mod:`fragsim.prefix`)

The arrays are made read-only, so slices of one trace may share memory with it
without one caller's edit showing up in another's simulation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True, slots=True)
class Request:
    """One LLM request as the simulator sees it: when it arrives and how long it is."""

    request_id: int
    arrival_time: float  # seconds from the start of the trace
    prompt_len: int
    output_len: int
    # Prefix-content hashes (Mooncake hash_ids), one per block_hash_size prompt tokens;
    # equal hashes mean identical content, which is what prefix sharing exploits.
    block_hashes: tuple[int, ...] | None = None

    @property
    def total_len(self) -> int:
        """Tokens whose KV the request holds when it finishes."""
        return self.prompt_len + self.output_len


def _frozen_array(values: object, dtype: type) -> np.ndarray:
    array: np.ndarray = np.asarray(values, dtype=dtype)
    if array.flags.writeable:
        # Copy what the caller could still write to; read-only arrays (another
        # trace's columns, or slices of them) are shared as they are.
        array = array.copy()
        array.setflags(write=False)
    return array


def _session_ids(values: object, num_rows: int) -> np.ndarray:
    raw = np.asarray(values)
    if raw.size and raw.dtype.kind not in "iu":
        raise ValueError(f"Trace session must hold integers, got dtype {raw.dtype}")
    if raw.ndim != 1 or len(raw) != num_rows:
        raise ValueError(f"Trace session has shape {raw.shape}, not one id per row ({num_rows})")
    if raw.size and (raw.min() < 0 or raw.max() > np.iinfo(np.int64).max):
        raise ValueError("Trace session ids must all be >= 0 (and fit in int64)")
    return _frozen_array(raw, np.int64)


@dataclass(frozen=True, eq=False)
class Trace:
    """A request trace in columns; row ``i`` is request ``i`` (see the module invariants)."""

    name: str
    source: str
    arrival_s: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    block_hashes: list[tuple[int, ...]] | None = None
    block_hash_size: int | None = None
    has_timestamps: bool = True
    session: np.ndarray | None = None
    context_hashes: list[tuple[int, ...]] | None = None
    _num_rows: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        arrival = _frozen_array(self.arrival_s, np.float64)
        prompt = _frozen_array(self.prompt_len, np.int64)
        output = _frozen_array(self.output_len, np.int64)
        n = len(arrival)
        if not (arrival.ndim == prompt.ndim == output.ndim == 1):
            raise ValueError("Trace columns must be one-dimensional")
        if not len(prompt) == len(output) == n:
            raise ValueError(
                f"Trace columns differ in length: arrival_s {n}, prompt_len {len(prompt)}, "
                f"output_len {len(output)}"
            )
        if n and (prompt.min() < 1 or output.min() < 1):
            raise ValueError("Trace prompt_len and output_len must all be >= 1")
        if n > 1 and bool(np.any(np.diff(arrival) < 0)):
            raise ValueError("Trace arrival_s must be sorted ascending")
        if not self.has_timestamps and bool(np.any(arrival != 0.0)):
            raise ValueError("a Trace without timestamps must have all arrival_s == 0")
        if self.block_hashes is not None:
            if len(self.block_hashes) != n:
                raise ValueError(f"Trace block_hashes has {len(self.block_hashes)} rows, not {n}")
            if self.block_hash_size is None or self.block_hash_size < 1:
                raise ValueError("Trace block_hash_size must be >= 1 when block_hashes is given")
        if self.context_hashes is not None:
            if self.block_hashes is None:
                raise ValueError("Trace context_hashes needs block_hashes")
            if len(self.context_hashes) != n:
                raise ValueError(f"Trace context_hashes has {len(self.context_hashes)} rows, not {n}")
        if self.session is not None:
            object.__setattr__(self, "session", _session_ids(self.session, n))
        object.__setattr__(self, "arrival_s", arrival)
        object.__setattr__(self, "prompt_len", prompt)
        object.__setattr__(self, "output_len", output)
        object.__setattr__(self, "_num_rows", n)

    @classmethod
    def from_requests(
        cls,
        requests: Iterable[Request],
        *,
        name: str = "requests",
        source: str = "<memory>",
        has_timestamps: bool = True,
        block_hash_size: int | None = None,
    ) -> Trace:
        """Build a trace from request objects, e.g. a handful written out in a test.

        The rows keep the given order (which must already be by arrival); the
        requests' own ``request_id`` values are not kept, ids are row indices.
        Block hashes are kept only if every request has them, with
        ``block_hash_size`` defaulting to Mooncake's 512 tokens.
        """
        rows = list(requests)
        hashes = [r.block_hashes for r in rows]
        has_hashes = bool(rows) and all(h is not None for h in hashes)
        return cls(
            name=name,
            source=source,
            arrival_s=np.array([r.arrival_time for r in rows], dtype=np.float64),
            prompt_len=np.array([r.prompt_len for r in rows], dtype=np.int64),
            output_len=np.array([r.output_len for r in rows], dtype=np.int64),
            block_hashes=[tuple(h) for h in hashes if h is not None] if has_hashes else None,
            block_hash_size=(block_hash_size or 512) if has_hashes else None,
            has_timestamps=has_timestamps,
        )

    def __len__(self) -> int:
        return self._num_rows

    def requests(self) -> Iterator[Request]:
        """Yield the rows as :class:`Request` objects, ``request_id`` = row index."""
        hashes = self.block_hashes if self.block_hashes is not None else [None] * len(self)
        # tolist() once per column: element access on numpy arrays is ~10x slower.
        columns = (self.arrival_s.tolist(), self.prompt_len.tolist(), self.output_len.tolist())
        rows = zip(*columns, hashes, strict=True)
        for request_id, (arrival, prompt, output, block_hashes) in enumerate(rows):
            yield Request(request_id, arrival, prompt, output, block_hashes)

    def to_frame(self) -> pd.DataFrame:
        """The trace as a DataFrame indexed by ``request_id``, in the plain CSV's column names."""
        import pandas as pd

        columns: dict[str, object] = {
            "arrival_time_s": self.arrival_s,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
        }
        if self.block_hashes is not None:
            columns["block_hashes"] = list(self.block_hashes)
        if self.session is not None:
            columns["session_id"] = self.session
        frame = pd.DataFrame(columns)
        frame.index.name = "request_id"
        return frame

    @property
    def duration_s(self) -> float:
        """Seconds from the first arrival to the last (0.0 without timestamps)."""
        if self._num_rows == 0:
            return 0.0
        return float(self.arrival_s[-1] - self.arrival_s[0])

    def __repr__(self) -> str:
        return (
            f"Trace(name={self.name!r}, num_requests={len(self)}, "
            f"duration_s={self.duration_s:.1f}, has_timestamps={self.has_timestamps}, "
            f"block_hashes={'yes' if self.block_hashes is not None else 'no'})"
        )
