"""One KV pool for every layer kind, as vLLM 0.33's hybrid KV cache manager plans it.

vLLM gives each layer a spec (full, sliding window, chunked local, MLA, Mamba) and
turns them into one pool of equal blocks. The steps, in the order vLLM takes them:

1. **Block size.** The attention backend's preferred size on the GPU (16 tokens,
   except FlashMLA with an fp8 cache on sm90: 64, FlashInfer MLA on sm100: 32,
   AITER's sink attention on MI300X: 64). With state layers the block grows until
   one attention page holds a whole state::

       align      = max(16, block_size)            (× lcm with 64 for Gated DeltaNet
                                                    checkpoints under prefix caching)
       block_size = align × ceil(state_bytes / (align × attention_bytes_per_token))

   and every state page is padded to that attention page. Without prefix caching
   a state layer's block spans the whole ``max_model_len``; with it, the block size.
2. **Groups.** Layers with equal specs form buckets. All equal: one group. Else the
   page sizes are unified (a smaller attention page scales its block size by the
   ratio, a state page is padded) and every bucket is cut into groups of
   ``min(bucket sizes)`` layers (``max`` when that is under 1.5 × min); a short
   last group is padded with phantom layers::

       gemma-3-27b: 52 sliding + 10 full → 6 sliding groups (9,9,9,9,8,8) + 1 full (10):
                    every group costs 10 pages a block, 8 pages of padding in all

   Llama 4's chunked layers are treated as full attention: vLLM turns its hybrid
   manager off for chunked local attention unless told to keep it.
3. **Pool.** One block is one page in every layer slot of a group::

       bytes_per_block = max over groups of (pages in the group)
       num_gpu_blocks  = kv_cache_memory_bytes // bytes_per_block   (block 0 is vLLM's null block)

4. **Concurrency** (vLLM's "Maximum concurrency for N tokens per request")::

       blocks a request may need = Σ_groups  full/MLA  ceil(max_model_len / B)
                                             sliding   ceil(min(W − 1 + in_flight, L_max) / B) + 1
                                             chunked   ceil(min(C + in_flight, L_max) / B)
                                             state     1 without prefix caching; with it
                                                       2 + its prefill checkpoint blocks
       max_concurrency = num_gpu_blocks / that
       "GPU KV cache size" = int(max_concurrency × max_model_len) tokens

   where ``in_flight`` is the batched tokens of the steps in flight (2 × with async
   scheduling), and the checkpoint blocks are 1 for Mamba-2 (Nemotron-H, Falcon-H1,
   Granite 4 hybrids; vLLM 0.33 no longer serves Bamba) and for Gated DeltaNet under
   FlashInfer's prefill, 0 for Mamba-1 (Jamba)::

       nemotron-h-56b, H200, max_model_len 8,192, prefix caching: 4,128-token blocks,
       6 Mamba-2 groups × (2 + 1) + 1 full group × ceil(8,192 / 4,128) = 20 blocks;
       381 blocks / 20 = 19.05x, int(19.05 × 8,192) = 156,057 tokens

5. **Blocks held** by a sequence that has stored L tokens and computes token L+1
   (:meth:`VllmPlan.blocks_per_seq`), as ``allocate_slots`` leaves them with no step
   in flight: full ``ceil((L+1)/B)``; sliding drops ``⌊(L − W + 1)/B⌋`` leading
   blocks; chunked drops the blocks of finished chunks; state keeps 1 (2 while it
   copies into a fresh block at a block boundary under prefix caching). A prompt's
   own step (:meth:`VllmPlan.blocks_at_prompt`) also holds a state group's
   checkpoint block once the prompt passes one block.

Written from vLLM's design doc and ``vllm/v1/core/kv_cache_planning.py``, read for
understanding; no vLLM code is used. Pure arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fragsim.catalog import GPUConfig, ModelConfig
from fragsim.errors import FragsimError
from fragsim.kinds import Kind, State, cdiv, rule_of

# Where it lives: step 1 (block size, each layer's page) in fragsim.vllm_plan_pages,
# step 2 (groups) in fragsim.vllm_plan_groups; steps 3-5 (pool, concurrency, blocks
# held) and the summary here. Their names are re-exported: fragsim.vllm_plan is where
# callers look.
from fragsim.vllm_plan_groups import KVGroup, _group, _promote_local
from fragsim.vllm_plan_pages import (  # noqa: F401
    DEFAULT_BLOCK_SIZE,
    LayerPage,
    _layer_pages,
    backend_block_size,
)

GiB = 1 << 30


def default_max_num_batched_tokens(gpu: GPUConfig) -> int:
    """``vllm serve``'s token budget by card: 16,384 from 160 GiB (B200, MI300X),
    8,192 from 70 GiB except A100s (H100, H200), else 2,048."""
    if gpu.memory_bytes >= 160 * GiB:
        return 16384
    if gpu.memory_bytes >= 70 * GiB and gpu.arch != "sm80":
        return 8192
    return 2048


@dataclass(frozen=True)
class VllmPlan:
    """The pool vLLM would build, and what one sequence holds in it."""

    block_size: int                     # attention block size
    mamba_block_size: int | None
    groups: tuple[KVGroup, ...]
    page_size_bytes: int                # one block of one layer (the unified page)
    bytes_per_block: int                # one block across one layer slot of every group
    kv_cache_memory_bytes: int
    num_gpu_blocks: int
    max_model_len: int
    max_num_batched_tokens: int
    in_flight_tokens: int
    prefix_caching: bool
    hybrid_manager: bool                # False: every attention layer allocated as full
    blocks_per_request: int             # Σ over groups of the most a request needs
    num_prefill_checkpoint_blocks: int
    notes: tuple[str, ...] = field(default=())

    @property
    def max_concurrency(self) -> float:
        return self.num_gpu_blocks / self.blocks_per_request if self.blocks_per_request else 0.0

    @property
    def kv_cache_tokens(self) -> int:
        """vLLM's "GPU KV cache size: N tokens": concurrency × max_model_len."""
        return int(self.max_concurrency * self.max_model_len)

    @property
    def padding_bytes_per_block(self) -> int:
        """Bytes of a block that hold nothing: phantom layers and padded state pages."""
        pad = 0
        for g in self.groups:
            pad += g.num_padding_layers * g.page.page_size_bytes
            pad += g.num_layers * (g.page.page_size_bytes - g.page.real_page_bytes)
        return pad

    def blocks_per_seq(self, seq_len: int) -> list[int]:
        """Blocks each group holds for a sequence that has stored ``seq_len`` tokens
        and computes the next one, as ``allocate_slots`` leaves them."""
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise FragsimError(f"seq_len (--seq-len) must be an integer >= 1, got {seq_len!r}")
        return [int(self.rule(g).held_blocks(seq_len, self.max_model_len, g.page.block_size))
                for g in self.groups]

    def blocks_at_prompt(self, prompt_len: int) -> list[int]:
        """Blocks each group holds for a sequence whose ``prompt_len``-token prompt is
        computed in one step, once ``allocate_slots`` has allocated it."""
        if not isinstance(prompt_len, int) or isinstance(prompt_len, bool) or prompt_len < 1:
            raise FragsimError(f"prompt_len must be an integer >= 1, got {prompt_len!r}")
        return [int(self.rule(g).prompt_blocks(prompt_len, self.max_model_len, g.page.block_size))
                for g in self.groups]

    def rule(self, group: KVGroup) -> Kind:
        """The memory rule of ``group``'s layers under this plan."""
        return page_rule(group.page, self.prefix_caching, self.num_prefill_checkpoint_blocks)


def page_rule(page: LayerPage, prefix_caching: bool, checkpoint: int = 0) -> Kind:
    """The memory rule of a page's layers (:mod:`fragsim.kinds`): state layers run in
    vLLM's align mode under prefix caching, with ``checkpoint`` prefill checkpoint blocks."""
    if page.base == "mamba":
        return State(align=prefix_caching, checkpoints=checkpoint)
    return rule_of(page.kind, page.window, page.chunk)


def _max_blocks(page: LayerPage, max_model_len: int, in_flight: int, checkpoint: int,
                prefix_caching: bool) -> int:
    return page_rule(page, prefix_caching, checkpoint).max_blocks(max_model_len, page.block_size, in_flight)


def plan_vllm(
    model: ModelConfig,
    gpu: GPUConfig,
    kv_cache_memory_bytes: int,
    *,
    tp: int = 1,
    max_model_len: int | None = None,
    prefix_caching: bool = True,
    max_num_batched_tokens: int | None = None,
    async_scheduling: bool = True,
    block_size: int | None = None,
    hybrid_manager: bool | None = None,
    chunked_hybrid: bool = True,
) -> VllmPlan:
    """vLLM's KV cache groups, page size, block count and concurrency for ``model``
    on one ``tp`` rank of ``gpu`` with ``kv_cache_memory_bytes`` for the pool.

    ``hybrid_manager=None`` follows vLLM 0.33: on, and for chunked local attention as
    ``chunked_hybrid`` says (``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE``,
    which defaults to 1 in vLLM 0.33's ``vllm/envs.py``).
    ``block_size=None`` takes the backend's default (a user's ``--block-size``
    may still be raised for state layers, as vLLM does).
    """
    if not isinstance(kv_cache_memory_bytes, int) or kv_cache_memory_bytes < 0:
        raise FragsimError("kv_cache_memory_bytes (--kv-cache-memory-bytes) must be an integer "
                           f">= 0, got {kv_cache_memory_bytes!r}")
    model.kv_heads_per_gpu(tp)
    mml = model.max_position_embeddings if max_model_len is None else max_model_len
    mnbt = default_max_num_batched_tokens(gpu) if max_num_batched_tokens is None \
        else max_num_batched_tokens
    in_flight = (2 if async_scheduling else 1) * mnbt
    notes: list[str] = []
    pages, bs, mamba_block, checkpoint = _layer_pages(model, gpu, tp, prefix_caching, mml,
                                                      block_size)
    if not pages:
        raise FragsimError(f"{model.name} keeps no KV cache or state; there is no pool to plan")
    has_chunked = any(p.kind == "chunked" for _, p in pages)
    if hybrid_manager is None:
        hybrid_manager = chunked_hybrid or not has_chunked
        if has_chunked and not chunked_hybrid:
            notes.append("the hybrid KV cache manager is off for chunked local attention "
                         "(VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0, "
                         "--no-hybrid-chunked here): chunked layers hold every token's KV")
    if not hybrid_manager:
        if any(p.base == "mamba" for _, p in pages):
            raise FragsimError(f"{model.name} has state layers, which need vLLM's hybrid KV "
                               "cache manager; it cannot be turned off")
        pages = _promote_local(pages)
    groups = _group(pages)
    page_size = max(g.page.page_size_bytes for g in groups)
    bytes_per_block = max((g.num_layers + g.num_padding_layers) * g.page.page_size_bytes
                          for g in groups)
    num_blocks = kv_cache_memory_bytes // bytes_per_block
    per_request = sum(_max_blocks(g.page, mml, in_flight, checkpoint, prefix_caching)
                      for g in groups)
    if mamba_block is not None and bs > (block_size or backend_block_size(model, gpu)):
        notes.append(f"attention blocks grow to {bs:,} tokens so that one attention page holds a "
                     "whole state")
    if num_blocks - 1 < per_request:
        notes.append(f"one {mml:,}-token request needs {per_request:,} blocks but the pool has "
                     f"{max(0, num_blocks - 1):,} usable: vLLM would refuse to start "
                     "(lower --max-seq-len or give more memory)")
    return VllmPlan(
        block_size=bs, mamba_block_size=mamba_block, groups=tuple(groups),
        page_size_bytes=page_size, bytes_per_block=bytes_per_block,
        kv_cache_memory_bytes=kv_cache_memory_bytes, num_gpu_blocks=num_blocks,
        max_model_len=mml, max_num_batched_tokens=mnbt, in_flight_tokens=in_flight,
        prefix_caching=prefix_caching, hybrid_manager=hybrid_manager,
        blocks_per_request=per_request, num_prefill_checkpoint_blocks=checkpoint,
        notes=tuple(notes),
    )


def bytes_per_token_by_kind(model: ModelConfig, tp: int = 1) -> dict[str, int]:
    """KV bytes one token costs on one GPU, summed over the layers of each kind."""
    out: dict[str, int] = {}
    for layer in model.layer_specs:
        if layer.has_token_kv:
            out[layer.kind] = out.get(layer.kind, 0) + layer.bytes_per_token(model.kv_dtype_bytes, tp)
    return out


def state_bytes_per_seq(model: ModelConfig, tp: int = 1) -> int:
    """Fixed state bytes one sequence holds on one GPU, over all state layers."""
    return sum(la.state_bytes(model.dtype_bytes, tp) for la in model.layer_specs)


def plan_summary(plan: VllmPlan, model: ModelConfig, tp: int, seq_len: int | None,
                 naive_block_size: int) -> dict[str, Any]:
    """The figures ``fragsim capacity --json`` carries, under vLLM's names."""
    naive_block_bytes = model.kv_bytes_per_token_per_gpu(tp) * naive_block_size
    held = None if seq_len is None else plan.blocks_per_seq(seq_len)
    out: dict[str, Any] = {
        "num_gpu_blocks": plan.num_gpu_blocks,
        "block_size": plan.block_size,
        "mamba_block_size": plan.mamba_block_size,
        "kv_cache_groups": [
            {"kind": g.kind, "num_layers": g.num_layers, "num_padding_layers": g.num_padding_layers,
             "sliding_window": g.page.window, "block_size": g.page.block_size,
             "layers": list(g.layers)} for g in plan.groups],
        "page_size_bytes": plan.page_size_bytes,
        "bytes_per_block": plan.bytes_per_block,
        "padding_bytes_per_block": plan.padding_bytes_per_block,
        "kv_cache_memory_bytes": plan.kv_cache_memory_bytes,
        "max_concurrency": plan.max_concurrency,
        "kv_cache_tokens": plan.kv_cache_tokens,
        "blocks_per_request": plan.blocks_per_request,
        "max_num_batched_tokens": plan.max_num_batched_tokens,
        "in_flight_tokens": plan.in_flight_tokens,
        "prefix_caching": plan.prefix_caching,
        "hybrid_kv_cache_manager": plan.hybrid_manager,
        "seq_len": seq_len,
        "blocks_per_seq": None if seq_len is None else [
            {"kind": g.kind, "blocks": n} for g, n in zip(plan.groups, plan.blocks_per_seq(seq_len), strict=False)],
        "bytes_per_token_by_kind": bytes_per_token_by_kind(model, tp),
        "state_bytes_per_seq": state_bytes_per_seq(model, tp),
        "naive_bytes_per_token": model.kv_bytes_per_token_per_gpu(tp),
        "naive_block_size": naive_block_size,
        "naive_num_gpu_blocks": plan.kv_cache_memory_bytes // naive_block_bytes,
        "naive_max_concurrency": (plan.kv_cache_memory_bytes // naive_block_bytes)
        / cdiv(plan.max_model_len, naive_block_size),
        "vllm_notes": list(plan.notes),
    }
    if held is not None:
        out["bytes_per_seq"] = sum(n * (g.num_layers + g.num_padding_layers) * g.page.page_size_bytes
                                   for g, n in zip(plan.groups, held, strict=True))
    return out
