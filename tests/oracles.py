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


def hybrid_split_by_position(m: Any, seqs: np.ndarray, computed: np.ndarray,
                             receiving: Any = ()) -> np.ndarray:
    """A hybrid manager's split from each sequence's own blocks, position by position:
    per group, ``[lo·B, hi·B)`` against the window start, the computed length and the
    final length. With shared blocks (prefix caching) it is worked out per block from
    the block tables: a position stored if any holder stored it, out of the window if
    it is out of every storing holder's window, reserved if below some holder's final
    length. A sequence in ``receiving`` was placed ahead of KV still arriving, so its
    first block may lie past its window start."""
    from fragsim.hybrid.groups import (
        CATEGORIES,
        FREE,
        INTERNAL,
        OUT_OF_WINDOW,
        PADDING,
        RESERVATION,
        TOKEN,
    )

    assert sorted(int(s) for s in seqs) == sorted(m.seq_ids()), "live sequences differ"
    out = np.zeros((len(m.rows) + 1, len(CATEGORIES)), dtype=np.int64)
    pool = m.pool
    for i, row in enumerate(m.rows):
        b, tb = row.block_tokens, row.token_bytes
        holders: dict[int, list[tuple[int, int, int, int]]] = {}   # block -> (pos, f, start, final)
        for seq, f in zip(seqs.tolist(), computed.tolist(), strict=True):
            final = m._final(seq)
            assert 0 <= f <= final, (seq, f, final)
            lo = m.first_block(seq, i)
            hi = lo + m.blocks_held(seq)[i]
            if pool.keeps_ids:
                assert len(pool.block_ids(seq, i)) == hi - lo, (seq, row.label)
            if row.is_state:
                out[i, TOKEN] += (hi - lo) * row.state_bytes
                out[i, PADDING] += (hi - lo) * row.padding_per_block
                continue
            assert f <= hi * b, (seq, row.label, f, hi)
            start = row.rule.skipped(f)
            if pool.shares_blocks:
                for t, block in enumerate(pool.block_ids(seq, i)):
                    holders.setdefault(block, []).append(((lo + t) * b, f, start, final))
                continue
            assert lo * b <= start or lo == 0 or seq in receiving, (seq, row.label, lo, start)
            positions = np.arange(lo * b, hi * b)
            out[i, PADDING] += (hi - lo) * row.padding_per_block
            out[i, OUT_OF_WINDOW] += int(((positions < start) & (positions < f)).sum()) * tb
            out[i, TOKEN] += int(((positions >= start) & (positions < f)).sum()) * tb
            out[i, RESERVATION] += int(((positions >= f) & (positions < final)).sum()) * tb
            out[i, INTERNAL] += int((positions >= max(final, f)).sum()) * tb
        for block, hs in holders.items():
            assert pool.ref_count(block) == len(hs), (row.label, block, pool.ref_count(block), len(hs))
            assert len({p for p, _, _, _ in hs}) == 1, f"block {block} held at two positions"
            pos = np.arange(hs[0][0], hs[0][0] + b)
            stored = np.zeros(b, dtype=bool)
            read = np.zeros(b, dtype=bool)
            wanted = np.zeros(b, dtype=bool)
            for _, f, start, final in hs:
                mine = pos < f
                stored |= mine
                read |= mine & (pos >= start)
                wanted |= pos < final
            out[i, TOKEN] += int(read.sum()) * tb
            out[i, OUT_OF_WINDOW] += int((stored & ~read).sum()) * tb
            out[i, RESERVATION] += int((~stored & wanted).sum()) * tb
            out[i, INTERNAL] += int((~stored & ~wanted).sum()) * tb
            out[i, PADDING] += row.padding_per_block
    out[:, FREE] = pool.free_bytes()
    out[-1, PADDING] = pool.fixed_padding()
    return out


def hybrid_split_by_position_check(engine: Any) -> None:
    """:func:`hybrid_split_by_position` against the manager's split, as an engine check."""
    m = engine.kv.manager
    seqs, computed, receiving = engine.seqs(), engine.computed(), engine.receiving()
    fast = m.split(seqs, computed, receiving)
    slow = hybrid_split_by_position(m, seqs, computed, set(receiving[0].tolist()) if receiving is not None else ())
    assert (fast == slow).all(), f"split drifted:\n{fast}\n!=\n{slow}"


def held_by_position_check(engine: Any) -> None:
    """The split's part held for a connector (sequences kept past their requests) against
    the block tables, as an engine check: per block, the positions any holder reads less
    those a holder still running reads."""
    m = engine.kv.manager
    if not engine.held or not m.pool.keeps_ids:
        return
    length = dict(zip(engine.seqs().tolist(), engine.computed().tolist(), strict=True))
    length.update(engine.held)
    expect = 0
    for i, row in enumerate(m.rows):
        b = row.block_tokens
        read_all: dict[int, np.ndarray] = {}
        read_running: dict[int, np.ndarray] = {}
        for seq, f in length.items():
            lo, start = m.first_block(seq, i), row.rule.skipped(f)
            for t, block in enumerate(m.pool.block_ids(seq, i)):
                pos = np.arange((lo + t) * b, (lo + t + 1) * b)
                reads = (pos >= start) & (pos < f)
                read_all[block] = read_all.get(block, np.zeros(b, dtype=bool)) | reads
                if seq not in engine.held:
                    read_running[block] = read_running.get(block, np.zeros(b, dtype=bool)) | reads
        expect += sum(int(r.sum()) - int(read_running.get(block, r & False).sum())
                      for block, r in read_all.items()) * row.token_bytes
    got = engine.kv.held_units(engine.held, engine)[1]
    assert got == expect, f"held for a connector: {got} bytes, by position {expect}"
