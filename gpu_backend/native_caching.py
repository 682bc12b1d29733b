"""Replay an allocation sequence through PyTorch's own CUDA caching allocator and
compare it, block by block, with :class:`fragsim.caching.model.CachingAllocatorModel`.

An op sequence is a list of ``("malloc", key, size)`` and ``("free", key)``; a
malloc is ``torch.empty(size, dtype=torch.uint8)``, a free drops the tensor. Keys
are any hashable; a ``None`` key is an allocation the caller expects to fail.

The device side is made to match the model's assumptions:

- ``torch.cuda.empty_cache()`` first; the allocator must then hold nothing;
- ``torch.cuda.set_per_process_memory_fraction`` caps what the allocator may
  cudaMalloc at ``device_bytes``, so OOMs come from the same arithmetic in both
  (the model is given the cap exactly as PyTorch computes it,
  ``int(fraction × total_memory)``);
- ``max_split_size_mb`` and ``expandable_segments`` through
  ``torch.cuda.memory._set_allocator_settings``.

What is compared at each checkpoint, independently of addresses (cudaMalloc's
addresses are not the model's):

    reserved / allocated bytes       memory_stats() vs the model's counters
    segments                         multiset of (pool, size, expandable)
    free blocks                      multiset of (pool, size)
    live tensors                     each one's (pool, segment size, offset in its
                                     segment, block size)
    co-location                      which live tensors share a segment
    OOMs                             the op indices that raised

Best-fit ties between equal-sized free blocks are broken by address, so the model
replays with the device's addresses: each malloc that took a new segment (the
device's ``num_device_alloc`` rose) gives that segment's address, the tensor's, and
the model's segments take them in the same order. Known, expected sources of
difference: a CUDA context or another library's allocations outside PyTorch's
allocator take memory the fraction does not see.

Needs a CUDA device to replay; the comparison functions run anywhere.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fragsim.caching.model import CachingAllocatorModel

Op = tuple[Any, ...]


def _normalize(ops: Iterable[Sequence[Any]]) -> list[Op]:
    """Validate ops; give every ``None`` malloc key a unique one."""
    out: list[Op] = []
    for i, op in enumerate(ops):
        if not op or op[0] not in ("malloc", "free"):
            raise ValueError(f"op {i}: expected ('malloc', key, size) or ('free', key), got {op!r}")
        if op[0] == "malloc":
            if len(op) != 3 or not isinstance(op[2], int) or op[2] < 1:
                raise ValueError(f"op {i}: malloc needs a size >= 1, got {op!r}")
            key = ("anonymous", i) if op[1] is None else _hashable(op[1])
            out.append(("malloc", key, op[2]))
        else:
            if len(op) != 2:
                raise ValueError(f"op {i}: free takes one key, got {op!r}")
            out.append(("free", _hashable(op[1])))
    return out


def _hashable(key: Any) -> Hashable:
    return tuple(key) if isinstance(key, list) else key  # JSON turns tuples into lists


def _checkpoints(num_ops: int, check_every: int | None) -> set[int]:
    """Op indices after which both sides are compared; always the last op."""
    points = {num_ops - 1} if num_ops else set()
    if check_every:
        points |= set(range(check_every - 1, num_ops, check_every))
    return points


def _state(segments: list[dict[str, Any]], reserved: int, allocated: int, ptrs: Mapping[Hashable, int]) -> dict[str, Any]:
    return {"segments": segments, "reserved_bytes": reserved, "allocated_bytes": allocated, "ptrs": dict(ptrs)}


def replay_model(
    ops: Iterable[Sequence[Any]],
    device_bytes: int,
    *,
    max_split_size_mb: int | None = None,
    expandable_segments: bool = False,
    check_every: int | None = None,
    segment_addresses: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Run ``ops`` through the model: ``{"ooms": [op index, ...], "states": {op index: state}}``.
    ``segment_addresses``: a device's segment addresses in allocation order, which the
    model's segments then take (:class:`CachingAllocatorModel`)."""
    ops = _normalize(ops)
    model = CachingAllocatorModel(device_bytes, max_split_size_mb=max_split_size_mb,
                                  expandable_segments=expandable_segments,
                                  segment_addresses=segment_addresses)
    live: dict[Hashable, int] = {}
    ooms: list[int] = []
    states: dict[int, dict[str, Any]] = {}
    points = _checkpoints(len(ops), check_every)
    for i, op in enumerate(ops):
        if op[0] == "malloc":
            addr = model.malloc(op[2])
            if addr is None:
                ooms.append(i)
            else:
                live[op[1]] = addr
        elif op[1] in live:
            model.free(live.pop(op[1]))
        if i in points:
            states[i] = _state(model.snapshot(), model.reserved_bytes, model.allocated_bytes, live)
    return {"ooms": ooms, "states": states, "stats": model.stats()}


def _block_index(segments: list[dict[str, Any]]) -> dict[int, tuple[int, tuple[str, int, int, int]]]:
    """Block start address -> (segment number, (pool, segment size, offset, block size))."""
    index = {}
    for n, seg in enumerate(segments):
        base = seg.get("address", 0)
        offset = 0
        for block in seg["blocks"]:
            addr = block.get("address", base + offset)
            index[addr] = (n, (seg.get("segment_type", "?"), seg["total_size"], addr - base, block["size"]))
            offset += block["size"]
    return index


def compare_states(model: Mapping[str, Any], native: Mapping[str, Any], op_index: int | None = None) -> list[dict[str, Any]]:
    """Every address-independent difference between two allocator states (each as
    :func:`replay_model` / :func:`replay_native` record them); empty when equal."""
    diffs: list[dict[str, Any]] = []

    def differ(kind: str, m: Any, n: Any, **extra: Any) -> None:
        diffs.append({"op_index": op_index, "kind": kind, "model": m, "native": n, **extra})

    for key in ("reserved_bytes", "allocated_bytes"):
        if model[key] != native[key]:
            differ(key, model[key], native[key])

    def segs(state: Mapping[str, Any]) -> Counter[tuple[Any, ...]]:
        return Counter((s.get("segment_type"), s["total_size"], bool(s.get("is_expandable", False)))
                       for s in state["segments"])

    def holes(state: Mapping[str, Any]) -> Counter[tuple[Any, ...]]:
        return Counter((s.get("segment_type"), b["size"]) for s in state["segments"]
                       for b in s["blocks"] if b["state"] == "inactive")

    for kind, fn in (("segments", segs), ("free_blocks", holes)):
        m, n = fn(model), fn(native)
        if m != n:
            differ(kind, sorted((m - n).elements()), sorted((n - m).elements()),
                   note="entries only in the model / only on the device")

    m_ptrs, n_ptrs = model["ptrs"], native["ptrs"]
    if set(m_ptrs) != set(n_ptrs):
        differ("live_keys", sorted(map(repr, set(m_ptrs) - set(n_ptrs))),
               sorted(map(repr, set(n_ptrs) - set(m_ptrs))), note="keys live only in the model / only on the device")
    m_index, n_index = _block_index(model["segments"]), _block_index(native["segments"])
    m_groups: dict[int, set[Hashable]] = {}
    n_groups: dict[int, set[Hashable]] = {}
    for key in sorted(set(m_ptrs) & set(n_ptrs), key=repr):
        m_loc, n_loc = m_index.get(m_ptrs[key]), n_index.get(n_ptrs[key])
        if m_loc is None or n_loc is None:
            differ("block_missing", m_loc is not None, n_loc is not None, key=repr(key))
            continue
        m_groups.setdefault(m_loc[0], set()).add(key)
        n_groups.setdefault(n_loc[0], set()).add(key)
        if m_loc[1] != n_loc[1]:
            differ("placement", list(m_loc[1]), list(n_loc[1]), key=repr(key),
                   note="(pool, segment size, offset in segment, block size)")
    m_parts = {frozenset(g) for g in m_groups.values()}
    n_parts = {frozenset(g) for g in n_groups.values()}
    if m_parts != n_parts:
        differ("colocation", len(m_parts - n_parts), len(n_parts - m_parts),
               note="groups of live tensors sharing a segment, found only in the model / on the device")
    return diffs


def compare_replays(model_run: Mapping[str, Any], native_run: Mapping[str, Any]) -> list[dict[str, Any]]:
    """OOM points, then the states at every checkpoint both replays recorded."""
    diffs: list[dict[str, Any]] = []
    m_ooms, n_ooms = list(model_run["ooms"]), list(native_run["ooms"])
    if m_ooms != n_ooms:
        diffs.append({"op_index": min(set(m_ooms) ^ set(n_ooms)), "kind": "ooms",
                      "model": m_ooms, "native": n_ooms})
    for i in sorted(set(model_run["states"]) & set(native_run["states"])):
        diffs += compare_states(model_run["states"][i], native_run["states"][i], op_index=i)
    return diffs


def _set_allocator_settings(env: str) -> None:
    """PYTORCH_CUDA_ALLOC_CONF at run time (torch 2.13 moved it to the accelerator API)."""
    import torch

    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        setter(env)
    else:
        torch.cuda.memory._set_allocator_settings(env)


def _cap_allocator(device: str, device_bytes: int | None, settings: str) -> tuple[int, int]:
    """An empty allocator on ``device`` with ``settings``, capped at ``device_bytes``
    (default: 90% of the free memory) through the per-process memory fraction:
    (the device's index, the bytes the allocator may take as it computes them)."""
    import torch

    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    torch.cuda.set_device(index)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    _set_allocator_settings(settings)
    total = torch.cuda.get_device_properties(index).total_memory
    free_now, _ = torch.cuda.mem_get_info(index)
    if device_bytes is None:
        device_bytes = int(free_now * 0.9)
    if device_bytes > free_now:
        raise ValueError(f"device_bytes {device_bytes} exceeds the {free_now} bytes free on {device}")
    fraction = device_bytes / total
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return index, int(fraction * total)  # as the allocator computes allowed_memory_maximum


class _DeviceOps:
    """Ops on the device: the live tensors by key, and the address of every segment a
    malloc made the allocator take (its first block, the tensor, starts there), in
    the order taken: what the model's segments are given."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.tensors: dict[Hashable, Any] = {}
        self.addresses: collections.deque[int] = collections.deque()
        self._segments_taken = self.stats().get("num_device_alloc", 0)

    def stats(self) -> dict[str, Any]:
        """The allocator's counters (nested: cheaper than the flat ``memory_stats``)."""
        import torch

        return torch.cuda.memory.memory_stats_as_nested_dict(self.index)  # type: ignore[no-any-return]

    def malloc(self, key: Hashable, size: int) -> tuple[bool, dict[str, Any]]:
        """Whether ``size`` bytes could be had, and the counters after."""
        import torch

        try:
            self.tensors[key] = torch.empty(size, dtype=torch.uint8, device=self.index)
        except torch.cuda.OutOfMemoryError:
            return False, self.stats()
        stats = self.stats()
        if stats.get("num_device_alloc", 0) > self._segments_taken:
            self.addresses.append(self.tensors[key].data_ptr())
        self._segments_taken = stats.get("num_device_alloc", 0)
        return True, stats

    def free(self, key: Hashable) -> None:
        self.tensors.pop(key, None)


def replay_native(
    ops: Iterable[Sequence[Any]],
    device: str = "cuda",
    *,
    device_bytes: int | None = None,
    max_split_size_mb: int | None = None,
    expandable_segments: bool = False,
    check_every: int | None = None,
) -> dict[str, Any]:
    """Replay ``ops`` with real tensors, replay them through the model, and report
    every difference. ``device_bytes`` (default: 90% of the free memory) caps the
    allocator through the per-process memory fraction."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("replay_native needs a CUDA device; torch.cuda.is_available() is False")
    ops = _normalize(ops)
    settings = [f"expandable_segments:{expandable_segments}"]
    if max_split_size_mb is not None:
        settings.append(f"max_split_size_mb:{max_split_size_mb}")
    index, allowed = _cap_allocator(device, device_bytes, ",".join(settings))
    start = torch.cuda.memory_stats(index)
    report: dict[str, Any] = {
        "torch_version": torch.__version__,
        "device_name": torch.cuda.get_device_name(index),
        "device_bytes": allowed,
        "settings": ",".join(settings),
        "num_ops": len(ops),
        "differences": [],
    }
    if start.get("reserved_bytes.all.current", 0):
        report["differences"].append({
            "op_index": None, "kind": "not_empty_at_start", "model": 0,
            "native": start["reserved_bytes.all.current"],
            "note": "the allocator held memory before the replay; run in a fresh process",
        })
    points = _checkpoints(len(ops), check_every)
    on_device = _DeviceOps(index)
    ooms: list[int] = []
    states: dict[int, dict[str, Any]] = {}
    try:
        for i, op in enumerate(ops):
            if op[0] == "malloc":
                if not on_device.malloc(op[1], op[2])[0]:
                    ooms.append(i)
            else:
                on_device.free(op[1])
            if i in points:
                stats = torch.cuda.memory_stats(index)
                segments = [s for s in torch.cuda.memory_snapshot() if s.get("device", index) == index]
                states[i] = _state(segments, stats.get("reserved_bytes.all.current", 0),
                                   stats.get("allocated_bytes.all.current", 0),
                                   {k: t.data_ptr() for k, t in on_device.tensors.items()})
        final = torch.cuda.memory_stats(index)
    finally:
        on_device.tensors.clear()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    native = {"ooms": ooms, "states": states}
    model = replay_model(ops, allowed, max_split_size_mb=max_split_size_mb,
                         expandable_segments=expandable_segments, check_every=check_every,
                         segment_addresses=None if expandable_segments else list(on_device.addresses))
    report["differences"] += compare_replays(model, native)
    report["model_ooms"], report["native_ooms"] = model["ooms"], ooms
    report["native_num_ooms"] = final.get("num_ooms", 0) - start.get("num_ooms", 0)
    report["native_num_alloc_retries"] = final.get("num_alloc_retries", 0) - start.get("num_alloc_retries", 0)
    report["model_num_alloc_retries"] = model["stats"]["num_alloc_retries"]
    report["segment_addresses_mirrored"] = 0 if expandable_segments else len(on_device.addresses)
    report["checkpoints"] = [
        {"op_index": i, "model_reserved_bytes": model["states"][i]["reserved_bytes"],
         "native_reserved_bytes": states[i]["reserved_bytes"],
         "model_segments": len(model["states"][i]["segments"]), "native_segments": len(states[i]["segments"])}
        for i in sorted(states)
    ]
    report["ok"] = not report["differences"]
    return report


def first_difference(ops: Iterable[Sequence[Any]], device: str = "cuda", *, device_bytes: int | None = None,
                     context: int = 12) -> dict[str, Any]:
    """Replay ``ops`` on the device and through the model in lockstep (the model's
    segments at the device's addresses) and stop at the first op after which their
    allocated or reserved bytes differ: that op, the ``context`` ops before it, and
    both counters. Cheaper than snapshots at every op: two counters per op."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("first_difference needs a CUDA device; torch.cuda.is_available() is False")
    ops = _normalize(ops)
    index, allowed = _cap_allocator(device, device_bytes, "expandable_segments:False")
    on_device = _DeviceOps(index)

    def given() -> Any:   # the device's segment addresses, as they are taken
        while True:
            yield on_device.addresses.popleft() if on_device.addresses else None

    model = CachingAllocatorModel(allowed, segment_addresses=given())
    live: dict[Hashable, int] = {}
    report: dict[str, Any] = {"device_bytes": allowed, "num_ops": len(ops), "first_difference": None,
                              "ops_checked": 0}
    try:
        for i, op in enumerate(ops):
            if op[0] == "malloc":
                stats = on_device.malloc(op[1], op[2])[1]
                addr = model.malloc(op[2])
                if addr is not None:
                    live[op[1]] = addr
            else:
                on_device.free(op[1])
                stats = on_device.stats()
                if op[1] in live:
                    model.free(live.pop(op[1]))
            report["ops_checked"] = i + 1
            native = (stats["allocated_bytes"]["all"]["current"], stats["reserved_bytes"]["all"]["current"])
            if native != (model.allocated_bytes, model.reserved_bytes):
                report["first_difference"] = {
                    "op_index": i, "op": list(op), "ops_before": [list(o) for o in ops[max(0, i - context): i]],
                    "native_allocated_bytes": native[0], "model_allocated_bytes": model.allocated_bytes,
                    "native_reserved_bytes": native[1], "model_reserved_bytes": model.reserved_bytes}
                break
    finally:
        on_device.tensors.clear()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gpu_backend.native_caching --workload rag-longtail --hours 0.1 --out DIR``
    or ``--ops ops.json``; writes DIR/native_caching.json. Exit 0: no difference,
    1: differences, 2: no CUDA device."""
    p = argparse.ArgumentParser(prog="python -m gpu_backend.native_caching", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ops", metavar="FILE.json", help="list of [\"malloc\", key, size] / [\"free\", key]")
    src.add_argument("--workload", help="record the ops of a fragsim.caching workload preset")
    p.add_argument("--hours", type=float, default=0.1, help="simulated hours of --workload (default 0.1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--device-gb", type=float, help="GiB the allocator may take (default: the workload's)")
    p.add_argument("--max-split-size-mb", type=int)
    p.add_argument("--expandable-segments", action="store_true")
    p.add_argument("--check-every", type=int, default=10000, metavar="N", help="compare every N ops")
    p.add_argument("--out", default=".", metavar="DIR", help="folder for native_caching.json")
    p.add_argument("--first-difference", action="store_true",
                   help="replay in lockstep and stop at the first op where allocated or reserved "
                        "bytes differ (writes first_difference.json)")
    args = p.parse_args(argv)
    device_bytes = int(args.device_gb * (1 << 30)) if args.device_gb else None
    if args.ops:
        ops = json.loads(Path(args.ops).read_text())
    else:
        from fragsim.caching.workloads import run_workload

        result = run_workload(args.workload, hours=args.hours, seed=args.seed, record_ops=True,
                              max_split_size_mb=args.max_split_size_mb,
                              expandable_segments=args.expandable_segments)
        ops = result.ops
        device_bytes = device_bytes or result.workload.device_bytes
    import torch

    if not torch.cuda.is_available():
        print("native_caching: no CUDA device; nothing replayed", file=sys.stderr)
        return 2
    from fragsim.caching.snapshot import write_atomically

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.first_difference:
        if args.max_split_size_mb is not None or args.expandable_segments:
            p.error("--first-difference replays the default settings only")
        found = first_difference(ops, args.device, device_bytes=device_bytes)
        write_atomically(out / "first_difference.json",
                         lambda f: f.write(json.dumps(found, indent=1, default=str).encode()))
        where = found["first_difference"]
        print(f"first difference at op {where['op_index']}" if where else
              f"no difference in {found['ops_checked']} ops")
        return 0 if where is None else 1
    report = replay_native(ops, args.device, device_bytes=device_bytes, max_split_size_mb=args.max_split_size_mb,
                           expandable_segments=args.expandable_segments, check_every=args.check_every)
    write_atomically(out / "native_caching.json", lambda f: f.write(json.dumps(report, indent=1, default=str).encode()))
    print(f"{len(report['differences'])} difference(s); report in {out / 'native_caching.json'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
