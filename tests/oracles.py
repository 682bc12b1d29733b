"""Slow references the tests hold the simulator against.

Each rebuilds a split from scratch, position by position, from what the allocator or
the manager holds, so a drifted running sum shows. They are registered as engine
checks (``engine.checks``), which run wherever ``check=True`` runs, stretches included.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fragsim.engine_views import memory_split


def dense_split_by_slot(engine: Any) -> None:
    """The dense split, slot by slot from the block tables of a forking paged allocator:
    a stored slot is a token state; a held slot not stored, at a position below the
    largest final length of its holders, is reservation; otherwise internal."""
    kv = engine.kv
    alloc, B, cap = kv.alloc, kv.block_size, kv.capacity
    b, g = engine.batch, engine.g
    holders: list[tuple[int, int, int]] = []  # (seq, positions stored, final)
    for row in range(b.n):
        holders.append((int(b.seq[row]), int(b.offset[row]) + g, int(b.final[row])))
    for p in engine.prefilling:
        final = int(engine.requests.final[p.req])
        assert p.seqs[0] == p.req and len(p.seqs) == engine.width
        for i, seq in enumerate(p.seqs):
            holders.append((seq, p.done if i == 0 else 0, final))
    assert sorted(s for s, _, _ in holders) == sorted(alloc.seq_ids()), "sequences drifted"
    position = np.full(cap, -1, dtype=np.int64)
    held = np.zeros(cap, dtype=bool)
    stored = np.zeros(cap, dtype=bool)
    top_final = np.zeros(cap, dtype=np.int64)
    within = np.arange(B, dtype=np.int64)
    for seq, filled, final in holders:
        ids = np.asarray(alloc.placement(seq).block_ids, dtype=np.int64)
        slots = (ids[:, None] * B + within[None, :]).ravel()
        pos = np.arange(len(slots), dtype=np.int64)
        seen = position[slots]
        assert bool(np.all((seen < 0) | (seen == pos))), f"seq {seq} shares a block at another position"
        position[slots] = pos
        held[slots] = True
        stored[slots[:filled]] = True
        np.maximum.at(top_final, slots, final)
    token = int(stored.sum())
    slot_internal = int((held & ~stored & (position >= top_final)).sum())
    physical = int(held.sum())
    want = (token, physical - token - slot_internal, slot_internal, cap - physical)
    assert memory_split(engine) == want, f"split {memory_split(engine)} but slot by slot {want}"
