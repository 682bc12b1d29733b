"""Which chunks of each KV cache group a tier serves: vLLM 0.33's lookup over groups.

vLLM 0.33's ``OffloadingConnectorScheduler`` keys every chunk of every KV cache group
apart (the chunk's block hash and the group) and, past a request's GPU prefix hit,
asks its manager for each group's chunks (``_lookup_complete_chunks``)::

    full attention, MLA   left to right from the chunk the GPU hit ends in, up to
                          the first chunk no tier holds
    sliding window W      right to left: the rightmost run of ceil(W / C) chunks
                          all held (the first run may need one more, where the
                          hit's end is not a chunk boundary); with no such run,
                          the run that starts at the GPU hit, however short
    chunked local S       the same, with a window of ceil(S / C) chunks

Each group may only shorten the hit. Full attention goes first, then the windows,
widest first; when a window shortened the hit, the windows are looked up again at the
new end, until none shortens it. A model with a window stops one token short of its
prompt (its last token is computed again). A run shorter than one chunk past the GPU
hit is no hit, and a chunk still being written that a group's answer rests on defers
the request (vLLM's ``HIT_PENDING``).

A load brings, per group, the chunks of the blocks the KV manager placed for the hit:
every chunk past the GPU hit for full attention, the window's for the others (vLLM's
``update_state_after_alloc``). A dense model is one full-attention group.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from fragsim.kinds import cdiv

#: what a tier says of one key: held and readable, held but still being written, or not held
HIT, PENDING, MISS = "hit", "pending", "miss"


@dataclass(frozen=True)
class TierGroup:
    """One KV cache group as the tier sees it: its kind and how far back it reads."""

    kind: str                  # full, mla, sliding, chunked
    window: int | None = None  # sliding: the window in tokens
    chunk: int | None = None   # chunked: the attention chunk in tokens

    @property
    def is_full(self) -> bool:
        return self.kind in ("full", "mla")

    def window_chunks(self, chunk: int) -> int:
        """vLLM's ``sliding_window_size_in_chunks``: chunks a hit's end must have held."""
        if self.kind == "sliding":
            assert self.window is not None
            return cdiv(self.window, chunk)
        assert self.kind == "chunked" and self.chunk is not None, f"no window for a {self.kind} group"
        return cdiv(self.chunk, chunk)

    def load_window_chunks(self, chunk: int, end: int) -> int:
        """Chunks a hit ending at token ``end`` needs held (vLLM's
        ``load_window_size_in_chunks``: a window ending inside a chunk reaches one more)."""
        window = self.window_chunks(chunk)
        if self.kind == "sliding":
            assert self.window is not None
            window = max(window, cdiv(self.window - 1 + (-end % chunk), chunk))
        return window


FULL_GROUP: tuple[TierGroup, ...] = (TierGroup("full"),)


def lookup_order(groups: Sequence[TierGroup], chunk: int) -> tuple[list[int], list[int]]:
    """(full-attention groups, windowed groups widest first), as indices."""
    full = [i for i, g in enumerate(groups) if g.is_full]
    windows = sorted((i for i, g in enumerate(groups) if not g.is_full),
                     key=lambda i: groups[i].window_chunks(chunk), reverse=True)
    return full, windows


def _prefix_run(state: Callable[[int], str], first: int, last: int) -> tuple[int, bool, int]:
    """Consecutive held chunks from ``first`` (before ``last``), whether one of them is
    pending, and the chunks asked (up to the first miss)."""
    n, pending = 0, False
    for i in range(first, last):
        s = state(i)
        if s == MISS:
            return n, pending, n + 1
        n += 1
        pending |= s == PENDING
    return n, pending, n


def _window_run(state: Callable[[int], str], first: int, last: int, window: int,
                first_window: int) -> tuple[int, bool, int]:
    """Of chunks ``[first, last)``, asked from the last down: the end (counted from
    ``first``, exclusive) of the rightmost run of ``window`` held chunks (the first run
    counted from the right needs ``first_window``); with none, the run from ``first``.
    Also whether a pending chunk lies in the run the answer rests on, and the chunks asked."""
    run, pending, need = 0, False, first_window
    for i in range(last - 1, first - 1, -1):
        s = state(i)
        if s == MISS:
            run, pending, need = 0, False, window
            continue
        run += 1
        pending |= s == PENDING
        if run == need:
            return i - first + need, pending, last - i
    return run, pending, last - first


def hit_tokens(groups: Sequence[TierGroup], chunk: int, computed: int, limit: int,
               state: Callable[[int, int], str]) -> tuple[int | None, int]:
    """Tokens the tiers hold past the ``computed`` tokens of the GPU hit (0: no hit; None:
    the answer rests on a chunk still being written, and the request waits a step),
    looking no further than ``limit`` tokens; ``state(group, chunk index)`` says what the
    tiers hold. Also returns the keys looked up."""
    full, windows = lookup_order(groups, chunk)
    first = computed // chunk
    end, hit, defer, looked = limit, 0, False, 0
    todo = full + windows
    while todo:
        looked_window = False
        current, todo = todo, []
        for g in current:
            if end - computed < chunk:
                return 0, looked
            num_chunks = cdiv(end, chunk)
            group = groups[g]

            def of_group(i: int, g: int = g) -> str:
                return state(g, i)
            if group.is_full:
                n, pending, asked = _prefix_run(of_group, first, num_chunks)
            else:
                first_window = group.load_window_chunks(chunk, min(end, num_chunks * chunk))
                n, pending, asked = _window_run(of_group, first, num_chunks, group.window_chunks(chunk),
                                                first_window)
            looked += asked
            if n == 0:
                return 0, looked
            if pending:
                defer = True
            else:
                end = min(end, (first + n) * chunk)
            if end - computed < chunk:
                return 0, looked
            if end - computed < hit:
                if defer:
                    defer, todo = False, full + windows
                elif looked_window and not todo:
                    todo = list(windows)
            looked_window |= not group.is_full
            hit = end - computed
    return (None if defer else hit), looked


def load_plan(groups: Sequence[TierGroup], chunk: int, block: int, computed: int, end: int,
              bound: int, placed: Sequence[int]) -> list[tuple[int, int, int]]:
    """(group, chunk index, tokens it moves) of each chunk a load of tokens ``[computed,
    end)`` brings, group by group, each from the first position its blocks were placed
    for (``placed``: 0 for full attention, the window's first block for the others).
    Whole blocks of ``block`` tokens move, up to the request's ``bound``: a hit ending
    inside a block (a window model's stops a token short of its prompt) moves it too."""
    first, top = computed // chunk, min(cdiv(end, block) * block, bound)
    return [(g, i, min(top, (i + 1) * chunk) - max(computed, placed[g], i * chunk))
            for g in range(len(groups))
            for i in range(max(first, placed[g] // chunk), cdiv(end, chunk))]


def hit_spans(chunk: int, computed: int, end: int) -> list[tuple[int, int]]:
    """(chunk index, tokens of the hit in it) for a hit of tokens ``[computed, end)``."""
    return [(i, min(end, (i + 1) * chunk) - max(computed, i * chunk))
            for i in range(computed // chunk, cdiv(end, chunk))]


def serve(plan: Sequence[tuple[int, int, int]], spans: Sequence[tuple[int, int]],
          key_of: Callable[[int, int], int], source: Callable[[int], Hashable | None],
          ) -> dict[Hashable, tuple[list[int], int, int]]:
    """A load by the tier each chunk is read from (``source`` of its key): the keys it
    reads, the tokens they move (:func:`load_plan`) and the hit tokens it serves, the
    request's in the chunks it reads first; a chunk no group loads (out of every window)
    counts for the tier of the first chunk loaded."""
    out: dict[Hashable, tuple[list[int], int, int]] = {}
    first_read: dict[int, Hashable] = {}
    for g, i, moved in plan:
        key = key_of(g, i)
        tier = source(key)
        assert tier is not None, "a hit chunk is held by no tier"
        keys, total, hit = out.get(tier, ([], 0, 0))
        keys.append(key)
        out[tier] = (keys, total + moved, hit)
        first_read.setdefault(i, tier)
    for i, tokens in spans:
        tier = first_read.get(i, first_read[plan[0][1]])
        keys, total, hit = out[tier]
        out[tier] = (keys, total, hit + tokens)
    return out
