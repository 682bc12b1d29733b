"""The contract of the hybrid KV managers, and where every byte of their pool goes.

A hybrid model's layers come in kinds (:mod:`fragsim.layers`): full attention and
MLA keep every token, sliding-window and chunked-local layers need only their
window, state layers (Mamba, linear attention) one fixed state per sequence. A
KV manager shares one pool among all of them; the managers differ in how they cut
it (:mod:`fragsim.hybrid.vllm_hybrid`, :mod:`~fragsim.hybrid.jenga`,
:mod:`~fragsim.hybrid.static_partition`, :mod:`~fragsim.hybrid.paged_uniform`).

Rows and blocks
---------------
A manager's memory is described by *rows*: one row is a set of layers that
allocate together (one of vLLM's KV cache groups, one of Jenga's layer types).
For each live sequence a row holds the blocks ``[lo, hi)`` of its token
positions, ``block_tokens`` positions a block (a state row: one block, its
state). With ``q`` tokens requested and ``f`` of them computed::

    hi = ceil(q / block_tokens)
    lo = 0                                   full attention, MLA, or no window freeing
         max(0, f − W + 1) // block_tokens   sliding window W: blocks wholly before
                                             the window are freed (vLLM's skipped blocks)
         (f // C · C) // block_tokens        chunked local attention, chunk C

Where the bytes go
------------------
Per row, with ``F`` the sequence's final length, and ``s(f)`` the first position the
next token reads (0; ``f − W + 1``; ``f // C · C``), the held positions
``[lo·B, hi·B)`` split into::

    out_of_window           [lo·B, s(f))     stored, held, never read again
    token_states            [max(s, lo·B), f) stored and read again
    reservation             [f, min(hi·B, F)) held, filled later
    internal_fragmentation  [max(F, lo·B), hi·B) the block tail it never fills

(each in tokens × the row's bytes per token; a state row's whole state is token
states), and each block adds ``padding``: the bytes of its page that hold none of
the row's real layers (vLLM's phantom layers and padded state pages, Jenga's
padding up to its page sizes). Free memory is per row where a row owns it (a
static partition, Jenga's partly used large pages) and in the ``pool`` row where
any row may take it; the pool row also holds padding no row owns (vLLM's null
block, the remainder of the memory that makes no whole block). At every instant::

    Σ over rows and categories == kv_pool_bytes                    (exact, always)

The manager keeps the sums that change only when blocks move (blocks held, the
``lo·B`` floor, the tails) incrementally; the engine supplies the computed
lengths, and only the out-of-window term is summed over sequences per step: as
no sequence's ``lo·B`` passes its ``s(f)``, it is ``Σ s(f) − Σ lo·B``, the window
starts less the kept floor.

The engine-facing interface is the :class:`~fragsim.allocators.Allocator`
protocol in token units (``allocate(seq, tokens)``, ``extend``, ``free``), so the
serving engine drives a hybrid manager as it drives a paged allocator; sizes it
reports (``capacity``, ``num_free``, ``rounded``) are bytes. ``num_owned(seq)`` is
the engine's growth threshold: the largest requested length that changes no
block, so a sequence meets the manager exactly when a block is taken or freed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fragsim.layers import STATE_KINDS

#: where every byte of the pool goes, in this order in every array
CATEGORIES = ("token_states", "reservation", "internal_fragmentation", "padding",
              "out_of_window", "free")
TOKEN, RESERVATION, INTERNAL, PADDING, OUT_OF_WINDOW, FREE = range(len(CATEGORIES))
#: the row label of memory no single row owns
POOL = "pool"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Row:
    """Layers that allocate together, and what one of their blocks costs."""

    kind: str                  # full, sliding, chunked, mla, mamba, linear
    label: str                 # "sliding 128 (group 2)", ...
    num_layers: int
    block_bytes: int           # one block's bytes in the pool, padding included
    block_tokens: int = 0      # attention: positions per block
    token_bytes: int = 0       # attention: KV bytes one position costs the row's real layers
    state_bytes: int = 0       # state: the real state bytes of one sequence
    window: int | None = None
    chunk: int | None = None
    frees_window: bool = True  # False: blocks out of the window stay held (paged-uniform)

    def __post_init__(self) -> None:
        real = self.state_bytes if self.is_state else self.block_tokens * self.token_bytes
        if self.block_bytes < real or (not self.is_state and self.block_tokens < 1):
            raise ValueError(f"row {self.label!r}: a block of {self.block_bytes} bytes cannot hold "
                             f"{real} bytes of real KV or state")

    @property
    def is_state(self) -> bool:
        return self.kind in STATE_KINDS

    @property
    def windowed(self) -> bool:
        return self.kind in ("sliding", "chunked")

    @property
    def padding_per_block(self) -> int:
        real = self.state_bytes if self.is_state else self.block_tokens * self.token_bytes
        return self.block_bytes - real

    def lo_blocks(self, computed: int) -> int:
        """Leading blocks freed once ``computed`` tokens are computed."""
        if not self.frees_window or computed <= 0:
            return 0
        if self.kind == "sliding":
            assert self.window is not None
            return max(0, computed - self.window + 1) // self.block_tokens
        if self.kind == "chunked":
            assert self.chunk is not None
            return (computed // self.chunk * self.chunk) // self.block_tokens
        return 0

    def next_free_at(self, lo: int) -> int | None:
        """The computed length at which block ``lo`` falls out of the window (None: never)."""
        if not self.frees_window:
            return None
        if self.kind == "sliding":
            assert self.window is not None
            return (lo + 1) * self.block_tokens + self.window - 1
        if self.kind == "chunked":
            assert self.chunk is not None
            return cdiv((lo + 1) * self.block_tokens, self.chunk) * self.chunk
        return None

    def next_free_at_many(self, lo: np.ndarray) -> np.ndarray | None:
        """:meth:`next_free_at` for many sequences (None: never)."""
        if not self.frees_window or not self.windowed:
            return None
        b = self.block_tokens
        if self.kind == "sliding":
            assert self.window is not None
            return (lo + 1) * b + self.window - 1
        assert self.chunk is not None
        return -(-((lo + 1) * b) // self.chunk) * self.chunk

    def window_start(self, computed: np.ndarray) -> np.ndarray:
        """First position the next token reads, per sequence (0 without a window)."""
        if self.kind == "sliding":
            assert self.window is not None
            return np.maximum(0, computed - self.window + 1)
        if self.kind == "chunked":
            assert self.chunk is not None
            return computed // self.chunk * self.chunk
        return np.zeros_like(computed)


class HybridManager:
    """Blocks per row per sequence, and the byte split; subclasses own the pool.

    A subclass sets ``rows``, ``capacity`` (pool bytes) and implements
    ``_place(seq, frees, takes)`` (free each row's leading ``frees[r]`` blocks, take
    ``takes[r]`` more, all or nothing), ``_release(seq)``, ``_free_bytes()`` (free
    bytes per row, then the pool's), ``_fixed_padding()``, ``_can_take(takes)``,
    ``_fits_empty(takes)``, ``_block_ids(seq, row)`` and ``_check_pool()``.
    """

    reserve = "demand"
    grows_on_demand = True
    #: whether block ids are kept (placement(), address maps); a subclass may keep counts only
    tracks_ids = True
    #: a counts-only pool's free blocks (:meth:`_count_one_pool`)
    _free_count: int

    def __init__(self, *, name: str, placement: str, rows: tuple[Row, ...], capacity: int,
                 max_seq_len: int) -> None:
        if not rows:
            raise ValueError("a hybrid KV manager needs at least one row of layers")
        self.name = name
        self.placement_name = placement
        self.rows = rows
        self.capacity = int(capacity)
        self.max_seq_len = max_seq_len
        attention = [r.block_tokens for r in rows if not r.is_state]
        #: positions per block of the attention rows (the engine's growth unit)
        self.block_size = min(attention) if attention else max_seq_len
        self._finals: np.ndarray | None = None
        self._live: dict[int, None] = {}
        self._q = np.zeros(0, dtype=np.int64)
        self._lo = np.zeros((len(rows), 0), dtype=np.int64)
        self._hi = np.zeros((len(rows), 0), dtype=np.int64)
        self.held_blocks = [0] * len(rows)             # Σ (hi − lo) over live sequences
        self._floor = [0] * len(rows)                  # Σ lo · B
        self._tail = [0] * len(rows)                   # Σ internal-fragmentation positions
        # Row parameters as columns, so that blocks of all rows move in one numpy call.
        self._attn = np.array([not r.is_state for r in rows])[:, None]
        self._bt = np.array([r.block_tokens or 1 for r in rows], dtype=np.int64)[:, None]
        self._sliding = np.array([r.kind == "sliding" and r.frees_window for r in rows])[:, None]
        self._chunked = np.array([r.kind == "chunked" and r.frees_window for r in rows])[:, None]
        self._win = np.array([r.window or 1 for r in rows], dtype=np.int64)[:, None]
        self._chunk = np.array([r.chunk or 1 for r in rows], dtype=np.int64)[:, None]
        self._frees_any = bool(self._sliding.any() or self._chunked.any())
        # Rows of one shape (kind, window, chunk, block) hold the same blocks of every
        # sequence (vLLM's groups of one kind): per-position sums are computed once a shape.
        # Attention rows that free nothing (paged-uniform's) hold the same blocks whatever
        # their kind or window: one shape of a block size (their window starts differ, and
        # the split works them out per window: _split_groups).
        shapes: dict[tuple, int] = {}
        self._shape = [shapes.setdefault((False, "keeps all", r.block_tokens) if not r.is_state and not r.frees_window
                                         else (r.is_state, r.kind, r.block_tokens, r.window, r.chunk, r.frees_window),
                                         len(shapes)) for r in rows]
        # Each row's parameters as plain ints, for the per-sequence paths (numpy scalars
        # cost more than the arithmetic): (is_state, block, frees: 0 none, 1 sliding,
        # 2 chunked, window, chunk).
        self._rinfo = [(r.is_state, r.block_tokens, (1 if r.kind == "sliding" else 2 if r.kind == "chunked"
                                                     else 0) if r.frees_window else 0,
                        r.window or 1, r.chunk or 1) for r in rows]
        # Per attention shape: a row holding it, its rows, block, frees code, window, chunk.
        self._attn_shapes: list[tuple[int, list[int], int, int, int, int]] = []
        for shape in range(len(shapes)):
            members = [i for i, s in enumerate(self._shape) if s == shape]
            state, b, code, w, c = self._rinfo[members[0]]
            if not state:
                self._attn_shapes.append((members[0], members, b, code, w, c))
        # Per row, what the split needs: (is_state, block, token bytes, padding a block,
        # state bytes, window start: 0 none, 1 sliding, 2 chunked, window, chunk, shape).
        self._split_info = [(r.is_state, r.block_tokens, r.token_bytes, r.padding_per_block, r.state_bytes,
                             (1 if r.kind == "sliding" else 2) if r.windowed else 0, r.window or 1,
                             r.chunk or 1, self._shape[i]) for i, r in enumerate(rows)]
        #: whether the split reads every sequence's computed length (a row with a window)
        self.reads_windows = any(info[5] for info in self._split_info)
        self._reps = np.array([rep for rep, *_ in self._attn_shapes], dtype=np.int64)[:, None]
        # Each row's attention shape index (into _attn_shapes), −1 for a state row.
        self._row_shape = [-1] * len(rows)
        for si, (_, members, *_) in enumerate(self._attn_shapes):
            for i in members:
                self._row_shape[i] = si
        self._state_rows = [i for i, si in enumerate(self._row_shape) if si < 0]
        self._rows_per_shape = [len(members) for _, members, *_ in self._attn_shapes]
        self._rows_per_shape_arr = np.array(self._rows_per_shape, dtype=np.int64)
        # Each attention shape's rows as an index into the [rows, seqs] arrays.
        self._shape_index = [members[0] if len(members) == 1 else np.array(members)[:, None]
                             for _, members, *_ in self._attn_shapes]
        # A fresh sequence's target (_target from nothing) for the tokens last asked for: a
        # blocked queue head asks again every step.
        self._fresh_of: tuple[int, tuple[list[int], list[int], list[int], list[int]]] = (-1, ([], [], [], []))
        self._has_state_rows = bool(self._state_rows)
        # Split groups: the rows of an attention shape with one window start (0 none, 1
        # sliding, 2 chunked; window, chunk): (shape, its rows, start, window, chunk).
        self._split_groups: list[tuple[int, list[int], int, int, int]] = []
        for si, (_, members, *_) in enumerate(self._attn_shapes):
            groups: dict[tuple[int, int, int], list[int]] = {}
            for i in members:
                ws, w, c = self._split_info[i][5:8]
                groups.setdefault((ws, w, c) if ws else (0, 1, 1), []).append(i)
            self._split_groups += [(si, group, *key) for key, group in groups.items()]
        # Per split group, for :meth:`_basis`: a row of its shape, window start, window,
        # chunk, block, and the sums over its rows of bytes per token, padding per block
        # and bytes per block.
        self._basis_info = [(self._attn_shapes[si][0], ws, w, c, self._attn_shapes[si][2],
                             sum(self._split_info[i][2] for i in group),
                             sum(self._split_info[i][3] for i in group),
                             sum(rows[i].block_bytes for i in group))
                            for si, group, ws, w, c in self._split_groups]
        self._shape_of_rows = np.array([max(si, 0) for si in self._row_shape], dtype=np.int64)
        #: every row is its own attention shape, in order (per-shape arrays are per row)
        self._rows_are_shapes = self._row_shape == list(range(len(rows)))
        self._basis_matrix: np.ndarray | None = None   # split_basis(), once built

    # ---------------------------------------------------------------- lengths

    def bind_finals(self, finals: np.ndarray) -> None:
        """Final lengths by sequence id (the engine's ``prompt + output``): the
        internal-fragmentation term needs them. Unbound, a sequence's final length is
        taken as ``max_seq_len``."""
        self._finals = np.asarray(finals, dtype=np.int64)

    def _final(self, seq: int) -> int:
        if self._finals is not None and seq < len(self._finals):
            return int(self._finals[seq])
        return self.max_seq_len

    def _ensure(self, seq: int) -> None:
        if seq >= len(self._q):
            size = max(seq + 1, 2 * len(self._q), 64)
            q = np.zeros(size, dtype=np.int64)
            q[: len(self._q)] = self._q
            self._q = q
            for name in ("_lo", "_hi"):
                old = getattr(self, name)
                new = np.zeros((len(self.rows), size), dtype=np.int64)
                new[:, : old.shape[1]] = old
                setattr(self, name, new)

    def _target(self, q: int, computed: int, lo: Any, hi: Any) -> tuple[list[int], list[int], list[int], list[int]]:
        """New (lo, hi) per row for ``q`` requested and ``computed`` computed, and the
        blocks each row frees and takes to get there."""
        if type(lo) is np.ndarray:
            lo, hi = lo.tolist(), hi.tolist()
        new_lo, new_hi, frees, takes = [], [], [], []
        for i, (state, b, code, w, c) in enumerate(self._rinfo):
            lo0, hi0 = lo[i], hi[i]
            if state:
                lo1, hi1 = 0, 1
            else:
                hi1 = -(-q // b)
                if hi1 < hi0:
                    hi1 = hi0
                lo1 = lo0
                if code and computed > 0:
                    at = (computed - w + 1 if computed > w - 1 else 0) // b if code == 1 \
                        else (computed // c * c) // b
                    if at > lo0:
                        lo1 = at
            m = lo1 if lo1 < hi0 else hi0
            frees.append(m - lo0 if m > lo0 else 0)
            m = hi0 if hi0 > lo1 else lo1
            takes.append(hi1 - m if hi1 > m else 0)
            new_lo.append(lo1)
            new_hi.append(hi1)
        return new_lo, new_hi, frees, takes

    def _fresh(self, q: int) -> tuple[list[int], list[int], list[int], list[int]]:
        """:meth:`_target` of a fresh sequence of ``q`` tokens (not to be changed: shared)."""
        if self._fresh_of[0] != q:
            zero = [0] * len(self.rows)
            self._fresh_of = (q, self._target(q, 0, zero, zero))
        return self._fresh_of[1]

    def _commit(self, seq: int, q: int, new_lo: list[int], new_hi: list[int]) -> None:
        final = self._final(seq)
        lo, hi = self._lo[:, seq].tolist(), self._hi[:, seq].tolist()
        held, floor, tails = self.held_blocks, self._floor, self._tail
        tail_of = self._tail_of
        for i, (state, b, _, _, _) in enumerate(self._rinfo):
            lo0, hi0, lo1, hi1 = lo[i], hi[i], new_lo[i], new_hi[i]
            held[i] += (hi1 - lo1) - (hi0 - lo0)
            if not state:
                floor[i] += (lo1 - lo0) * b
                tails[i] += tail_of(hi1, lo1, b, final) - tail_of(hi0, lo0, b, final)
        self._lo[:, seq] = new_lo
        self._hi[:, seq] = new_hi
        self._q[seq] = q

    @staticmethod
    def _tail_of(hi: int, lo: int, block_tokens: int, final: int) -> int:
        if hi <= lo:
            return 0
        end, start = hi * block_tokens, lo * block_tokens
        if start < final:
            start = final
        return end - start if end > start else 0

    # ------------------------------------------------------ allocator protocol

    def allocate(self, seq_id: int, num_slots: int) -> Any:
        """Room for ``num_slots`` tokens of a new sequence, none computed yet (None: no room)."""
        if not self._allocate(seq_id, num_slots):
            return None
        # Without ids, the blocks per row stand for the placement (the engine only tests it).
        return self.placement(seq_id) if self.tracks_ids else tuple(self.blocks_held(seq_id))

    def _allocate(self, seq_id: int, num_slots: int) -> bool:
        """:meth:`allocate` without building the placement: whether there was room."""
        if seq_id in self._live:
            raise ValueError(f"sequence {seq_id} is already allocated")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if seq_id >= len(self._q):
            self._ensure(seq_id)
        new_lo, new_hi, frees, takes = self._fresh(num_slots)
        if not self._place(seq_id, frees, takes):
            return False
        self._live[seq_id] = None
        self._lo[:, seq_id] = 0
        self._hi[:, seq_id] = 0
        self._commit(seq_id, num_slots, new_lo, new_hi)
        return True

    def extend(self, seq_id: int, num_slots: int) -> bool:
        """Raise the request to ``q + num_slots`` tokens with ``q + num_slots − 1`` of them
        computed (a decode step): blocks out of the window go back first, then the new
        ones are taken; False (state unchanged) if they cannot all be had."""
        if seq_id not in self._live:
            raise ValueError(f"extend of unknown sequence {seq_id}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        q = int(self._q[seq_id]) + num_slots
        computed = q - 1
        new_lo, new_hi, frees, takes = self._target(q, computed, self._lo[:, seq_id], self._hi[:, seq_id])
        if (any(frees) or any(takes)) and not self._place(seq_id, frees, takes):
            return False
        self._commit(seq_id, q, new_lo, new_hi)
        return True

    def _extend_owned(self, seq_id: int, num_slots: int) -> int | None:
        """:meth:`extend`, then :meth:`num_owned` (None: the blocks could not be had)."""
        if seq_id not in self._live:
            raise ValueError(f"extend of unknown sequence {seq_id}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        q = int(self._q[seq_id]) + num_slots
        lo, hi = self._lo[:, seq_id].tolist(), self._hi[:, seq_id].tolist()
        new_lo, new_hi, frees, takes = self._target(q, q - 1, lo, hi)
        if (any(frees) or any(takes)) and not self._place(seq_id, frees, takes):
            return None
        self._commit(seq_id, q, new_lo, new_hi)
        return self._owned_of(new_lo, new_hi)

    def can_take_all(self, per_seq: np.ndarray) -> bool:
        """Whether every sequence can take its blocks, ``per_seq[r, s]`` of row ``r``,
        one sequence after another (:meth:`advance_many`)."""
        return self._stretch_fits(per_seq.sum(axis=1)[None, :], np.zeros((1, len(self.rows))),
                                  per_seq[:, None, :]) == 1

    def _blocks_at(self, lo0: np.ndarray, hi0: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(lo, hi) of every row for sequences at (lo0, hi0) [rows, ...] extended to
        ``targets`` [...] tokens with ``targets − 1`` computed (broadcasting)."""
        shape = (-1,) + (1,) * targets.ndim
        bt = self._bt.reshape(shape)
        hi = np.where(self._attn.reshape(shape), np.maximum(hi0, -(-targets // bt)), hi0)
        if not self._frees_any:
            return np.broadcast_to(lo0, hi.shape), hi
        computed = targets - 1
        slide = np.maximum(0, computed - self._win.reshape(shape) + 1) // bt
        chunk = self._chunk.reshape(shape)
        local = np.where(computed > 0, (computed // chunk * chunk) // bt, 0)
        lo = np.where(self._sliding.reshape(shape), np.maximum(lo0, slide),
                      np.where(self._chunked.reshape(shape), np.maximum(lo0, local), lo0))
        return lo, hi

    def grow_many(self, seqs: np.ndarray, targets: np.ndarray) -> list[int] | None:
        """:meth:`advance_many` of decoding sequences to ``targets`` (``targets − 1``
        computed), in the order given, when the free memory is known to hold every block
        taken (:meth:`can_take_all`); returns what each owns then (:meth:`num_owned`),
        or None, with nothing changed, when the blocks might not all be had.

        Rows of one shape hold the same blocks, so each shape is worked out once, and a
        state row (one block from admission on) never moves while a sequence decodes.
        A step moves a few dozen sequences at most: plain ints beat numpy's per-call cost
        (numpy over them all was measured slower even at thirty sequences and two shapes)."""
        R, m = len(self.rows), len(seqs)
        shapes = self._attn_shapes
        seq_list = seqs.tolist()
        owned, los, his, lo1s, hi1s, frs, tks, tails = self._grow_ints(seq_list, seqs, targets)
        zero = [0] * m
        frees_rows, takes_rows = [zero] * R, [zero] * R
        new: list[tuple[int, list[int], int, int, list[int], list[int], list[int], list[int], int]] = []
        for k, (_, rows, b, code, _, _) in enumerate(shapes):
            for i in rows:
                frees_rows[i] = frs[k] if code else zero
                takes_rows[i] = tks[k]
            new.append((k, rows, b, code, los[k], his[k], lo1s[k] if code else los[k], hi1s[k], tails[k]))
        if not self._fits_moves(takes_rows, frees_rows):
            return None
        self._place_moves(seq_list, frees_rows, takes_rows)
        for k, rows, b, code, lo0, hi0, lo1, hi1, tail in new:
            d_lo = sum(lo1) - sum(lo0) if code else 0
            d_held = sum(hi1) - sum(hi0) - d_lo
            for i in rows:
                self.held_blocks[i] += d_held
                self._floor[i] += d_lo * b
                self._tail[i] += tail
            index = self._shape_index[k]
            if d_lo:
                self._lo[index, seqs] = lo1
            self._hi[index, seqs] = hi1
        self._q[seqs] = targets
        return owned

    def _grow_ints(self, seq_list: list[int], seqs: np.ndarray, targets: np.ndarray) -> tuple:
        """:meth:`grow_many`'s moves per shape, sequence by sequence in plain ints: what each
        sequence owns after, and per shape the blocks before and after, frees, takes and
        the change of the tails (``lo1s[k]``, ``frs[k]`` are empty for a shape that frees
        nothing)."""
        shapes = self._attn_shapes
        tl = targets.tolist()
        owned: list[int] = []
        los = self._lo[self._reps, seqs].tolist()
        his = self._hi[self._reps, seqs].tolist()
        finals = self._finals
        fins = finals[seqs].tolist() if finals is not None and len(finals) > max(seq_list) else \
            [self._final(s) for s in seq_list]
        S = len(shapes)
        params = [(b, code, w, c) for _, _, b, code, w, c in shapes]
        lo1s: list[list[int]] = [[] for _ in range(S)]
        hi1s: list[list[int]] = [[] for _ in range(S)]
        frs: list[list[int]] = [[] for _ in range(S)]
        tks: list[list[int]] = [[] for _ in range(S)]
        tails = [0] * S
        cap = self.max_seq_len + 1
        tail_of = self._tail_of
        columns = list(zip(*los, *his, strict=True))
        for t, final, col in zip(tl, fins, columns, strict=True):
            limit = cap
            for k, (b, code, w, c) in enumerate(params):
                lo0, hi0 = col[k], col[S + k]
                hi1 = (t + b - 1) // b
                if hi1 < hi0:
                    hi1 = hi0
                end = hi1 * b
                if end < limit:
                    limit = end
                lo1 = lo0
                if code:
                    if code == 1:
                        x = (t - w) // b if t > w else 0
                        if x > lo0:
                            lo1 = x
                        x = (lo1 + 1) * b + w - 1
                    else:
                        x = (t - 1) // c * c // b
                        if x > lo0:
                            lo1 = x
                        x = -(-((lo1 + 1) * b) // c) * c
                    if x < limit:
                        limit = x
                    x = (lo1 if lo1 < hi0 else hi0) - lo0
                    frs[k].append(x if x > 0 else 0)
                    x = hi1 - (hi0 if hi0 > lo1 else lo1)
                    tks[k].append(x if x > 0 else 0)
                    lo1s[k].append(lo1)
                else:
                    tks[k].append(hi1 - hi0)
                hi1s[k].append(hi1)
                if end > final:  # only a block past the final length has a tail
                    tails[k] += tail_of(hi1, lo1, b, final) - tail_of(hi0, lo0, b, final)
            owned.append(limit)
        return owned, los, his, lo1s, hi1s, frs, tks, tails

    def _fits_moves(self, takes: list[list[int]], frees: list[list[int]]) -> bool:
        """Whether one step's moves (per row and sequence, ``takes[r][s]``, ``frees[r][s]``)
        surely fit: :meth:`_stretch_fits` of that one step."""
        per_seq = np.array(takes, dtype=np.int64)
        return self._stretch_fits(per_seq.sum(axis=1)[None, :], np.array(frees, dtype=np.int64).sum(axis=1)[None, :],
                                  per_seq[:, None, :]) == 1

    def _place_moves(self, seqs: list[int], frees: list[list[int]], takes: list[list[int]]) -> None:
        """:meth:`_place_many` of per-row lists."""
        place = self._place
        for seq, f, t in zip(seqs, zip(*frees, strict=True), zip(*takes, strict=True), strict=True):
            if (any(f) or any(t)) and not place(seq, list(f), list(t)):
                raise AssertionError("advance_many ran out of blocks it was told were free")

    def moves_many(self, seqs: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, ...]:
        """What :meth:`advance_many` would do: (lo0, hi0, lo1, hi1, frees, takes) per row
        and sequence."""
        return self._moves_many(seqs, targets)

    def _moves_many(self, seqs: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, ...]:
        """Per row and sequence: (lo, hi) now, after ``extend`` to ``targets`` tokens
        (``targets − 1`` computed), and the blocks freed and taken on the way."""
        lo0, hi0 = self._lo[:, seqs], self._hi[:, seqs]
        lo1, hi1 = self._blocks_at(lo0, hi0, targets)
        frees = np.maximum(0, np.minimum(lo1, hi0) - lo0)
        takes = np.maximum(0, hi1 - np.maximum(hi0, lo1))
        return lo0, hi0, lo1, hi1, frees, takes

    def advance_many(self, seqs: np.ndarray, targets: np.ndarray,
                     moves: tuple[np.ndarray, ...] | None = None) -> None:
        """``extend`` of each sequence to its target, in the order given, when the free
        memory is known to hold every block taken (:meth:`can_take`); ``moves`` is
        :meth:`moves_many`'s answer when the caller has it."""
        lo0, hi0, lo1, hi1, frees, takes = moves or self._moves_many(seqs, targets)
        self._place_many(seqs, frees, takes)
        finals = self._finals[seqs] if self._finals is not None else np.full(len(seqs), self.max_seq_len)
        self._commit_sums(lo0, hi0, lo1, hi1, finals)
        self._lo[:, seqs], self._hi[:, seqs] = lo1, hi1
        self._q[seqs] = targets

    def _commit_sums(self, lo0: np.ndarray, hi0: np.ndarray, lo1: np.ndarray, hi1: np.ndarray,
                     finals: np.ndarray) -> None:
        """The incremental sums after sequences move from (lo0, hi0) to (lo1, hi1) [rows, seqs]."""
        done: dict[int, tuple[int, int, int]] = {}
        for i, row in enumerate(self.rows):
            shape = self._shape[i]
            if shape not in done:
                held = int(((hi1[i] - lo1[i]) - (hi0[i] - lo0[i])).sum())
                floor = tail = 0
                if not row.is_state:
                    b = row.block_tokens
                    floor = int((lo1[i] - lo0[i]).sum()) * b
                    tail = int((self._tails(hi1[i], lo1[i], b, finals)
                                - self._tails(hi0[i], lo0[i], b, finals)).sum())
                done[shape] = (held, floor, tail)
            held, floor, tail = done[shape]
            self.held_blocks[i] += held
            self._floor[i] += floor
            self._tail[i] += tail

    @staticmethod
    def _tails(hi: np.ndarray, lo: np.ndarray, b: int, finals: np.ndarray) -> np.ndarray:
        return np.where(hi > lo, np.maximum(0, hi * b - np.maximum(finals, lo * b)), 0)

    def stretch(self, seqs: np.ndarray, reqs: np.ndarray, filled0: np.ndarray, k: int,
                head_tokens: int | None, first_step_first: bool = False, owned: np.ndarray | None = None
                ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Up to ``k`` decode steps of the sequences ``seqs`` (all that hold memory), the
        sequence at ``filled0`` tokens computing token ``filled0 + j`` in step ``j``.

        Each sequence's blocks over the stretch have a closed form (the module's
        ``lo`` and ``hi`` of its computed length), so the blocks every step takes and
        frees are known up front. The stretch stops before the first step whose takes
        might not all fit (:meth:`_stretch_fits`) and, when a request of
        ``head_tokens`` waits at the head of the queue, before the first step whose
        frees might let it in (:meth:`_stretch_admits`). Block ids move event by event in the order
        exact steps would move them (step, then ``reqs``).

        Returns the steps taken, the split of each ``[k, rows + 1, categories]``, the
        largest allocatable bytes and used blocks of each, and each sequence's last
        requested length (−1: no block moved).
        """
        R, n = len(self.rows), len(seqs)
        shapes = self._attn_shapes
        S = len(shapes)
        params = [(b, code, w, c) for _, _, b, code, w, c in shapes]
        cap = self.max_seq_len + 1
        # Each sequence's first move: the first step whose target passes what it owns
        # (``owned``: :meth:`owned_many` of ``seqs``, when the caller keeps it).
        if owned is None:
            owned = self.owned_many(seqs)
        j0 = np.maximum(owned - filled0, 0)   # a prompt just computed may be past its window
        movers = np.flatnonzero(j0 < k)
        los, his = self._lo[self._reps, seqs[movers]], self._hi[self._reps, seqs[movers]]   # [S, movers]
        # The moves, sequence by sequence (plain ints: a stretch moves a few sequences a
        # few times): per step, the blocks each row takes and frees and the change of the
        # kept sums per shape; per move, the sequence's blocks after it.
        finals = self._finals
        m_cols = movers.tolist()
        m_f0 = filled0[movers].tolist()
        m_j0 = j0[movers].tolist()
        m_seq = seqs[movers].tolist()
        m_fin = finals[seqs[movers]].tolist() if finals is not None and (not m_seq or len(finals) > max(m_seq)) \
            else [self._final(x) for x in m_seq]
        m_lo, m_hi = los.T.tolist(), his.T.tolist()
        tail_of = self._tail_of
        shape_rows = [rows for _, rows, *_ in shapes]
        moves: list[tuple[int, int, int, list[int], list[int], list[int], list[int]]] = []
        # Under memory pressure a stretch often cannot take its first step, and stretches
        # stall in runs: ``first_step_first`` (the caller's last stretch stalled) tries the
        # first step alone first (the limits read no later step to stop there).
        for kk in ((1, k) if first_step_first and k > 1 and 0 in m_j0 else (k,)):
            # per step and shape: blocks taken, freed, and the changes of the kept sums
            # (held, floor in blocks, tail)
            moves = []
            st_rows = [[0] * S for _ in range(kk)]
            sf_rows = [[0] * S for _ in range(kk)]
            ds = [[[0] * S for _ in range(kk)] for _ in range(3)]
            if len(m_cols) * kk > self._STRETCH_EVENTS_NP:
                moves, st_rows, sf_rows, ds = self._stretch_events(
                    kk, movers, filled0[movers], j0[movers], los, his,
                    np.array(m_fin, dtype=np.int64))
                m_iter: Any = ()
            else:
                m_iter = zip(m_cols, m_f0, m_j0, m_fin, m_lo, m_hi, strict=True)
            for col, f0, j, final, lo, hi in m_iter:
                while j < kk:
                    t = f0 + j + 1
                    limit = cap
                    lo1s, hi1s, frs, tks = [], [], [], []
                    for si, (b, code, w, c) in enumerate(params):
                        lo0, hi0 = lo[si], hi[si]
                        hi1 = (t + b - 1) // b
                        if hi1 < hi0:
                            hi1 = hi0
                        end = hi1 * b
                        if end < limit:
                            limit = end
                        lo1 = lo0
                        if code:
                            if code == 1:
                                x = (t - w) // b if t > w else 0
                                if x > lo0:
                                    lo1 = x
                                x = (lo1 + 1) * b + w - 1
                            else:
                                x = (t - 1) // c * c // b
                                if x > lo0:
                                    lo1 = x
                                x = -(-((lo1 + 1) * b) // c) * c
                            if x < limit:
                                limit = x
                        x = (lo1 if lo1 < hi0 else hi0) - lo0
                        fr = x if x > 0 else 0
                        x = hi1 - (hi0 if hi0 > lo1 else lo1)
                        tk = x if x > 0 else 0
                        if fr or tk:
                            sf_rows[j][si] += fr
                            st_rows[j][si] += tk
                        d = ds[0][j]
                        d[si] += (hi1 - lo1) - (hi0 - lo0)
                        ds[1][j][si] += lo1 - lo0
                        if end > final:
                            ds[2][j][si] += tail_of(hi1, lo1, b, final) - tail_of(hi0, lo0, b, final)
                        lo1s.append(lo1)
                        hi1s.append(hi1)
                        frs.append(fr)
                        tks.append(tk)
                    moves.append((j, col, t, lo1s, hi1s, frs, tks))
                    lo, hi = lo1s, hi1s
                    if limit - f0 <= j:
                        raise AssertionError("a sequence's blocks did not move where its length said")
                    j = limit - f0
            step_takes = np.array(st_rows, dtype=np.int64).reshape(kk, S)
            step_frees = np.array(sf_rows, dtype=np.int64).reshape(kk, S)
            if not self._rows_are_shapes:   # per shape, then per row
                step_takes, step_frees = step_takes[:, self._shape_of_rows], step_frees[:, self._shape_of_rows]
            if self._has_state_rows:
                step_takes[:, self._state_rows] = 0
                step_frees[:, self._state_rows] = 0
            if moves and self._needs_per_seq:
                per_seq = np.zeros((R, kk, n), dtype=np.int64)
                row_of = self._row_shape
                for j, col, _, _, _, _, tks in moves:
                    per_seq[:, j, col] = [tks[si] if si >= 0 else 0 for si in row_of]
            else:
                per_seq = np.zeros((R, kk, 0), dtype=np.int64)   # no sequence takes, or not read
            limit = self._stretch_fits(step_takes, step_frees, per_seq)
            if head_tokens is not None and moves and step_frees.any():
                head = self._fresh(head_tokens)[3]
                limit = min(limit, self._stretch_admits(step_takes, step_frees, head))
            if limit == 0:
                break
        k = min(k, limit)
        if k <= 0:
            return (0, np.zeros((0, R + 1, len(CATEGORIES)), dtype=np.int64), np.zeros(0, dtype=np.int64),
                    np.zeros(0, dtype=np.int64), np.full(n, -1))
        if k < kk:
            moves = [mv for mv in moves if mv[0] < k]
        if self._counts_only():
            # Counts: the moves of a step add up in any order, and the free units after
            # each step are a running sum.
            free_rows, largest, used = self._count_steps(np.array(sf_rows[:k], dtype=np.int64).reshape(k, S),
                                                         np.array(st_rows[:k], dtype=np.int64).reshape(k, S))
        else:
            free_rows, largest, used = self._place_stretch(moves, k, seqs, reqs)
        # Commit each sequence's blocks after its last move, and the sums.
        last_target = np.full(n, -1, dtype=np.int64)
        final_state: dict[int, tuple[int, list[int], list[int]]] = {}
        for _, col, t, lo1s, hi1s, _, _ in moves:
            final_state[col] = (t, lo1s, hi1s)
        d_sums = np.array(ds, dtype=np.int64).reshape(3, -1, S)[:, :k]
        if final_state:
            cols = np.fromiter(final_state, dtype=np.int64, count=len(final_state))
            touched = seqs[cols]
            states = list(final_state.values())
            last_target[cols] = [st[0] for st in states]
            new_lo = np.array([st[1] for st in states], dtype=np.int64).T   # [S, moved]
            new_hi = np.array([st[2] for st in states], dtype=np.int64).T
            for si, index in enumerate(self._shape_index):
                self._lo[index, touched] = new_lo[si]
                self._hi[index, touched] = new_hi[si]
            self._q[touched] = last_target[cols]
            sums = np.cumsum(d_sums, axis=1)                          # [3, k, S]
            tot = sums[:, -1].tolist()
        else:
            sums = d_sums
            tot = [[0] * S for _ in range(3)]
        for si, (rows, (b, *_)) in enumerate(zip(shape_rows, params, strict=True)):
            for r in rows:
                self.held_blocks[r] += tot[0][si]
                self._floor[r] += tot[1][si] * b
                self._tail[r] += tot[2][si]
        # The split of every step: the sums :meth:`split_basis` maps (the kept sums
        # before the stretch plus their changes), worked out a split group at a time.
        G, n_states = len(self._split_groups), len(self._state_rows)
        step_sums = np.empty((k, 2 + 4 * G + n_states + R + 1), dtype=np.int64)
        step_sums[:, 0] = int(filled0.sum()) + n * np.arange(k, dtype=np.int64)   # Σ computed
        step_sums[:, 1] = self._fixed_padding()
        f: np.ndarray | None = None
        for g, (si, _, ws, w, c) in enumerate(self._split_groups):
            r0, b = shape_rows[si][0], params[si][0]
            col = 2 + 4 * g
            step_sums[:, col] = self.held_blocks[r0] - tot[0][si] + sums[0, :, si]
            step_sums[:, col + 1] = self._floor[r0] - tot[1][si] * b + sums[1, :, si] * b
            step_sums[:, col + 2] = self._tail[r0] - tot[2][si] + sums[2, :, si]
            if ws:
                if f is None:
                    f = filled0[None, :] + np.arange(k, dtype=np.int64)[:, None]
                step_sums[:, col + 3] = np.maximum(f - (w - 1), 0).sum(axis=1) if ws == 1 else (f // c * c).sum(axis=1)
            else:
                step_sums[:, col + 3] = 0
        for j, i in enumerate(self._state_rows):
            step_sums[:, 2 + 4 * G + j] = self.held_blocks[i]
        step_sums[:, 2 + 4 * G + n_states:] = free_rows
        out = self._split_of(step_sums)
        return k, out, largest, used, last_target

    def _place_stretch(self, moves: list, k: int, seqs: np.ndarray,
                       reqs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Block ids of a stretch's ``k`` steps (``moves``: theirs), move by move in
        exact-mode order (step, then request); per step, the pool's free bytes per row,
        largest allocatable and used blocks after it."""
        R, S = len(self.rows), len(self._attn_shapes)
        if moves:
            req_of = reqs.tolist()
            moves = sorted(moves, key=lambda mv: (mv[0], req_of[mv[1]], mv[1]))
        seq_list = seqs.tolist()
        row_of = self._row_shape
        snapshot = (self._free_bytes(), self.largest_allocatable(), self.num_used_blocks())
        snaps, at = [snapshot], [0]
        i = 0
        while i < len(moves):
            j = moves[i][0]
            first = i
            while i < len(moves) and moves[i][0] == j:
                i += 1
            step = moves[first:i]
            frs_s = [[mv[5][si] for mv in step] for si in range(S)]
            tks_s = [[mv[6][si] for mv in step] for si in range(S)]
            zero = [0] * len(step)
            self._place_moves([seq_list[mv[1]] for mv in step],
                              [frs_s[si] if si >= 0 else zero for si in row_of],
                              [tks_s[si] if si >= 0 else zero for si in row_of])
            snaps.append((self._free_bytes(), self.largest_allocatable(), self.num_used_blocks()))
            at.append(j)
        if len(snaps) == 1:
            return (np.broadcast_to(np.array(snapshot[0], dtype=np.int64), (k, R + 1)),
                    np.full(k, snapshot[1], dtype=np.int64), np.full(k, snapshot[2], dtype=np.int64))
        # Step j holds the state after the last step at or before it that moved.
        which = np.searchsorted(np.array(at[1:], dtype=np.int64), np.arange(k), side="right")
        return (np.array([sn[0] for sn in snaps], dtype=np.int64)[which],
                np.array([sn[1] for sn in snaps], dtype=np.int64)[which],
                np.array([sn[2] for sn in snaps], dtype=np.int64)[which])

    #: a stretch over more than this many (moving sequences × steps) finds its moves in numpy
    #: (a long stretch of many sequences: the loop's cost grows with the moves, numpy's less)
    _STRETCH_EVENTS_NP = 2048

    def _stretch_events(self, k: int, cols: np.ndarray, f0: np.ndarray, j0: np.ndarray, lo0: np.ndarray,
                        hi0: np.ndarray, finals: np.ndarray) -> tuple[list, list, list, list]:
        """The moves of :meth:`stretch`'s sequence-by-sequence loop, from each shape's
        closed form over ``[steps, sequences]`` (``lo0``, ``hi0``: ``[shapes, sequences]``
        before the stretch): (moves, takes and frees per step and shape, the changes of
        the kept sums per step and shape)."""
        S = len(self._attn_shapes)
        steps = np.arange(k, dtype=np.int64)[:, None]
        t = f0[None, :] + steps + 1                                     # [k, m] targets
        live = steps >= j0[None, :]                                     # before its first move: none
        los, his, frs, tks = [], [], [], []
        sums = np.zeros((3, k, S), dtype=np.int64)
        for si, (_, _, b, code, w, c) in enumerate(self._attn_shapes):
            l0, h0 = lo0[si][None, :], hi0[si][None, :]
            hi = np.where(live, np.maximum(h0, (t + (b - 1)) // b), h0)
            if code == 1:
                lo = np.where(live, np.maximum(l0, np.maximum(t - w, 0) // b), l0)
            elif code == 2:
                lo = np.where(live, np.maximum(l0, (t - 1) // c * c // b), l0)
            else:
                lo = np.broadcast_to(l0, hi.shape)
            lo_prev = np.concatenate((l0, lo[:-1]))
            hi_prev = np.concatenate((h0, hi[:-1]))
            fr = np.maximum(np.minimum(lo, hi_prev) - lo_prev, 0)
            tk = np.maximum(hi - np.maximum(hi_prev, lo), 0)
            sums[0, :, si] = ((hi - lo) - (hi_prev - lo_prev)).sum(axis=1)
            sums[1, :, si] = (lo - lo_prev).sum(axis=1)
            near = (hi * b > finals[None, :]) & ((hi != hi_prev) | (lo != lo_prev))
            if near.any():
                fin = np.broadcast_to(finals[None, :], hi.shape)
                sums[2, :, si] = np.where(near, self._tails(hi, lo, b, fin) - self._tails(hi_prev, lo_prev, b, fin),
                                          0).sum(axis=1)
            los.append(lo)
            his.append(hi)
            frs.append(fr)
            tks.append(tk)
        lo_a, hi_a, fr_a, tk_a = np.stack(los), np.stack(his), np.stack(frs), np.stack(tks)   # [S, k, m]
        jj, cc = np.nonzero((fr_a > 0).any(axis=0) | (tk_a > 0).any(axis=0))
        moves = list(zip(jj.tolist(), cols[cc].tolist(), t[jj, cc].tolist(), lo_a[:, jj, cc].T.tolist(),
                         hi_a[:, jj, cc].T.tolist(), fr_a[:, jj, cc].T.tolist(), tk_a[:, jj, cc].T.tolist(),
                         strict=True))
        return moves, tk_a.sum(axis=2).T.tolist(), fr_a.sum(axis=2).T.tolist(), sums.tolist()

    #: whether :meth:`_stretch_fits` reads the takes per sequence (else it gets zeros)
    _needs_per_seq = True

    def _counts_only(self) -> bool:
        """Whether the pool keeps block counts only (``tracks_ids`` off: a batch's or a
        stretch's moves then add up, :meth:`_count_steps`)."""
        return not self.tracks_ids

    def _count_steps(self, frees: np.ndarray, takes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Steps in which each row of attention shape ``s`` frees ``frees[j, s]`` blocks and
        takes ``takes[j, s]``, applied to a counts-only pool: per step, the free bytes per
        row, largest allocatable and used blocks after it."""
        raise NotImplementedError

    def _count_one_pool(self, frees: np.ndarray, takes: np.ndarray, unit_bytes: int,
                        num_units: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_count_steps` of one pool of ``num_units`` units, one a block of any row,
        counted in ``self._free_count`` (every free byte allocatable)."""
        free = self._free_count + np.cumsum((frees - takes) @ self._rows_per_shape_arr)
        if len(free) and int(free.min()) < 0:
            raise AssertionError("a block move failed inside a stretch that had room for it")
        if len(free):
            self._free_count = int(free[-1])
        free_rows = np.zeros((len(free), len(self.rows) + 1), dtype=np.int64)
        free_rows[:, -1] = free * unit_bytes
        return free_rows, free_rows[:, -1].copy(), num_units - free

    def _stretch_fits(self, takes: np.ndarray, frees: np.ndarray, per_seq: np.ndarray) -> int:
        """The first step whose takes might not fit, given each step's takes and frees
        per row (``[k, rows]``; ``per_seq``: the takes ``[rows, k, seqs]``): frees of
        earlier steps count, a step's own do not.
        This default ignores frees (safe for any pool); pools that know better override."""
        cum = np.cumsum(takes, axis=0)
        for j in range(len(cum)):
            if not self._can_take(cum[j].tolist()):
                return j
        return len(cum)

    def _stretch_admits(self, takes: np.ndarray, frees: np.ndarray, head: list[int]) -> int:
        """The first step after whose moves a fresh sequence taking ``head`` blocks per
        row might fit. This default says the first step that frees anything (safe)."""
        freeing = np.flatnonzero(frees.any(axis=1))
        return int(freeing[0]) if len(freeing) else len(takes)

    def owned_many(self, seqs: np.ndarray) -> np.ndarray:
        """:meth:`num_owned` for many sequences (a shape's rows hold the same blocks)."""
        limit = np.full(len(seqs), self.max_seq_len + 1, dtype=np.int64)
        for rep, _, b, code, w, c in self._attn_shapes:
            np.minimum(limit, self._hi[rep, seqs] * b, out=limit)
            if code:
                lo = self._lo[rep, seqs]
                at = (lo + 1) * b + (w - 1) if code == 1 else -(-((lo + 1) * b) // c) * c
                np.minimum(limit, at, out=limit)
        return limit

    def free(self, seq_id: int) -> None:
        if seq_id not in self._live:
            raise ValueError(f"free of unknown sequence {seq_id}")
        self._release(seq_id)
        zero = [0] * len(self.rows)
        self._commit(seq_id, 0, zero, zero)
        del self._live[seq_id]

    def can_allocate(self, num_slots: int) -> bool:
        return self._can_take(self._fresh(num_slots)[3])

    def num_free(self) -> int:
        return int(sum(self._free_bytes()))

    def largest_allocatable(self) -> int:
        """Free bytes a new sequence can be placed in (no more than ``num_free``)."""
        return self.num_free()

    def rounded(self, num_slots: int) -> int:
        """Bytes a fresh sequence of ``num_slots`` tokens holds."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        takes = self._fresh(num_slots)[3]
        return sum(t * r.block_bytes for t, r in zip(takes, self.rows, strict=True))

    def fits_empty(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` tokens, all allocated at once, fits the
        empty pool (recompute re-admits a preempted sequence that way)."""
        return self._fits_empty(self._fresh(num_tokens)[3])

    def num_owned(self, seq_id: int) -> int:
        """The largest requested length that moves no block of the sequence."""
        self._require(seq_id)
        return self._owned_of(self._lo[:, seq_id].tolist(), self._hi[:, seq_id].tolist())

    def _owned_of(self, lo: list[int], hi: list[int]) -> int:
        """:meth:`num_owned` of a sequence holding blocks ``[lo, hi)`` per row."""
        limit = self.max_seq_len + 1
        for i, (state, b, code, w, c) in enumerate(self._rinfo):
            if state:
                continue
            at = hi[i] * b
            if at < limit:
                limit = at
            if code:
                at = (lo[i] + 1) * b + w - 1 if code == 1 else -(-((lo[i] + 1) * b) // c) * c
                if at < limit:
                    limit = at
        return limit

    def num_requested(self, seq_id: int) -> int:
        self._require(seq_id)
        return int(self._q[seq_id])

    def seq_ids(self) -> list[int]:
        return list(self._live)

    def placement(self, seq_id: int) -> tuple[tuple[int, ...], ...]:
        """Block ids per row, in logical order (freed leading blocks left out)."""
        self._require(seq_id)
        return tuple(tuple(self._block_ids(seq_id, i)) for i in range(len(self.rows)))

    def blocks_held(self, seq_id: int) -> list[int]:
        """Blocks each row holds for the sequence."""
        self._require(seq_id)
        return [int(self._hi[i, seq_id] - self._lo[i, seq_id]) for i in range(len(self.rows))]

    def _require(self, seq_id: int) -> None:
        if seq_id not in self._live:
            raise ValueError(f"unknown sequence {seq_id}")

    # ------------------------------------------------------------- the split

    @property
    def labels(self) -> list[str]:
        """Row labels, then the pool's."""
        return [r.label for r in self.rows] + [POOL]

    def split(self, seqs: np.ndarray, computed: np.ndarray) -> np.ndarray:
        """Bytes per row (and the pool, last) per category, for the live sequences
        ``seqs`` that have ``computed`` tokens stored now: :meth:`split_basis` of
        :meth:`_basis`'s sums.

        Out of the window, per row, is Σ max(0, s(f) − lo·B) over sequences; every
        sequence's ``lo·B`` is at most its ``s(f)`` (blocks leave the window only once
        wholly before it: :meth:`split_slow` asserts it), so that is Σ s(f) − Σ lo·B,
        the window starts less the kept floor."""
        return self._split_of(self._basis(computed, int(computed.sum()), check=False)[0])

    def _split_of(self, sums: list[int] | np.ndarray) -> np.ndarray:
        """The split ``[..., rows + 1, categories]`` of sums (``[..., sums]``)."""
        sums = np.asarray(sums, dtype=np.int64)
        return (sums @ self.split_basis()).reshape(sums.shape[:-1] + (len(self.rows) + 1, len(CATEGORIES)))

    # ------------------------------------------------- the split as a few sums

    def split_basis(self) -> np.ndarray:
        """The split as a linear map of a few sums (:meth:`_basis`): ``[sums, (rows + 1) ·
        categories]``, so that ``split.ravel() == sums @ split_basis()``. The sums are Σ
        computed, the pool's fixed padding, per split group (an attention shape's rows of
        one window) the shape's blocks held, kept floor and tails and the group's window
        starts, per state row its states, then the free bytes of
        every row and the pool: a recorder integrates these over time, not the split."""
        if self._basis_matrix is not None:
            return self._basis_matrix
        R, C = len(self.rows) + 1, len(CATEGORIES)
        S = len(self._split_groups)
        out = np.zeros((2 + 4 * S + len(self._state_rows) + R, R, C), dtype=np.int64)
        out[1, R - 1, PADDING] = 1
        for g, (si, members, *_) in enumerate(self._split_groups):
            b = self._attn_shapes[si][2]
            held, floor, tail, start = 2 + 4 * g + np.arange(4)
            for i in members:
                _, _, tb, ppb, _, ws, *_ = self._split_info[i]
                out[0, i, TOKEN] += tb
                out[start if ws else floor, i, TOKEN] -= tb
                out[held, i, RESERVATION] += b * tb
                out[0, i, RESERVATION] -= tb
                out[floor, i, RESERVATION] += tb
                out[tail, i, RESERVATION] -= tb
                out[tail, i, INTERNAL] += tb
                out[held, i, PADDING] += ppb
                if ws:
                    out[start, i, OUT_OF_WINDOW] += tb
                    out[floor, i, OUT_OF_WINDOW] -= tb
        for k, i in enumerate(self._state_rows):
            _, _, _, ppb, sb, *_ = self._split_info[i]
            out[2 + 4 * S + k, i, TOKEN] = sb
            out[2 + 4 * S + k, i, PADDING] = ppb
        for i in range(R):
            out[2 + 4 * S + len(self._state_rows) + i, i, FREE] = 1
        self._basis_matrix = out.reshape(len(out), R * C)
        return self._basis_matrix

    def _basis(self, computed: np.ndarray | None, stored: int,
               check: bool = True) -> tuple[list[int], int, int, int]:
        """The sums :meth:`split_basis` maps to the split, now, and the split's token
        states, free and everything else held, all bytes (``stored``: Σ ``computed``;
        ``computed`` is read only by windowed rows). With ``check``, raises if a part of the
        split would be negative or the parts would not add up to the pool (a subclass that
        adjusts :meth:`split`, as for shared blocks, checks after adjusting)."""
        free = self._free_bytes()
        fixed = self._fixed_padding()
        nseq = len(self._live)
        sums = [stored, fixed]
        token = held_bytes = 0
        elsewhere = fixed
        negative = None
        for rep, ws, w, c, b, tb, ppb, bb in self._basis_info:
            held, floor, tail = self.held_blocks[rep], self._floor[rep], self._tail[rep]
            start = 0
            if ws and nseq:
                assert computed is not None
                start = int(np.maximum(computed - (w - 1), 0).sum()) if ws == 1 else int((computed // c * c).sum())
            sums += (held, floor, tail, start)
            read = stored - start if ws else stored - floor
            oow = start - floor if ws else 0
            if read < 0 or oow < 0 or held * b - (stored - floor) - tail < 0 or tail < 0:
                negative = self.rows[rep].label
            token += read * tb
            elsewhere += (tail + oow) * tb + held * ppb
            held_bytes += held * bb
        for i in self._state_rows:
            held = self.held_blocks[i]
            _, _, _, ppb, sb, *_ = self._split_info[i]
            sums.append(held)
            token += held * sb
            elsewhere += held * ppb
            held_bytes += held * self.rows[i].block_bytes
        sums += free
        total = sum(free)
        if not check:
            return sums, token, total, elsewhere
        if negative is not None:
            raise AssertionError(f"broken byte split: a part of row {negative!r} is negative\n{self._split_of(sums)}")
        if held_bytes + total + fixed != self.capacity or min(free) < 0:
            raise AssertionError(f"broken byte split: sums to {held_bytes + total + fixed:,} of {self.capacity:,}\n"
                                 f"{self._split_of(sums)}")
        return sums, token, total, elsewhere

    def split_slow(self, seqs: np.ndarray, computed: np.ndarray) -> np.ndarray:
        """:meth:`split` from each sequence's own blocks (tests and ``check=True``)."""
        out = np.zeros((len(self.rows) + 1, len(CATEGORIES)), dtype=np.int64)
        assert sorted(int(s) for s in seqs) == sorted(self._live), "live sequences differ"
        for seq, f in zip(seqs.tolist(), computed.tolist(), strict=True):
            final = self._final(seq)
            assert 0 <= f <= final, (seq, f, final)
            for i, row in enumerate(self.rows):
                lo, hi = int(self._lo[i, seq]), int(self._hi[i, seq])
                if self.tracks_ids:
                    assert len(self._block_ids(seq, i)) == hi - lo, (seq, row.label)
                out[i, PADDING] += (hi - lo) * row.padding_per_block
                if row.is_state:
                    out[i, TOKEN] += (hi - lo) * row.state_bytes
                    continue
                b, tb = row.block_tokens, row.token_bytes
                assert f <= hi * b, (seq, row.label, f, hi)
                start = int(row.window_start(np.array([f]))[0])
                assert lo * b <= max(start, 0) or lo == 0, (seq, row.label, lo, start)
                positions = np.arange(lo * b, hi * b)
                out[i, OUT_OF_WINDOW] += int(((positions < start) & (positions < f)).sum()) * tb
                out[i, TOKEN] += int(((positions >= start) & (positions < f)).sum()) * tb
                out[i, RESERVATION] += int(((positions >= f) & (positions < final)).sum()) * tb
                out[i, INTERNAL] += int((positions >= max(final, f)).sum()) * tb
        out[:, FREE] = self._free_bytes()
        out[-1, PADDING] = self._fixed_padding()
        return out

    def check(self) -> None:
        """Incremental sums against the per-sequence arrays, and the pool's own invariants."""
        seqs = np.fromiter(self._live, dtype=np.int64, count=len(self._live))
        for i, row in enumerate(self.rows):
            lo, hi = self._lo[i, seqs], self._hi[i, seqs]
            assert self.held_blocks[i] == int((hi - lo).sum()), (row.label, "held blocks")
            if not row.is_state:
                b = row.block_tokens
                assert self._floor[i] == int(lo.sum()) * b, (row.label, "floor")
                tails = sum(self._tail_of(int(h), int(l_), b, self._final(int(s)))
                            for s, l_, h in zip(seqs, lo, hi, strict=True))
                assert self._tail[i] == tails, (row.label, "tail")
        self._check_pool()

    # --------------------------------------------------------- subclass hooks

    def _place(self, seq: int, frees: list[int], takes: list[int]) -> bool:
        raise NotImplementedError

    def _release(self, seq: int) -> None:
        raise NotImplementedError

    def _place_many(self, seqs: np.ndarray, frees: np.ndarray, takes: np.ndarray) -> None:
        """:meth:`_place` for each sequence in turn (``[rows, seqs]``), known to fit (a
        counts-only pool adds them up: :meth:`_place_moves`)."""
        if self._counts_only():
            self._place_moves(seqs.tolist(), frees.tolist(), takes.tolist())
            return
        place = self._place
        for seq, f, t in zip(seqs.tolist(), frees.T.tolist(), takes.T.tolist(), strict=True):
            if (any(f) or any(t)) and not place(seq, f, t):
                raise AssertionError("advance_many ran out of blocks it was told were free")

    def _free_bytes(self) -> list[int]:
        raise NotImplementedError

    def _fixed_padding(self) -> int:
        raise NotImplementedError

    def _can_take(self, takes: list[int]) -> bool:
        raise NotImplementedError

    def _fits_empty(self, takes: list[int]) -> bool:
        raise NotImplementedError

    def _block_ids(self, seq: int, row: int) -> list[int]:
        raise NotImplementedError

    def _check_pool(self) -> None:
        raise NotImplementedError

    def num_used_blocks(self) -> int:
        """Block ids (or small pages) held by sequences."""
        raise NotImplementedError

    @property
    def unit_kinds(self) -> list[str]:
        """What each row index of :meth:`unit_rows` holds."""
        return [r.kind for r in self.rows]

    def unit_rows(self) -> np.ndarray:
        """The pool's address space in its own units (blocks, slots, large pages), each
        marked with the row that holds it, −1 where free (for address maps)."""
        raise NotImplementedError


def one_pool_fits(takes: np.ndarray, frees: np.ndarray, free: int) -> int:
    """:meth:`HybridManager._stretch_fits` of one pool of ``free`` free units, any row's
    block one unit: the first step whose takes (``[steps, rows]``) exceed what is free
    before it (earlier steps' frees count, its own do not: each move then needs no more
    than is free when it comes)."""
    if len(takes) <= 64:  # a short stretch: the running sums in plain ints
        freed = taken = 0
        for j, (t, f) in enumerate(zip(takes.sum(axis=1).tolist(), frees.sum(axis=1).tolist(), strict=True)):
            taken += t
            if taken > free + freed:
                return j
            freed += f
        return len(takes)
    total = takes.sum(axis=1)
    freed_before = np.concatenate(([0], np.cumsum(frees.sum(axis=1))[:-1]))
    short = np.flatnonzero(np.cumsum(total) > free + freed_before)
    return int(short[0]) if len(short) else len(total)


def one_pool_admits(takes: np.ndarray, frees: np.ndarray, free: int, need: int) -> int:
    """:meth:`HybridManager._stretch_admits` of one pool of ``free`` free units: the first
    step after whose moves ``need`` units are free."""
    if len(takes) <= 64:
        for j, d in enumerate((frees.sum(axis=1) - takes.sum(axis=1)).tolist()):
            free += d
            if free >= need:
                return j
        return len(takes)
    fits = np.flatnonzero(free + np.cumsum(frees.sum(axis=1) - takes.sum(axis=1)) >= need)
    return int(fits[0]) if len(fits) else len(takes)


def kind_of_rows(rows: tuple[Row, ...]) -> list[str]:
    """The kind of each row, then the pool's (for the per-kind split)."""
    return [r.kind for r in rows] + [POOL]
