"""Step 1 of vLLM's plan (:mod:`fragsim.vllm_plan`): the block size and every layer's page.

:func:`backend_block_size` is the attention backend's preferred block on the GPU;
:func:`_layer_pages` grows it until one attention page holds a whole state, pads the
state pages to that attention page, and gives every KV-holding layer its
:class:`LayerPage` (the spec vLLM sees). Grouping the pages is
:mod:`fragsim.vllm_plan_groups`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fragsim.catalog import GPUConfig, ModelConfig
from fragsim.kinds import cdiv
from fragsim.layers import STATE_KINDS, LayerSpec

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class LayerPage:
    """One layer's KV cache spec as vLLM sees it."""

    kind: str                    # full, sliding, chunked, mla, mamba, linear
    block_size: int
    bytes_per_token: int = 0     # attention kinds
    window: int | None = None
    chunk: int | None = None
    state_bytes: int = 0         # state kinds: the real state
    page_padded: int | None = None

    @property
    def page_size_bytes(self) -> int:
        if self.page_padded is not None:
            return self.page_padded
        if self.kind in STATE_KINDS:
            return self.state_bytes
        return self.bytes_per_token * self.block_size

    @property
    def real_page_bytes(self) -> int:
        return self.state_bytes if self.kind in STATE_KINDS else self.bytes_per_token * self.block_size

    @property
    def base(self) -> str:
        """vLLM's spec class family: layers of one family can share a group."""
        return {"mla": "full", "linear": "mamba"}.get(self.kind, self.kind)


def backend_block_size(model: ModelConfig, gpu: GPUConfig) -> int:
    """The block size vLLM's default attention backend prefers on ``gpu``."""
    kinds = {layer.kind for layer in model.layer_specs}
    fp8 = model.kv_dtype_bytes == 1
    if "mla" in kinds:
        if gpu.arch == "sm90" and fp8:
            return 64          # FlashMLA
        if gpu.arch.startswith("sm10"):
            return 32          # FlashInfer MLA
    if gpu.arch == "gfx942" and model.architecture.startswith("GptOss"):
        return 64              # AITER unified attention, the one with sinks
    if (gpu.arch.startswith("sm10") and model.architecture == "Gemma3ForConditionalGeneration"
            and model.head_dim == 256):
        return 64              # Triton/FlashInfer for multimodal prefixes at head 256
    return DEFAULT_BLOCK_SIZE


def _attention_page_per_token(model: ModelConfig, tp: int) -> int:
    """One token of one attention layer, from the model-wide attention shape."""
    first = next((la for la in model.layer_specs if la.has_token_kv), None)
    if first is None:
        return 0
    if first.kind == "mla":
        return first.bytes_per_token(model.kv_dtype_bytes, tp)
    return 2 * max(1, model.num_kv_heads // tp) * first.head_dim * model.kv_dtype_bytes


def _gdn_checkpoints(model: ModelConfig, gpu: GPUConfig) -> bool:
    """Whether Gated DeltaNet's prefill runs FlashInfer's kernel, which exports the
    states inside a prefill: on sm90, and on the sm100 and sm120 families with
    128-dim keys (vLLM 0.33's CUDA 13 build); elsewhere Triton's, which does not."""
    if gpu.arch == "sm90":
        return True
    keys = {la.state.head_dim for la in model.layer_specs if la.state is not None}
    return gpu.arch.startswith(("sm10", "sm12")) and keys == {128}


def _prefill_checkpoint(model: ModelConfig, gpu: GPUConfig,
                        prefix_caching: bool) -> tuple[int, int | None]:
    """The prefill checkpoint blocks a state layer's spec adds in vLLM's align mode
    (prefix caching on) and the token alignment its kernel needs for them (None: no
    constraint on the block size)::

        variant   checkpoint blocks   alignment
        mamba1    0                   -          (the Mamba-1 mixer asks for none)
        mamba2    1                   -          (exported at any position)
        gdn       1 with FlashInfer   64         (its prefill kernel's state stride)
                  0 with Triton       -

    A request then holds up to 2 + checkpoint blocks in each state group: the state
    being read, the one being written, and the checkpoint. Without prefix caching
    (vLLM's "none" mode) a state group holds one block and no checkpoint."""
    states = [la for la in model.layer_specs if la.kind in STATE_KINDS]
    if not prefix_caching or not states:
        return 0, None
    variants = {la.state.variant if la.state is not None else None for la in states}
    if variants == {"gdn"}:
        return (1, 64) if _gdn_checkpoints(model, gpu) else (0, None)
    if variants == {"mamba2"}:
        return 1, None
    return 0, None


def _layer_pages(model: ModelConfig, gpu: GPUConfig, tp: int, prefix_caching: bool,
                 max_model_len: int, block_size: int | None) -> tuple[list[tuple[int, LayerPage]],
                                                                      int, int | None, int]:
    """Every KV-holding layer's page, the attention block size, the state block size
    and the prefill checkpoint blocks a state layer adds (:func:`_prefill_checkpoint`)."""
    kv = model.kv_dtype_bytes
    bs = backend_block_size(model, gpu) if block_size is None else block_size
    states = [la for la in model.layer_specs if la.kind in STATE_KINDS]
    mamba_block: int | None = None
    padded: int | None = None
    checkpoint, ckpt_align = _prefill_checkpoint(model, gpu, prefix_caching)
    if states:
        state_page = max(la.state_bytes(model.dtype_bytes, tp) for la in states)
        per_token = _attention_page_per_token(model, tp)
        if per_token:
            align = max(bs, DEFAULT_BLOCK_SIZE)
            if any(la.kind == "mla" for la in model.layer_specs):
                align = max(align, 128)
            if ckpt_align is not None:
                align = math.lcm(align, ckpt_align)
            need = align * cdiv(state_page, align * per_token)
            need = DEFAULT_BLOCK_SIZE * cdiv(need, DEFAULT_BLOCK_SIZE)
            bs = max(bs, need)
            if bs * per_token != state_page:
                padded = bs * per_token
        mamba_block = bs if prefix_caching else max_model_len
    pages = []
    for i, layer in enumerate(model.layer_specs):
        if layer.kind == "shared":
            continue       # reads its target's KV: no spec, no memory
        pages.append((i, _page_of(layer, model, tp, kv, bs, mamba_block, padded)))
    return pages, bs, mamba_block, checkpoint


def _page_of(layer: LayerSpec, model: ModelConfig, tp: int, kv: int, bs: int,
             mamba_block: int | None, padded: int | None) -> LayerPage:
    if layer.kind in STATE_KINDS:
        assert mamba_block is not None
        return LayerPage(layer.kind, mamba_block, state_bytes=layer.state_bytes(model.dtype_bytes, tp),
                         page_padded=padded)
    return LayerPage(layer.kind, bs, bytes_per_token=layer.bytes_per_token(kv, tp),
                     window=layer.window, chunk=layer.chunk)
