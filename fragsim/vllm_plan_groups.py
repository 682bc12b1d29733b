"""Step 2 of vLLM's plan (:mod:`fragsim.vllm_plan`): the layers' pages cut into KV cache groups.

Layers with equal specs form buckets; unequal page sizes are unified
(:func:`_unify_pages`) and every bucket is cut into groups, the narrower ones padded
with phantom layers to the widest (:func:`_group`, giving :class:`KVGroup`). With the
hybrid manager off, sliding and chunked layers are allocated as full attention
first (:func:`_promote_local`). The pages are :mod:`fragsim.vllm_plan_pages`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fragsim.errors import FragsimError
from fragsim.kinds import cdiv
from fragsim.vllm_plan_pages import LayerPage


@dataclass(frozen=True)
class KVGroup:
    kind: str
    layers: tuple[int, ...]           # model layer indices
    page: LayerPage
    num_padding_layers: int

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def _promote_local(pages: list[tuple[int, LayerPage]]) -> list[tuple[int, LayerPage]]:
    """With the hybrid manager off, sliding and chunked layers next to full ones are
    allocated as full attention (their compute keeps its window)."""
    kinds = {p.kind for _, p in pages}
    if "full" not in kinds or not kinds & {"sliding", "chunked"}:
        return pages
    return [(i, replace(p, kind="full", window=None, chunk=None) if p.kind in ("sliding", "chunked")
             else p) for i, p in pages]


def _unify_pages(pages: list[tuple[int, LayerPage]]) -> list[tuple[int, LayerPage]]:
    top = max(p.page_size_bytes for _, p in pages)
    out = []
    for i, p in pages:
        size = p.page_size_bytes
        if size == top:
            out.append((i, p))
        elif p.base == "mamba":
            out.append((i, replace(p, page_padded=top)))
        elif top % size == 0:
            out.append((i, replace(p, block_size=p.block_size * (top // size))))
        elif p.kind != "mla":
            out.append((i, replace(p, page_padded=top)))
        else:
            raise FragsimError(f"layer {i} (MLA): its {size:,} B page does not divide the largest "
                               f"page ({top:,} B); vLLM cannot put these layers in one pool")
    return out


def _group(pages: list[tuple[int, LayerPage]]) -> list[KVGroup]:
    specs = {p for _, p in pages}
    if len(specs) == 1 or (len({p.base for p in specs}) == 1
                           and len({p.block_size for p in specs}) == 1
                           and len({p.page_size_bytes for p in specs}) == 1):
        first = pages[0][1]
        return [KVGroup(first.kind, tuple(i for i, _ in pages), first, 0)]
    pages = _unify_pages(pages)
    buckets: dict[LayerPage, list[int]] = {}
    for i, p in pages:
        buckets.setdefault(p, []).append(i)
    sizes = [len(v) for v in buckets.values()]
    group_size = min(sizes)
    if max(sizes) < group_size * 1.5:
        group_size = max(sizes)
    groups = []
    for page, members in buckets.items():
        n = cdiv(len(members), group_size)
        for k in range(n):
            chunk = tuple(members[k::n])
            groups.append(KVGroup(page.kind, chunk, page, 0))
    widest = max(g.num_layers for g in groups)
    return [replace(g, num_padding_layers=widest - g.num_layers) for g in groups]
