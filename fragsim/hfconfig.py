"""Models from a Hugging Face ``config.json``: the layer kinds, dimensions and dtype
that the KV cache depends on. The file is the user's; nothing is fetched.

``read_hf_config(path)`` takes a ``config.json`` or a directory that holds one and
returns a :class:`fragsim.configs.ModelConfig` with its :attr:`layers`.

The file is read as transformers reads it: its config class (by ``model_type``, or
by the architecture's model type when the file has none) fills in every field the
file leaves out and derives ``layer_types`` from the pattern, interval and
``no_rope_layers`` fields (Gemma 2 and 3, Llama 4, Qwen3-Next, Jamba, Bamba,
Nemotron-H, Granite hybrids, ...). transformers is imported only here, when a
config.json is read, and nothing is fetched (the config class is built from the
file's own fields). Each layer type then maps to a layer kind::

    full_attention       full          sliding_attention   sliding (``sliding_window``)
    chunked_attention    chunked (``attention_chunk_size``)
    linear_attention     a state layer: Mamba-1 (Jamba), Mamba-2 (Bamba, Nemotron-H,
                         Granite hybrids, Falcon-H1) or Gated DeltaNet (Qwen3-Next)
    hybrid               attention and a Mamba-2 mixer side by side (Falcon-H1)
    mlp, moe             no cache (Nemotron-H's MLP and expert layers)

A config with no layer types is all full attention, or all sliding when it sets a
model-wide ``sliding_window`` (vLLM's rule for Mistral v0.1; Qwen2/3 switch it off
with ``use_sliding_window = false``). DeepSeek V2 / V3 layers are MLA
(``kv_lora_rank`` + ``qk_rope_head_dim`` per token). Any other decoder-only
architecture whose config has the standard fields (layers, heads, KV heads, head
dim, layer types, sliding window) needs no entry of its own.

Multimodal wrappers are read through their ``text_config``, with its defaults filled
in (a vision tower's weights are not counted). ``num_params`` is estimated from the
architecture by :mod:`fragsim.hfconfig_weights` (embeddings, attention or MLA, dense
or expert MLPs, Mamba and DeltaNet projections, RMSNorms; biases and MLA's small
norms left out): exact for Llama and Qwen3, and ``checkpoint_bytes`` follows
``quantization_config``: FP8 checkpoints keep one byte a weight, MXFP4 experts
(gpt-oss) 4.25 bits.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from fragsim.errors import FragsimError
from fragsim.layers import LayerSpec, StateShape, full, mla, sliding, state_layer
from fragsim.layers import chunked as chunked_layer

_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4, "half": 2, "float": 4}


class _Config:
    """One config table, whose every missing or mistyped field names itself."""

    def __init__(self, raw: dict[str, Any], where: str, arch: str) -> None:
        self.raw, self.where, self.arch = raw, where, arch

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def integer(self, key: str, default: int | None = None, low: int = 1) -> int:
        value = self.raw.get(key)
        if value is None:
            if default is None:
                raise FragsimError(f"{self.where}: missing field {key!r} (needed for {self.arch})")
            return default
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise FragsimError(f"{self.where}: field {key!r} must be an integer >= {low}, "
                               f"got {value!r}")
        return value

    def seq(self, key: str, length: int | None = None) -> list[Any]:
        value = self.raw.get(key)
        if not isinstance(value, list):
            raise FragsimError(f"{self.where}: field {key!r} must be a list, got {value!r}")
        if length is not None and len(value) != length:
            raise FragsimError(f"{self.where}: field {key!r} must have num_hidden_layers = "
                               f"{length} entries, got {len(value)}")
        return value


def _attention_dims(c: _Config) -> tuple[int, int, int]:
    heads = c.integer("num_attention_heads")
    kv_heads = c.integer("num_key_value_heads", heads)
    head_dim = c.integer("head_dim", 0, low=0) or c.integer("hidden_size") // heads
    return heads, kv_heads, head_dim


# ---------------------------------------------------------------- reading as transformers does

def _model_type(raw: dict[str, Any], arch: str) -> str | None:
    """The file's ``model_type``, else the one transformers registers for ``arch``."""
    if isinstance(raw.get("model_type"), str):
        return str(raw["model_type"])
    from transformers.models.auto import modeling_auto

    for name in dir(modeling_auto):
        if name.endswith("_MAPPING_NAMES"):
            for model_type, classes in getattr(modeling_auto, name).items():
                if arch in (classes if isinstance(classes, (list, tuple)) else (classes,)):
                    return str(model_type)
    return None


def as_transformers_reads(raw: dict[str, Any], where: str, arch: str) -> dict[str, Any]:
    """The fields of a parsed ``config.json`` as transformers' config class for it sees
    them: the file's own fields, then (for a multimodal file) its ``text_config``'s,
    then every field of the completed text config, defaults and derived
    ``layer_types`` included. A model type transformers does not know is read as
    written."""
    text = raw.get("text_config")
    table = {**raw, **text} if isinstance(text, dict) else dict(raw)
    # transformers advises, on import, that models need PyTorch; configs do not
    advisory = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:  # pragma: no cover - a dependency; kept for a clear message
        raise FragsimError(f"{where}: reading a config.json needs transformers "
                           "(pip install 'transformers>=5.16.1')") from None
    finally:
        if advisory is None:
            del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
        else:
            os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = advisory
    model_type = _model_type(raw, arch)
    if model_type is None or model_type not in CONFIG_MAPPING:
        return table
    quiet = logging.getLogger("transformers")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        config = CONFIG_MAPPING[model_type].from_dict({**raw, "model_type": model_type})
        text_config = config.get_text_config()
        completed = text_config.to_dict()
        kinds = getattr(text_config, "layer_types", None)   # a property on some classes
    except Exception as exc:  # noqa: BLE001 - transformers validates in many ways
        why = " ".join(str(exc).split()) or type(exc).__name__
        why = why if len(why) <= 240 else why[:239] + "…"
        raise FragsimError(f"{where}: transformers cannot read it as {model_type!r}: {why}") from None
    finally:
        quiet.level = level
    table.update(completed)
    # the standard names of fields a family calls otherwise (GPT-2's n_layer, ...)
    for standard, own in getattr(type(text_config), "attribute_map", {}).items():
        if table.get(standard) is None and completed.get(own) is not None:
            table[standard] = completed[own]
    if kinds is not None:
        table["layer_types"] = list(kinds)
    return table


# ---------------------------------------------------------------- layer kinds

_LAYER_TYPES = {"full_attention": "full", "attention": "full", "sliding_attention": "sliding",
                "chunked_attention": "chunked", "linear_attention": "state", "mamba": "state",
                "hybrid": "hybrid", "mlp": None, "moe": None}


def _mamba2_state(c: _Config, prefix: str = "mamba_", ssm_dtype: str = "auto") -> StateShape:
    """Mamba-2 dims; Bamba, Granite hybrids and Falcon-H1 prefix them ``mamba_``,
    Nemotron-H does not."""
    if prefix:
        heads, head_dim = c.integer("mamba_n_heads"), c.integer("mamba_d_head")
        groups, state, kernel = c.integer("mamba_n_groups"), c.integer("mamba_d_state"), c.integer("mamba_d_conv")
        inner = c.integer("mamba_d_ssm", 0, low=0) or c.integer("mamba_expand") * c.integer("hidden_size")
    else:
        heads, head_dim = c.integer("mamba_num_heads"), c.integer("mamba_head_dim")
        groups, state, kernel = c.integer("n_groups"), c.integer("ssm_state_size"), c.integer("conv_kernel")
        inner = heads * head_dim
    return StateShape("mamba2", conv_kernel=kernel, intermediate_size=inner, state_size=state,
                      n_groups=groups, num_heads=heads, head_dim=head_dim, ssm_dtype=ssm_dtype)


def _state_layer(c: _Config) -> LayerSpec:
    """A state layer of ``c``'s family: its state's shape is the family's own."""
    arch = c.arch
    if arch.startswith("Jamba"):
        inner = c.integer("mamba_expand") * c.integer("hidden_size")
        return state_layer("mamba", StateShape("mamba1", conv_kernel=c.integer("mamba_d_conv"),
                                               intermediate_size=inner,
                                               state_size=c.integer("mamba_d_state")))
    if arch.startswith("Qwen3Next"):
        return state_layer("linear", StateShape(
            "gdn", conv_kernel=c.integer("linear_conv_kernel_dim"),
            num_heads=c.integer("linear_num_key_heads"), head_dim=c.integer("linear_key_head_dim"),
            num_v_heads=c.integer("linear_num_value_heads"),
            v_head_dim=c.integer("linear_value_head_dim")))
    if arch.startswith("NemotronH"):
        dtype = c.raw.get("mamba_ssm_cache_dtype") or "float32"
        return state_layer("mamba", _mamba2_state(c, prefix="", ssm_dtype=dtype))
    if arch.startswith(("Bamba", "FalconH1", "GraniteMoeHybrid")):
        return state_layer("mamba", _mamba2_state(c))
    raise FragsimError(f"{c.where}: {arch} has state (linear-attention or Mamba) layers, whose "
                       f"state shape fragsim knows for Jamba, Bamba, Nemotron-H, Granite "
                       f"hybrids, Falcon-H1 and Qwen3-Next only")


def _layers(c: _Config, n: int) -> list[LayerSpec]:
    """Every layer's spec, from the layer types (see the module docstring)."""
    if c.arch.startswith("DeepseekV"):
        return [mla(c.integer("kv_lora_rank"), c.integer("qk_rope_head_dim"))] * n
    _, kv_heads, head_dim = _attention_dims(c)
    if c.has("layer_types"):
        types = c.seq("layer_types", n)
    else:
        # vLLM applies a model-wide sliding_window to every layer (Mistral v0.1);
        # Qwen2/3 set one but switch it off with use_sliding_window = false.
        on = c.has("sliding_window") and c.raw.get("use_sliding_window", True) is not False
        types = ["sliding_attention" if on else "full_attention"] * n
    out: list[LayerSpec] = []
    state: LayerSpec | None = None
    for i, name in enumerate(types):
        if name not in _LAYER_TYPES:
            raise FragsimError(f"{c.where}: layer_types[{i}] is {name!r}; fragsim knows "
                               f"{', '.join(_LAYER_TYPES)}")
        kind = _LAYER_TYPES[name]
        if kind in ("state", "hybrid"):
            state = state or _state_layer(c)
        if kind in ("full", "hybrid"):
            out.append(full(kv_heads, head_dim))
        elif kind == "sliding":
            out.append(sliding(kv_heads, head_dim, c.integer("sliding_window")))
        elif kind == "chunked":
            out.append(chunked_layer(kv_heads, head_dim, c.integer("attention_chunk_size")))
        if kind in ("state", "hybrid"):
            assert state is not None
            out.append(state)
    if not out:
        raise FragsimError(f"{c.where}: no layer holds a KV cache (layer_types has only mlp/moe)")
    return out


def _load(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        hint = ""
        name = str(path)
        if not Path(name).exists() and name.count("/") == 1 and not name.endswith(".json"):
            # a hub id such as google/gemma-3-27b-it: nothing is fetched
            hint = (f" (fragsim fetches nothing: download the model's config.json, e.g. "
                    f"huggingface-cli download {name} config.json, and give its path)")
        raise FragsimError(f"cannot read model config {str(p)!r}: {exc.strerror}{hint}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FragsimError(f"{p}: not valid JSON (line {exc.lineno}, column {exc.colno}): "
                           f"{exc.msg}") from None
    if not isinstance(raw, dict):
        raise FragsimError(f"{p}: must hold a JSON object, got {type(raw).__name__}")
    return p, raw


def is_config_path(name: str) -> bool:
    """Whether ``--model`` names a file or folder rather than a preset."""
    return name.endswith(".json") or os.sep in name or "/" in name or Path(name).is_dir()


def read_hf_config(path: str | os.PathLike[str], name: str | None = None,
                   source: str | None = None) -> Any:
    """The :class:`~fragsim.catalog.ModelConfig` a ``config.json`` (or the folder
    holding one) describes; ``name`` defaults to the file's ``_name_or_path`` or folder,
    ``source`` to the file's path."""
    p, raw = _load(path)
    if name is None:
        stem = p.parent.name if p.name == "config.json" else p.stem
        name = (str(raw.get("_name_or_path") or "").split("/")[-1] or stem).lower()
    return model_from_hf(raw, str(p), name=name, source=source or str(p))


def model_from_hf(raw: dict[str, Any], where: str, *, name: str, source: str) -> Any:
    """A ModelConfig from the fields of a parsed ``config.json``; errors start with
    ``where``."""
    from fragsim.configs import ModelConfig

    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise FragsimError(f"{where}: missing field 'architectures' (a list naming the model class)")
    arch = archs[0]
    if raw.get("is_encoder_decoder") is True:
        raise FragsimError(f"{where}: {arch} is an encoder-decoder model; fragsim models "
                           "decoder-only ones")
    table = as_transformers_reads(raw, where, arch)
    c = _Config(table, where, arch)
    n = c.integer("num_hidden_layers")
    layers = tuple(_layers(c, n))
    heads, kv_heads, head_dim = _attention_dims(c)
    if arch.startswith("DeepseekV"):
        kv_heads, head_dim = heads, c.integer("v_head_dim")
    dtype_name = table.get("dtype") or table.get("torch_dtype") or "bfloat16"
    if dtype_name not in _DTYPES:
        raise FragsimError(f"{where}: field 'torch_dtype' must be one of {', '.join(_DTYPES)}, "
                           f"got {dtype_name!r}")
    # vLLM serves a float32 checkpoint in 16 bits unless told otherwise (Gemma 2).
    dtype_bytes = min(_DTYPES[dtype_name], 2)
    hidden = c.integer("hidden_size")
    inter = c.integer("ffn_dim") if arch.startswith("OPT") else c.integer(
        "intermediate_size", c.integer("moe_intermediate_size", 4 * hidden))
    from fragsim.hfconfig_weights import estimate_weights, moe_fields

    params, weight_bytes, weights = estimate_weights(c, arch, layers, dtype_bytes)
    try:
        return ModelConfig(
            name=name or "config", num_layers=len(layers), num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim, hidden_size=hidden, intermediate_size=inter,
            vocab_size=c.integer("vocab_size"), num_params=params, dtype_bytes=dtype_bytes,
            max_position_embeddings=c.integer("max_position_embeddings", 2048),
            source=source, gated_mlp=not arch.startswith("OPT"), layers=layers,
            checkpoint_bytes=weight_bytes if weight_bytes != params * dtype_bytes else None,
            architecture=arch, weights=weights, **moe_fields(c),
        )
    except ValueError as exc:
        raise FragsimError(f"{where}: {exc}") from None
