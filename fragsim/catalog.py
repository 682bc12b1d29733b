"""Models and GPUs: the numbers every byte and every second of a run comes from.

A *slot* is the K and V of one token across all layers::

    kv_bytes_per_token = 2 (K and V) × num_layers × num_kv_heads × head_dim × dtype_bytes
    OPT-13B:             2 × 40 × 40 × 128 × 2 B = 819,200 B  (800 KiB)

Presets copy each model's published ``config.json`` (or its paper) and each card's
vendor datasheet; every entry says where its numbers come from. ``num_params`` is
the exact total of the checkpoint (embeddings included), which the tests re-derive
from the architecture. A TOML file adds custom entries (see :func:`load_catalog`
and ``experiments/catalog_example.toml``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from fragsim.errors import FragsimError
from fragsim.layers import kv_dtype_bytes as _kv_dtype_bytes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 needs the backport
    import tomli as tomllib

from fragsim.configs import (  # noqa: F401  (re-exported: fragsim.catalog is where users look)
    DEFAULT_MAX_NUM_SEQS,
    GiB,
    GPUConfig,
    MiB,
    ModelConfig,
    activation_peak_bytes,
)

_HF = "huggingface.co/{}/blob/main/config.json"

#: what ``fragsim run`` and ``fragsim capacity`` use when --model or --gpu is not given
DEFAULT_MODEL = "llama-3.1-8b"
DEFAULT_GPU = "h100-80gb"

# Parameter totals are the checkpoints' exact counts; tests/test_catalog.py derives
# each one again from the architecture. OPT's positional table has 2048 + 2 rows.
_MODELS = [
    ModelConfig("opt-13b", 40, 40, 40, 128, 5120, 20480, 50272, 12_853_473_280,
                max_position_embeddings=2048, gated_mlp=False,
                source=_HF.format("facebook/opt-13b")),
    ModelConfig("opt-66b", 64, 72, 72, 128, 9216, 36864, 50272, 65_719_701_504,
                max_position_embeddings=2048, gated_mlp=False,
                source=_HF.format("facebook/opt-66b")),
    # No hub checkpoint config; the OPT paper (Zhang et al. 2022), Table 1 and §2.
    ModelConfig("opt-175b", 96, 96, 96, 128, 12288, 49152, 50272, 174_604_468_224,
                max_position_embeddings=2048, gated_mlp=False,
                source="OPT paper, arXiv:2205.01068, Table 1"),
    ModelConfig("llama-2-7b", 32, 32, 32, 128, 4096, 11008, 32000, 6_738_415_616,
                max_position_embeddings=4096, source=_HF.format("meta-llama/Llama-2-7b-hf")),
    ModelConfig("llama-2-13b", 40, 40, 40, 128, 5120, 13824, 32000, 13_015_864_320,
                max_position_embeddings=4096, source=_HF.format("meta-llama/Llama-2-13b-hf")),
    ModelConfig("llama-2-70b", 80, 64, 8, 128, 8192, 28672, 32000, 68_976_648_192,
                max_position_embeddings=4096, source=_HF.format("meta-llama/Llama-2-70b-hf")),
    ModelConfig("llama-3-8b", 32, 32, 8, 128, 4096, 14336, 128256, 8_030_261_248,
                max_position_embeddings=8192, source=_HF.format("meta-llama/Meta-Llama-3-8B")),
    ModelConfig("llama-3-70b", 80, 64, 8, 128, 8192, 28672, 128256, 70_553_706_496,
                max_position_embeddings=8192, source=_HF.format("meta-llama/Meta-Llama-3-70B")),
    # v0.3 rather than v0.1: no sliding window, so every token's KV is kept, as here.
    ModelConfig("mistral-7b", 32, 32, 8, 128, 4096, 14336, 32768, 7_248_023_552,
                max_position_embeddings=32768, source=_HF.format("mistralai/Mistral-7B-v0.3")),
    # Base model (the Instruct config says 32768 positions); untied embeddings, QKV bias.
    ModelConfig("qwen2.5-7b", 28, 28, 4, 128, 3584, 18944, 152064, 7_615_616_512,
                max_position_embeddings=131072, source=_HF.format("Qwen/Qwen2.5-7B")),
]

# Memory: nvidia-smi's memory.total. Bandwidth and dense (no 2:4 sparsity) fp16
# tensor FLOP/s: NVIDIA datasheets. PCIe: one direction of an x16 link (Gen4 32 GB/s,
# Gen5 64 GB/s, half the datasheets' bidirectional figure); swap moves one way.
# sms: streaming multiprocessors (AMD: compute units), from the same datasheets and
# whitepapers. driver_total_bytes: CUDA's own total (cudaMemGetInfo), what vLLM logs as
# total_gpu_memory and PyTorch's out-of-memory error as "a total capacity of X GiB",
# and what `fragsim capacity` budgets from, printed to 0.01 GiB in a published log of
# that card; the source says which. It moves by up to 0.2 GiB with the driver (older
# drivers report more; the source names other values seen). A card without one
# (a catalog's) is planned from nvidia-smi's figure.


def _gib_2dp(gib: float) -> int:
    """A total printed as ``NN.NN GiB``, in whole MiB."""
    return round(gib * 1024) * MiB


_GPUS = [
    GPUConfig("a100-40gb", 40960 * MiB, 1555e9, 312e12, 32e9,
              source="NVIDIA A100 datasheet (SXM4 40GB): 1,555 GB/s, 312 TFLOPS fp16; driver "
                     "total 39.39 GiB: dropbox/hqq issue #77 (A100 40GB, 'a total capacity of "
                     "39.39 GiB'), and 42,298,834,944 B in bottlerocket-os/bottlerocket PR #3873's "
                     "deviceQuery (CUDA 12.2 driver); 39.50 in vLLM issue #12330's log, 39.59 "
                     "under driver 495", arch="sm80", sms=108, driver_total_bytes=_gib_2dp(39.39)),
    GPUConfig("a100-80gb", 81920 * MiB, 2039e9, 312e12, 32e9,
              source="NVIDIA A100 datasheet (SXM4 80GB): 2,039 GB/s, 312 TFLOPS fp16; driver "
                     "total 79.15 GiB: vLLM issue #4408 (A100 80GB, 'a total capacity of 79.15 "
                     "GiB'); 79.21-79.35 under other drivers", arch="sm80", sms=108,
              driver_total_bytes=_gib_2dp(79.15)),
    GPUConfig("h100-80gb", 81559 * MiB, 3.35e12, 989.4e12, 64e9,
              source="NVIDIA H100 datasheet (SXM5): 3.35 TB/s, 1,979 TFLOPS fp16 sparse / 2; "
                     "driver total 79.19 GiB: llm-d-planner accuracy/results/v0.19.0 logs "
                     "(worker init memory snapshot, total_memory=79.19GiB; "
                     "benchmarks/capacity_logs); 79.18 GiB with an older driver in "
                     "llm-d-benchmark config_explorer/empirical-vllm-memory-results.md",
              arch="sm90", sms=132, driver_total_bytes=_gib_2dp(79.19)),
    GPUConfig("h200-141gb", 143771 * MiB, 4.8e12, 989.4e12, 64e9,
              source="NVIDIA H200 datasheet (SXM): 141 GB, 4.8 TB/s, 1,979 TFLOPS fp16 sparse / 2; "
                     "driver total 139.80 GiB: stas00/ml-engineering debug/pytorch.md (an H200 "
                     "node, 'a total capacity of 139.80 GiB'); 139.81 in a vLLM log",
              arch="sm90", sms=132, driver_total_bytes=_gib_2dp(139.80)),
    # nvidia-smi reports 183,359 MiB of the 192 GB; PCIe Gen5 x16 to the host.
    GPUConfig("b200", 183359 * MiB, 8e12, 2.25e15, 64e9,
              source="NVIDIA HGX B200 datasheet: 180 GB usable HBM3e, 8 TB/s, "
                     "4.5 PFLOPS fp16 sparse / 2; driver total 178.35 GiB: stas00/ml-engineering "
                     "debug/pytorch.md ('On NVIDIA B200 ... a total capacity of 178.35 GiB'); "
                     "178.36 in PrimeIntellect-ai/prime-rl benchmarks/results/BENCHMARKS.md (8xB200)",
              arch="sm100", sms=148, driver_total_bytes=_gib_2dp(178.35)),
    # Eight 24 GiB HBM3 stacks; the driver reports the whole 192 GiB.
    GPUConfig("mi300x", 192 * GiB, 5.3e12, 1307.4e12, 64e9,
              source="AMD Instinct MI300X datasheet: 192 GB HBM3, 5.3 TB/s, "
                     "1,307.4 TFLOPS fp16 dense; driver total 191.98 GiB: AMD ROCm blog 'Shrink "
                     "LLMs, Boost Inference' (MI300X, HIP 'a total capacity of 191.98 GiB') and "
                     "vLLM issue #7951", arch="gfx942", sms=304, driver_total_bytes=_gib_2dp(191.98)),
    GPUConfig("l4", 23034 * MiB, 300e9, 121e12, 32e9,
              source="NVIDIA L4 datasheet: 24 GB, 300 GB/s, 242 TFLOPS fp16 sparse / 2; driver "
                     "total 22.03 GiB: ArcInstitute/evo2 issue #190 (an L4, 'a total capacity of "
                     "22.03 GiB'); 21.96-21.99 under other drivers", arch="sm89", sms=58,
              driver_total_bytes=_gib_2dp(22.03)),
    # fp32 accumulation, as PyTorch's fp16 GEMMs use; GeForce runs it at half the
    # fp16-accumulate rate (330 TFLOPS).
    GPUConfig("rtx-4090", 24564 * MiB, 1008e9, 165.2e12, 32e9,
              source="NVIDIA Ada whitepaper (RTX 4090): 1,008 GB/s, 165.2 TFLOPS fp16/fp32-acc; "
                     "driver total 23.64 GiB: 3DTopia/Phidias-Diffusion issue #8 and "
                     "TMElyralab/MuseTalk issue #76 ('a total capacity of 23.64 GiB'); "
                     "23.52-23.68 under other drivers", arch="sm89", sms=128,
              driver_total_bytes=_gib_2dp(23.64)),
    # Datacenter Ada: full-rate fp32 accumulation. The datasheet's dense figure is
    # 362.05 (not 733 / 2).
    GPUConfig("l40s", 46068 * MiB, 864e9, 362.05e12, 32e9,
              source="NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s, 362.05 TFLOPS fp16 dense, "
                     "PCIe Gen4 x16; driver total 44.31 GiB: vLLM issue #15196 log (L40S, "
                     "vLLM 0.7.2), total_gpu_memory (44.31GiB); 44.53 in Wan-Video/Wan2.1 "
                     "issue #205",
              arch="sm89", sms=142, driver_total_bytes=_gib_2dp(44.31)),
    # AWS's variant of the A10 (G5 instances); NVIDIA publishes no A10G datasheet.
    # Its tensor rate is half the A10's 125 TFLOPS, as GeForce's fp32 accumulation.
    GPUConfig("a10g", 23028 * MiB, 600e9, 70e12, 32e9,
              source="Baseten, 'NVIDIA A10 vs A10G for ML model inference' (spec table: 24 GB "
                     "GDDR6, 600 GB/s, 70 TFLOPS fp16 tensor); PCIe Gen4 x16; driver total "
                     "22.19 GiB: vLLM issue #372 (ml.g5 instances, '22.19 GiB total capacity'); "
                     "21.99 with a 2025 driver", arch="sm86", sms=80,
              driver_total_bytes=_gib_2dp(22.19)),
    GPUConfig("rtx-5090", 32607 * MiB, 1792e9, 209.5e12, 64e9,
              source="NVIDIA RTX Blackwell whitepaper (RTX 5090): 32 GB GDDR7, 1,792 GB/s, "
                     "209.5 TFLOPS fp16/fp32-acc dense, PCIe Gen5 x16; driver total 31.36 GiB: "
                     "TrajectoryCrafter/TrajectoryCrafter issue #20 (RTX 5090, 'a total capacity "
                     "of 31.36 GiB'); 31.37 in Wan-Video/Wan2.1 issue #465",
              arch="sm120", sms=170, driver_total_bytes=_gib_2dp(31.36)),
    GPUConfig("rtx-3090", 24576 * MiB, 936e9, 71e12, 32e9,
              source="NVIDIA Ampere GA102 whitepaper (RTX 3090): 936 GB/s, 71 TFLOPS "
                     "fp16/fp32-acc dense, PCIe Gen4 x16; driver total 23.58 GiB: vLLM issue "
                     "#10517 log, total_gpu_memory=23.58GiB",
              arch="sm86", sms=82, driver_total_bytes=_gib_2dp(23.58)),
]

class Presets(Mapping[str, ModelConfig]):
    """The model presets by name. Those read from a published config.json
    (:mod:`fragsim.presets`) are read when first asked for, so a run that names one
    model reads one file."""

    def __init__(self, models: list[ModelConfig], readers: Mapping[str, Callable[[], ModelConfig]]) -> None:
        self._models = {m.name: m for m in models}
        self._readers = dict(readers)
        self._names = [*self._models, *self._readers]

    def __getitem__(self, name: str) -> ModelConfig:
        if name not in self._models:
            self._models[name] = self._readers[name]()     # KeyError when neither has it
        return self._models[name]

    def __contains__(self, name: object) -> bool:
        return name in self._models or name in self._readers

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


# Models with layer kinds, read from their published config.json (fragsim/presets.py).
from fragsim.presets import preset_readers  # noqa: E402

MODELS: Mapping[str, ModelConfig] = Presets(_MODELS, preset_readers())
GPUS: Mapping[str, GPUConfig] = MappingProxyType({g.name: g for g in _GPUS})

Catalog = tuple[dict[str, ModelConfig], dict[str, GPUConfig]]


_Config = TypeVar("_Config", ModelConfig, GPUConfig)


def _lookup(kind: str, option: str, name: str, presets: Mapping[str, _Config],
            custom: Mapping[str, _Config]) -> _Config:
    key = name.strip().lower()
    found = custom.get(key, presets.get(key))
    if found is None:
        known = ", ".join(sorted({*presets, *custom}))
        raise FragsimError(f"unknown {kind} {name!r} ({option}); known: {known}")
    return found


def get_model(name: str, catalog: str | os.PathLike[str] | None = None) -> ModelConfig:
    """A preset (or, with ``catalog``, a custom entry of that TOML file) by name,
    case-insensitively, or the model of a Hugging Face ``config.json`` (a path to
    the file or to the folder holding it)."""
    from fragsim.hfconfig import is_config_path, read_hf_config

    if is_config_path(name):
        model: ModelConfig = read_hf_config(name)
        return model
    custom = load_catalog(catalog)[0] if catalog is not None else {}
    return _lookup("model", "--model", name, MODELS, custom)


def with_kv_cache_dtype(model: ModelConfig, kv_cache_dtype: str | None) -> ModelConfig:
    """``model`` caching its KV in ``kv_cache_dtype`` (``None`` or ``auto``: as it is)."""
    if kv_cache_dtype is None or kv_cache_dtype == "auto":
        return model
    _kv_dtype_bytes(kv_cache_dtype, model.dtype_bytes)  # names the option when bad
    return dataclasses.replace(model, kv_cache_dtype=kv_cache_dtype.strip().lower())


def get_gpu(name: str, catalog: str | os.PathLike[str] | None = None) -> GPUConfig:
    """A preset GPU (or a custom one from ``catalog``) by name, case-insensitively."""
    custom = load_catalog(catalog)[1] if catalog is not None else {}
    return _lookup("GPU", "--gpu", name, GPUS, custom)


def _build(cls: type, table: str, name: str, raw: Any, presets: Mapping[str, Any]) -> Any:
    where = f"[{table}.{name}]"
    if not isinstance(raw, dict):
        raise FragsimError(f"{where}: must be a table of keys, got {type(raw).__name__}")
    if name in presets:
        raise FragsimError(
            f"{where}: name clashes with a preset; pick another name "
            f'(base = "{name}" starts from the preset)'
        )
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in ("name", "layers", "weights")}
    values = dict(raw)
    base_name = values.pop("base", None)
    for key, value in values.items():
        if key not in fields:
            raise FragsimError(
                f"{where}: unknown key {key!r}; allowed: base, {', '.join(fields)}"
            )
        expected = str(fields[key].type).removesuffix(" | None")
        if expected == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = type(value).__name__ == expected
        if not ok:
            raise FragsimError(f"{where}: key {key!r} must be {expected}, got {value!r}")
    if base_name is not None and "memory_bytes" in values and "driver_total_bytes" in fields:
        # The preset's driver total belongs to the preset's memory, not the new one.
        values.setdefault("driver_total_bytes", None)
    try:
        if base_name is not None:
            if not isinstance(base_name, str) or base_name.lower() not in presets:
                raise FragsimError(
                    f"{where}: key 'base' must name a preset ({', '.join(presets)}), "
                    f"got {base_name!r}"
                )
            # the preset's tensor list describes the preset; new dimensions drop it
            # (fragsim.weights.groups_of derives a dense one from them)
            base = presets[base_name.lower()]
            if cls is ModelConfig and not set(values) <= {"source", "kv_cache_dtype",
                                                          "max_position_embeddings"}:
                values["weights"] = ()
            return dataclasses.replace(base, name=name, **values)
        missing = [k for k, f in fields.items()
                   if k not in values and f.default is dataclasses.MISSING]
        if missing:
            raise FragsimError(f"{where}: missing key(s) {', '.join(missing)} (or give base)")
        return cls(name=name, **values)
    except ValueError as exc:
        raise FragsimError(f"{where}: {exc}") from None


def load_catalog(path: str | os.PathLike[str]) -> Catalog:
    """Custom models and GPUs from a TOML file of ``[models.NAME]`` and ``[gpus.NAME]``
    tables, keyed by the dataclass field names (``base = "PRESET"`` copies a preset
    and overrides some fields). Names are lower-cased and may not shadow a preset.
    Every error names the file, the table and the key."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise FragsimError(f"cannot read catalog {os.fspath(path)!r}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise FragsimError(f"catalog {os.fspath(path)!r} is not valid TOML: {exc}") from None
    extra = sorted(set(data) - {"models", "gpus"})
    if extra:
        raise FragsimError(
            f"catalog {os.fspath(path)!r}: unknown table(s) {', '.join(extra)}; "
            "allowed: models, gpus"
        )
    for table in ("models", "gpus"):
        if not isinstance(data.get(table, {}), dict):
            raise FragsimError(
                f"catalog {os.fspath(path)!r}: {table!r} must be a table of [{table}.NAME] tables"
            )
    try:
        models = {n.lower(): _build(ModelConfig, "models", n.lower(), raw, MODELS)
                  for n, raw in data.get("models", {}).items()}
        gpus = {n.lower(): _build(GPUConfig, "gpus", n.lower(), raw, GPUS)
                for n, raw in data.get("gpus", {}).items()}
    except FragsimError as exc:
        raise FragsimError(f"catalog {os.fspath(path)!r}: {exc}") from None
    return models, gpus
