"""A checkpoint's weights as vLLM loads them: what each tensor-parallel rank holds.

A model's weights are a list of :class:`WeightGroup`: the parameters of one kind of
tensor, how tensor parallelism places them, and how many bytes a parameter takes in
the format the checkpoint declares. ``fragsim capacity`` sums them per rank; the
total over the groups that are parameters is ``ModelConfig.num_params``.

How vLLM's layers place a group across ``tp`` ranks (``split``)::

    shard      1/tp on each rank: ColumnParallelLinear / RowParallelLinear (Q and O
               projections, dense and expert MLPs, MLA's up-projections, Mamba's)
    kv         the K and V projections: kv_heads/tp heads a rank, one whole head a
               rank once tp passes num_kv_heads (QKVParallelLinear replicates it)
    vocab      VocabParallelEmbedding and ParallelLMHead: rows padded to a multiple
               of 64 (DEFAULT_VOCAB_PADDING_SIZE), then 1/tp of them on each rank
    replicate  every rank a whole copy: norms, MoE routers, MLA's down-projections
               (ReplicatedLinear), the rotary cos/sin cache

Bytes per parameter by format (``quantization_config`` of the checkpoint)::

    none                 the model dtype (2 B for bf16)
    fp8 per tensor       1 B (one fp32 scale a tensor, not counted)
    fp8 block b×b        1 B + 4 B / b²        (DeepSeek V3, Qwen3 FP8: 128×128)
    fp8 per channel      1 B + 4 B / in        (compressed-tensors FP8, RedHat's)
    int4 group g         ½ B + 2 B / g scales (+ ½ B / g zero points when asymmetric)
                         (AWQ, GPTQ, compressed-tensors W4A16)
    mxfp4                ½ B + 1 B / 32        (gpt-oss experts: one E8M0 scale a 32)

Quantized checkpoints leave the embeddings, the LM head, norms and MoE routers in
the model dtype (and whatever the config lists as ignored); :func:`format_of`
reads which layers a config quantizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from fragsim.errors import FragsimError

#: vLLM pads embedding and LM-head rows to a multiple of this (DEFAULT_VOCAB_PADDING_SIZE)
VOCAB_PADDING = 64
SPLITS = ("shard", "kv", "vocab", "replicate")


@dataclass(frozen=True)
class WeightGroup:
    """Parameters of one kind of tensor, across the whole model.

    ``bytes_per_param`` is ``None`` for the model dtype. ``rows`` is the vocabulary
    of a ``vocab`` group (each row ``params // rows`` wide). ``buffer`` marks a
    tensor that is not a parameter (the rotary cache): loaded, not counted in
    ``num_params``.
    """

    name: str
    params: int
    split: str
    bytes_per_param: Fraction | None = None
    rows: int = 0
    extra: bool = False

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        if self.params < 0:
            raise ValueError(f"params must be >= 0, got {self.params}")
        if self.split == "vocab" and (self.rows < 1 or self.params % self.rows):
            raise ValueError(f"a vocab group needs rows dividing its params, got {self.rows}")


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def group_bytes_per_rank(group: WeightGroup, tp: int, dtype_bytes: int,
                         kv_share: Fraction) -> int:
    """Bytes of ``group`` on one of ``tp`` ranks; ``kv_share`` is the fraction of the
    KV heads a rank holds (:meth:`ModelConfig.kv_heads_per_gpu` / num_kv_heads)."""
    per = Fraction(dtype_bytes) if group.bytes_per_param is None else group.bytes_per_param
    if group.split == "vocab":
        width = group.params // group.rows
        params = Fraction(-(-_pad(group.rows, VOCAB_PADDING) // tp) * width)
    elif group.split == "shard":
        params = Fraction(group.params, tp)
    elif group.split == "kv":
        params = group.params * kv_share
    else:
        params = Fraction(group.params)
    return math.ceil(params * per)


# ---------------------------------------------------------------- quantization formats

@dataclass(frozen=True)
class QuantFormat:
    """How a checkpoint stores its quantized linear layers."""

    name: str                      # as logged: fp8, mxfp4, awq, gptq, compressed-tensors
    linear: Fraction | None        # bytes a parameter of a quantized linear layer; None: dtype
    experts_only: bool = False     # mxfp4 (gpt-oss): only the experts are quantized
    ignored: tuple[str, ...] = ()  # module names the config keeps unquantized


def _int4(quant: dict[str, Any], where: str, bits: Any, group: Any, zero_point: bool) -> Fraction:
    if bits not in (4, 8):
        raise FragsimError(f"{where}: quantization_config bits must be 4 or 8, got {bits!r}")
    g = group if isinstance(group, int) and group > 0 else 0
    scales = Fraction(2, g) if g else Fraction(0)
    zeros = Fraction(bits, 8 * g) if g and zero_point else Fraction(0)
    return Fraction(bits, 8) + scales + zeros


def format_of(raw: dict[str, Any], where: str, hidden_size: int) -> QuantFormat:
    """The quantization format a config declares (``none`` when it declares none).

    Unknown methods are refused by name rather than guessed."""
    quant = raw.get("quantization_config")
    if not quant:
        return QuantFormat("none", None)
    if not isinstance(quant, dict):
        raise FragsimError(f"{where}: field 'quantization_config' must be a table, got {quant!r}")
    method = str(quant.get("quant_method", "")).lower()
    ignored = tuple(str(x) for x in (quant.get("ignored_layers") or quant.get("ignore")
                                     or quant.get("modules_to_not_convert") or ()))
    if method == "fp8":
        block = quant.get("weight_block_size")
        if isinstance(block, list) and len(block) == 2:
            return QuantFormat("fp8", 1 + Fraction(4, block[0] * block[1]), ignored=ignored)
        return QuantFormat("fp8", Fraction(1), ignored=ignored)
    if method == "mxfp4":
        return QuantFormat("mxfp4", Fraction(1, 2) + Fraction(1, 32), experts_only=True,
                           ignored=ignored)
    if method in ("awq", "gptq"):
        bits = quant.get("bits", quant.get("w_bit", 4))
        group = quant.get("group_size", quant.get("q_group_size", 128))
        zero = bool(quant.get("zero_point", True)) if method == "awq" else not quant.get("sym", True)
        return QuantFormat(method, _int4(quant, where, bits, group, zero), ignored=ignored)
    if method == "compressed-tensors":
        groups = quant.get("config_groups") or {}
        first: dict[str, Any] = next(iter(groups.values()), {}) if isinstance(groups, dict) else {}
        w = first.get("weights") or {}
        bits, kind = w.get("num_bits", 8), w.get("type", "float")
        strategy = w.get("strategy", "tensor")
        if bits == 8 and kind == "float":
            scale = Fraction(4, hidden_size) if strategy == "channel" else Fraction(0)
            if strategy == "block" and isinstance(w.get("block_structure"), list):
                b = w["block_structure"]
                scale = Fraction(4, b[0] * b[1])
            return QuantFormat("compressed-tensors", 1 + scale, ignored=ignored)
        if bits == 8:
            return QuantFormat("compressed-tensors", 1 + Fraction(4, hidden_size), ignored=ignored)
        if bits == 4 and kind == "float":   # NVFP4: ½ B + one fp8 scale a 16
            return QuantFormat("compressed-tensors", Fraction(1, 2) + Fraction(1, 16),
                               ignored=ignored)
        group = w.get("group_size") or 0
        return QuantFormat("compressed-tensors",
                           _int4(quant, where, bits, group, not w.get("symmetric", True)),
                           ignored=ignored)
    if method in ("modelopt", "modelopt_fp4", "nvfp4"):
        algo = str(quant.get("quant_algo", method)).upper()
        if "FP8" in algo:
            return QuantFormat("modelopt", Fraction(1), ignored=ignored)
        return QuantFormat("modelopt", Fraction(1, 2) + Fraction(1, 16), ignored=ignored)
    if method == "bitsandbytes":
        four = bool(quant.get("load_in_4bit"))
        return QuantFormat("bitsandbytes", Fraction(1, 2) + Fraction(4, 64) if four else Fraction(1),
                           ignored=ignored)
    raise FragsimError(
        f"{where}: quantization_config quant_method {method!r} is not one fragsim reads; "
        "known: fp8, mxfp4, awq, gptq, compressed-tensors, modelopt, bitsandbytes")


def _ignored(fmt: QuantFormat, *names: str) -> bool:
    """Whether the config keeps modules of these names unquantized."""
    return any(n in entry for entry in fmt.ignored for n in names)


def quantize(groups: list[WeightGroup], fmt: QuantFormat) -> list[WeightGroup]:
    """``groups`` with the bytes a parameter of ``fmt`` takes where it applies:
    linear layers (experts alone for mxfp4), never embeddings, LM head, norms,
    routers, the rotary cache or a vision tower, nor the modules the config ignores."""
    if fmt.linear is None:
        return groups
    keep = {"embed_tokens", "lm_head", "norms", "router", "rotary_cache", "positions", "vision"}
    attention_ignored = _ignored(fmt, "self_attn", "attn")
    out = []
    for g in groups:
        plain = g.name in keep or g.extra or (fmt.experts_only and g.name != "experts") or (
            g.name.startswith("attention") and attention_ignored)
        out.append(g if plain else WeightGroup(g.name, g.params, g.split, fmt.linear, g.rows, g.extra))
    return out


# ---------------------------------------------------------------- a model's groups

def dense_groups(*, num_layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, vocab: int, tied: bool, gated: bool, num_params: int,
                 rotary: tuple[int, int] | None) -> list[WeightGroup]:
    """The groups of a dense decoder whose total is ``num_params`` (what the
    architecture leaves out, biases and the like, is put with the sharded layers).
    ``rotary`` is (positions, rotary dim) of its cos/sin cache, if it has one."""
    groups = [
        WeightGroup("embed_tokens", vocab * hidden, "vocab", rows=vocab),
        WeightGroup("attention", num_layers * 2 * hidden * heads * head_dim, "shard"),
        WeightGroup("attention.kv", num_layers * 2 * hidden * kv_heads * head_dim, "kv"),
        WeightGroup("mlp", num_layers * (3 if gated else 2) * hidden * intermediate, "shard"),
        WeightGroup("norms", (2 * num_layers + 1) * hidden, "replicate"),
    ]
    if not tied:
        groups.insert(1, WeightGroup("lm_head", vocab * hidden, "vocab", rows=vocab))
    rest = num_params - sum(g.params for g in groups)
    if rest > 0:
        groups.append(WeightGroup("other", rest, "shard"))
    if rotary is not None:
        groups.append(rotary_group(*rotary))
    return groups


def rotary_group(positions: int, rotary_dim: int, dtype_bytes: int | None = None,
                 copies: int = 1) -> WeightGroup:
    """vLLM's rotary embedding keeps a ``positions × rotary_dim`` cos/sin cache on
    every rank (``RotaryEmbedding.cos_sin_cache``), one per distinct rope setting."""
    per = None if dtype_bytes is None else Fraction(dtype_bytes)
    return WeightGroup("rotary_cache", copies * positions * rotary_dim, "replicate", per,
                       extra=True)


def params_of(groups: tuple[WeightGroup, ...] | list[WeightGroup]) -> int:
    """Parameters of ``groups`` (what is ``extra`` left out)."""
    return sum(g.params for g in groups if not g.extra)


def groups_of(model: Any) -> tuple[WeightGroup, ...]:
    """``model``'s weight groups: those read from its config.json, else a dense
    decoder's from its dimensions (the presets written out in
    :mod:`fragsim.catalog`, a catalog TOML's models)."""
    if model.weights:
        return tuple(model.weights)
    # the written-out presets with a plain MLP are OPT: tied embeddings, learned
    # positions (counted in num_params), no rotary cache
    tied = model.architecture.startswith("OPT") or not model.gated_mlp
    groups = dense_groups(
        num_layers=model.num_layers, hidden=model.hidden_size, heads=model.num_heads,
        kv_heads=model.num_kv_heads, head_dim=model.head_dim,
        intermediate=model.intermediate_size, vocab=model.vocab_size, tied=tied,
        gated=model.gated_mlp, num_params=model.num_params,
        rotary=None if tied else (model.max_position_embeddings, model.head_dim))
    if model.checkpoint_bytes is not None and model.checkpoint_bytes != model.num_params * model.dtype_bytes:
        # a quantized custom entry: spread its bytes over the parameters evenly
        per = Fraction(model.checkpoint_bytes, model.num_params)
        groups = [g if g.extra else WeightGroup(g.name, g.params, g.split, per, g.rows)
                  for g in groups]
    return tuple(groups)


def weight_bytes_per_rank(model: Any, tp: int) -> int:
    """Bytes of ``model``'s weights (and loaded buffers) on one of ``tp`` ranks."""
    share = Fraction(model.kv_heads_per_gpu(tp), model.num_kv_heads)
    return sum(group_bytes_per_rank(g, tp, model.dtype_bytes, share) for g in groups_of(model))


def vision_group(vision: dict[str, Any], text_hidden: int) -> WeightGroup | None:
    """A vision tower and its projector, estimated from a ``vision_config`` as a ViT:
    ``layers × (4 h² + 2 h i)`` (attention and MLP), the patch embedding
    ``3 p² h``, the position table ``(image / p)² h`` and a projection ``h ×
    text hidden``. vLLM loads it in the model dtype and shards its linear layers."""
    def first(*keys: str) -> int:
        for key in keys:
            value = vision.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return 0
    h = first("hidden_size", "embed_dim", "hidden_dim", "width")
    layers = first("num_hidden_layers", "depth", "num_layers")
    if not h or not layers:
        return None
    ratio = vision.get("mlp_ratio")
    inter = first("intermediate_size") or int(h * (ratio if isinstance(ratio, (int, float)) else 4))
    patch = first("patch_size") or 14
    image = first("image_size")
    params = layers * (4 * h * h + 2 * h * inter) + 3 * patch * patch * h + h * text_hidden
    if image:
        params += (image // patch) ** 2 * h
    return WeightGroup("vision", params, "shard", extra=True)


def with_online_quantization(model: Any, method: str | None) -> Any:
    """``model`` as vLLM serves it with ``--quantization fp8`` over an unquantized
    checkpoint: linear layers in one byte (per-tensor scales), the rest as loaded."""
    import dataclasses

    if not method or method in ("none", "auto"):
        return model
    if method != "fp8":
        raise FragsimError(f"quantization (--quantization) must be fp8 for an unquantized "
                           f"checkpoint, got {method!r}")
    groups = groups_of(model)
    if any(g.bytes_per_param is not None and not g.extra for g in groups):
        return model            # the checkpoint is quantized already; vLLM keeps its format
    return dataclasses.replace(model, weights=tuple(quantize(list(groups), QuantFormat("fp8", Fraction(1)))))
