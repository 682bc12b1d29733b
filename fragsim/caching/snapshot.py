"""Read a PyTorch memory snapshot and say where its reserved bytes went.

Two file shapes are accepted, both pickles:

- what ``torch.cuda.memory._dump_snapshot()`` writes: a dict with ``segments``,
  ``device_traces`` and, in newer versions, more keys;
- a plain list of segment dicts, as ``torch.cuda.memory_snapshot()`` returns
  (and :meth:`fragsim.caching.model.CachingAllocatorModel.snapshot` produces).

A segment is one cudaMalloc (or one mapped range of an expandable segment)::

    segment  address ........................................ address + total_size
             +--------------+------+------------+---------+-----------------+
    blocks   | active_alloc | inac | active_all | pending | inactive        |
             +--------------+------+------------+---------+-----------------+
                 size >= requested_size: the gap is internal fragmentation;
                 inactive blocks are external fragmentation (cached, unused).

Block states: ``active_allocated`` (a live tensor), ``active_pending_free`` (the
C++ binding's name) or ``active_awaiting_free`` (the Python docs' name) for a
block freed but still in use by another stream, and ``inactive``. Older versions
lack ``requested_size`` and block ``address``; missing requested sizes count as
the block size (no internal fragmentation), and addresses follow from the
segment's address and the block order.

SECURITY: unpickling runs code named by the file. :func:`load_snapshot` uses an
unpickler that refuses to look up any global except plain builtin containers and
scalars (dict, list, tuple, set, frozenset, str, bytes, int, float, bool,
complex), so a hostile file fails with an error instead of running anything.
Snapshots hold only those types.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from fragsim.errors import FragsimError
from fragsim.files import write_atomically

MiB = 1 << 20
ALLOCATED = "active_allocated"
PENDING = ("active_pending_free", "active_awaiting_free")
INACTIVE = "inactive"
STATES = (ALLOCATED, *PENDING, INACTIVE)
# Free-block size classes for the hole histogram; the seed speaks of "hundreds of
# 1-50 MB holes".
HOLE_BUCKETS = ((0, "<1MiB"), (1 * MiB, "1-10MiB"), (10 * MiB, "10-50MiB"),
                (50 * MiB, "50-100MiB"), (100 * MiB, ">=100MiB"))
_SAFE_GLOBALS = frozenset({"dict", "list", "tuple", "set", "frozenset", "str", "bytes",
                           "int", "float", "bool", "complex"})


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle names a global other than a builtin container or scalar."""


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise RefusedGlobal(f"refusing to load global {module}.{name}")


def safe_unpickle(stream: IO[bytes]) -> Any:
    """``pickle.load`` that can build only builtin containers and scalars."""
    return _RestrictedUnpickler(stream).load()


def load_snapshot(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a snapshot file into ``{"segments": [...], "device_traces": [...]}``;
    the segment list is validated by :func:`analyze`."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise FragsimError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        obj = safe_unpickle(io.BytesIO(data))
    except RefusedGlobal as exc:
        raise FragsimError(f"{path}: not a memory snapshot pickle ({exc})") from None
    except Exception as exc:  # truncated or not a pickle at all: many exception types
        raise FragsimError(f"{path}: not a pickle file ({type(exc).__name__}: {exc})") from None
    if isinstance(obj, list):
        return {"segments": obj, "device_traces": []}
    if isinstance(obj, dict) and "segments" in obj:
        if not isinstance(obj["segments"], list):
            raise FragsimError(f"{path}: 'segments' must be a list, got {type(obj['segments']).__name__}")
        return obj
    found = sorted(map(str, obj))[:5] if isinstance(obj, dict) else type(obj).__name__
    raise FragsimError(
        f"{path}: not a memory snapshot: expected a dict with 'segments' or a list of "
        f"segments, got {found}"
    )


@dataclass(frozen=True)
class SegmentSummary:
    index: int
    address: int
    device: int
    segment_type: str
    is_expandable: bool
    total_size: int
    allocated_bytes: int
    requested_bytes: int
    pending_free_bytes: int
    inactive_bytes: int
    largest_free_bytes: int
    num_blocks: int
    #: (offset in segment, size, state) per block, for the segment map
    blocks: tuple[tuple[int, int, str], ...] = field(repr=False)

    @property
    def releasable(self) -> bool:
        """One inactive block covering a plain segment: empty_cache() frees it."""
        return not self.is_expandable and self.num_blocks == 1 and self.inactive_bytes == self.total_size


@dataclass(frozen=True)
class SnapshotSummary:
    """Totals over the selected segments, in bytes.

    internal = allocated − requested (rounding to 512 B, unsplit remainders);
    external = inactive bytes inside segments (cached, unused);
    fragmentation_ratio = 1 − largest free block / external: the seed's formula
    over the free memory a snapshot knows about (it cannot see the device memory
    outside the reserved segments).
    """

    reserved_bytes: int
    allocated_bytes: int
    requested_bytes: int
    internal_bytes: int
    pending_free_bytes: int
    external_bytes: int
    inactive_split_bytes: int
    releasable_bytes: int
    largest_free_bytes: int
    fragmentation_ratio: float
    small_pool_bytes: int
    large_pool_bytes: int
    num_segments: int
    num_blocks: int
    num_free_blocks: int
    free_blocks_by_size: dict[str, int]
    requested_known: bool
    num_oom_traces: int
    segments: tuple[SegmentSummary, ...] = field(repr=False)

    def to_dict(self, *, with_segments: bool = True) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "segments"}
        out["active_bytes"] = self.allocated_bytes + self.pending_free_bytes
        out["inactive_bytes"] = self.external_bytes
        out["reserved_fragmentation_ratio"] = self.fragmentation_ratio
        if with_segments:
            out["segments"] = [
                {k: v for k, v in asdict(s).items() if k != "blocks"} for s in self.segments
            ]
        return out


def _get_int(obj: Mapping[str, Any], key: str, where: str, *, default: int | None = None) -> int:
    if key not in obj:
        if default is not None:
            return default
        raise FragsimError(f"{where}: missing key {key!r}")
    value = obj[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise FragsimError(f"{where}: key {key!r} must be an integer >= 0, got {value!r}")
    return value


def _requested(block: Mapping[str, Any], where: str) -> int | None:
    if "requested_size" in block:
        return _get_int(block, "requested_size", where)
    history = block.get("history")  # torch 1.13/2.0: the allocation's real_size
    if isinstance(history, list) and history and isinstance(history[-1], dict):
        real = history[-1].get("real_size")
        if isinstance(real, int) and not isinstance(real, bool) and real >= 0:
            return real
    return None


def _segment(index: int, seg: Any, source: str) -> tuple[SegmentSummary, bool]:
    where = f"{source}segment {index}"
    if not isinstance(seg, Mapping):
        raise FragsimError(f"{where}: expected a dict, got {type(seg).__name__}")
    total = _get_int(seg, "total_size", where)
    address = _get_int(seg, "address", where, default=0)
    device = _get_int(seg, "device", where, default=0)
    seg_type = seg.get("segment_type", "large" if total > 2 * MiB else "small")
    if seg_type not in ("small", "large"):
        raise FragsimError(f"{where}: key 'segment_type' must be 'small' or 'large', got {seg_type!r}")
    blocks = seg.get("blocks")
    if not isinstance(blocks, list):
        raise FragsimError(f"{where}: key 'blocks' must be a list, got {type(blocks).__name__}")
    allocated = requested = pending = inactive = largest = offset = 0
    requested_known = True
    layout = []
    for j, block in enumerate(blocks):
        bwhere = f"{where} block {j}"
        if not isinstance(block, Mapping):
            raise FragsimError(f"{bwhere}: expected a dict, got {type(block).__name__}")
        size = _get_int(block, "size", bwhere)
        state = block.get("state")
        if state not in STATES:
            raise FragsimError(f"{bwhere}: key 'state' must be one of {', '.join(STATES)}; got {state!r}")
        if "address" in block:
            baddr = _get_int(block, "address", bwhere)
            if "address" in seg and baddr != address + offset:
                raise FragsimError(
                    f"{bwhere}: address {baddr:#x} is not where the previous blocks end "
                    f"({address + offset:#x})"
                )
        if state == ALLOCATED:
            allocated += size
            req = _requested(block, bwhere)
            if req is None:
                requested_known, req = False, size
            if req > size:
                raise FragsimError(f"{bwhere}: requested_size {req} exceeds size {size}")
            requested += req
        elif state == INACTIVE:
            inactive += size
            largest = max(largest, size)
        else:
            pending += size
        layout.append((offset, size, state))
        offset += size
    if offset != total:
        raise FragsimError(f"{where}: blocks sum to {offset} bytes but 'total_size' is {total}")
    summary = SegmentSummary(
        index, address, device, seg_type, bool(seg.get("is_expandable", False)), total,
        allocated, requested, pending, inactive, largest, len(blocks), tuple(layout),
    )
    return summary, requested_known


def analyze(
    snapshot: Mapping[str, Any] | list[Any],
    *,
    device: int | None = None,
    source: str = "",
) -> SnapshotSummary:
    """Totals, fragmentation and a per-segment table; ``device`` keeps one device's
    segments. ``source`` (e.g. ``"FILE: "``) prefixes error messages."""
    segments = snapshot["segments"] if isinstance(snapshot, Mapping) else snapshot
    if not isinstance(segments, list):
        raise FragsimError(f"{source}'segments' must be a list, got {type(segments).__name__}")
    parsed = [_segment(i, s, source) for i, s in enumerate(segments)]
    if device is not None:
        parsed = [(s, k) for s, k in parsed if s.device == device]
    segs = tuple(s for s, _ in parsed)
    holes = dict.fromkeys((name for _, name in HOLE_BUCKETS), 0)
    num_free = 0
    for s in segs:
        for _, size, state in s.blocks:
            if state == INACTIVE:
                num_free += 1
                holes[next(name for low, name in reversed(HOLE_BUCKETS) if size >= low)] += 1
    external = sum(s.inactive_bytes for s in segs)
    releasable = sum(s.total_size for s in segs if s.releasable)
    largest = max((s.largest_free_bytes for s in segs), default=0)
    allocated = sum(s.allocated_bytes for s in segs)
    requested = sum(s.requested_bytes for s in segs)
    traces = snapshot.get("device_traces", []) if isinstance(snapshot, Mapping) else []
    ooms = sum(
        1 for dev in traces if isinstance(dev, list)
        for t in dev if isinstance(t, Mapping) and t.get("action") == "oom"
    ) if isinstance(traces, list) else 0
    return SnapshotSummary(
        reserved_bytes=sum(s.total_size for s in segs),
        allocated_bytes=allocated,
        requested_bytes=requested,
        internal_bytes=allocated - requested,
        pending_free_bytes=sum(s.pending_free_bytes for s in segs),
        external_bytes=external,
        inactive_split_bytes=sum(s.inactive_bytes for s in segs if not s.releasable and not s.is_expandable),
        releasable_bytes=releasable,
        largest_free_bytes=largest,
        fragmentation_ratio=1 - largest / external if external else 0.0,
        small_pool_bytes=sum(s.total_size for s in segs if s.segment_type == "small"),
        large_pool_bytes=sum(s.total_size for s in segs if s.segment_type == "large"),
        num_segments=len(segs),
        num_blocks=sum(s.num_blocks for s in segs),
        num_free_blocks=num_free,
        free_blocks_by_size=holes,
        requested_known=all(k for _, k in parsed),
        num_oom_traces=ooms,
        segments=segs,
    )


STATE_COLOURS = {ALLOCATED: "tab:blue", "active_pending_free": "tab:orange",
                 "active_awaiting_free": "tab:orange", INACTIVE: "#d9d9d9"}
MAX_PLOTTED_SEGMENTS = 200  # beyond this the bars are thinner than a pixel


def plot_segment_map(summary: SnapshotSummary, path: str | os.PathLike[str], title: str = "") -> None:
    """PNG of the segments as horizontal bars (x: MiB from the segment start), blocks
    coloured by state. With many segments, those with the most free bytes are shown
    (then the largest): that is where fragmentation lives."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
    from matplotlib.patches import Patch

    segs = sorted(summary.segments, key=lambda s: (-s.inactive_bytes, -s.total_size, s.address))
    segs = sorted(segs[:MAX_PLOTTED_SEGMENTS], key=lambda s: s.address)
    height = min(24.0, 1.5 + 0.16 * max(1, len(segs)))
    fig = Figure(figsize=(12, height), layout="constrained")
    ax = fig.add_subplot()
    for row, s in enumerate(segs):
        for state in STATES:
            bars = [(off / MiB, size / MiB) for off, size, st in s.blocks if st == state]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=STATE_COLOURS[state],
                               edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(segs)), [f"{s.address:#x} {s.segment_type[0]}" for s in segs],
                  fontsize=6 if len(segs) > 40 else 8)
    ax.invert_yaxis()
    ax.set_xlabel("MiB from segment start")
    shown = "" if len(segs) == summary.num_segments else f" ({len(segs)} with the most free bytes shown)"
    ax.set_title(
        (title + "\n" if title else "")
        + f"{summary.num_segments} segments{shown}, reserved {summary.reserved_bytes / MiB:,.1f} MiB\n"
        f"free {summary.external_bytes / MiB:,.1f} MiB in {summary.num_free_blocks} blocks, "
        f"largest {summary.largest_free_bytes / MiB:,.1f} MiB, "
        f"fragmentation {summary.fragmentation_ratio:.1%}"
    )
    ax.legend(handles=[Patch(color=STATE_COLOURS[s], label=s) for s in (ALLOCATED, PENDING[0], INACTIVE)],
              loc="lower right", fontsize=8)
    write_atomically(path, lambda out: fig.savefig(out, format="png", dpi=110))
