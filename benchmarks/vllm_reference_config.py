#!/usr/bin/env python
"""Reference harness, end to end: vLLM 0.33.0 builds the KV cache specs itself from a
config.json, on CPU, without weights or a GPU, then plans the pool.

Not part of fragsim or its tests: it runs in the scratch virtualenv of
``vllm_reference.py``. ``benchmarks/vllm_crosscheck.py --from-config`` writes its
input and compares the answers with fragsim's plan of the same config.json.

Usage: VLLM_PYTHON benchmarks/vllm_reference_config.py INPUT.json OUTPUT.jsonl
(one JSON object a case, written as each case ends).

INPUT.json: {"cases": [{"config": {...config.json...}, "max_model_len": L,
"enable_prefix_caching": bool, "max_num_batched_tokens": T, "kv_cache_dtype":
"auto"|"fp8", "available_memory": bytes, "hybrid_chunked": null|bool, "seq_lens": [...]}]}
(hybrid_chunked: VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE unset, 1 or 0).

What runs is vLLM's own code, in the order a server takes it:

- ``EngineArgs(...).create_engine_config()`` reads the config.json (transformers'
  config class, vLLM's ModelConfig, the model's ``verify_and_update_config``: the
  Mamba cache mode and block size, Nemotron-H's float32 SSM state);
- the model class is built on the meta device (no weights), every layer
  registering itself as it does on a GPU;
- ``Platform.update_block_size_for_backend`` (the attention backend's block size,
  and for hybrids ``_align_hybrid_block_size``: the inflated attention block and
  the padded state page);
- each layer's ``get_kv_cache_spec`` and the backend's ``customize_spec``, the
  loop of ``GPUModelRunner.get_kv_cache_spec``;
- then ``vllm_reference.plan_and_measure``: grouping, sizing, the capacity that the
  "GPU KV cache size" log prints, and ``allocate_slots`` for the blocks held.

The platform is vLLM's CPU platform (there is no GPU here) with every decision that
depends on the GPU answered for an H200 (compute capability 9.0, CUDA 13) by vLLM's
own CUDA code, where a probe needs the device the answer the CUDA wheel gives on one:

- the attention backend: ``CudaPlatformBase.get_attn_backend_cls`` (platforms/cuda.py)
  walks the sm90 priority list. Its availability probes load CUDA extensions, so
  FlashAttention's two extension modules stand in (``flash_attn_interface`` then
  decides the versions itself), ``fa_utils`` decides as on CUDA, and FlashMLA's
  extensions count as present (ops/flashmla.py); FlashInfer is not installed, and
  the backends chosen are reported with each case;
- config checks and block sizing: ``CudaPlatformBase.check_and_update_config`` and
  the base ``Platform.update_block_size_for_backend`` (the CUDA platform's; the CPU
  platform prefers 128-token blocks and resets SSM state dtypes), the sm90 dtypes;
- Gated DeltaNet's prefill kernel (``_resolve_gdn_prefill_backend``,
  layers/mamba/gdn/qwen_gdn_linear_attn.py): FlashInfer's on sm90, which exports
  mid-prefill checkpoints.

Three things stand in for what the CPU cannot build or import, none of which touches
a KV cache spec: FP8 and MXFP4 weight quantization is dropped from the config (the
CPU has no kernel for those layers; the weights' format leaves the cache alone),
``torchvision`` (the Gemma 3 and Llama 4 image processors import it) is an empty
module, and model classes are inspected in this process rather than in vLLM's
subprocess, so that the stand-ins apply there too.

No kernel runs: there is no forward pass.
"""

import atexit
import functools
import importlib.util
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import types
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# fragsim plans any max_model_len; vLLM asks for this to go past max_position_embeddings
os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
# vLLM caches what it learns of each model class; this process's stand-ins stay out of it
os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="vllm-reference-")
atexit.register(shutil.rmtree, os.environ["VLLM_CACHE_ROOT"], True)

# platforms/cuda.py imports the CUDA op libraries (they need libcuda) only to
# register kernels: empty modules stand in while it is imported, then are removed.
_KERNEL_LIBS = ("vllm._C_stable_libtorch", "vllm._qutlass_C", "vllm._moe_C_stable_libtorch")
for _name in _KERNEL_LIBS:
    sys.modules.setdefault(_name, types.ModuleType(_name))
import torch  # noqa: E402
import vllm.platforms as platforms  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402
from vllm.platforms.cuda import NonNvmlCudaPlatform  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402

for _name in _KERNEL_LIBS:
    if isinstance(sys.modules.get(_name), types.ModuleType) and not hasattr(sys.modules[_name], "__file__"):
        del sys.modules[_name]


class H200(NonNvmlCudaPlatform):
    """vLLM's CUDA platform, its device queries answered for one H200."""

    @classmethod
    def get_device_capability(cls, device_id=0):
        return DeviceCapability(9, 0)

    @classmethod
    def get_device_name(cls, device_id=0):
        return "NVIDIA H200"

    @classmethod
    def get_cuda_runtime_major(cls):
        return 13


class CpuAsH200(CpuPlatform):
    """The CPU platform (kernels, devices) with the H200's planning decisions."""

    supported_dtypes = property(lambda self: [torch.bfloat16, torch.float16, torch.float32])
    check_and_update_config = H200.check_and_update_config
    get_device_capability = H200.get_device_capability

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        return H200.get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)

    @classmethod
    def update_block_size_for_backend(cls, vllm_config):
        H200.update_block_size_for_backend(vllm_config)


def _kernel(*args, **kwargs):
    raise RuntimeError("a GPU kernel: not run here")


def _as_on_h200(module, name: str) -> None:
    """``module.name`` decides with the H200 platform (both the module's own
    ``current_platform`` and ``vllm.platforms.current_platform``) instead of the CPU's."""
    fn = getattr(module, name)
    h200 = H200()

    @functools.wraps(fn)
    def decided_on_h200(*args, **kwargs):
        saved = platforms._current_platform, module.current_platform
        platforms._current_platform = module.current_platform = h200
        try:
            return fn(*args, **kwargs)
        finally:
            platforms._current_platform, module.current_platform = saved

    setattr(module, name, decided_on_h200)


def _h200_kernel_probes() -> None:
    """What the CUDA wheel's kernel probes find on an H200, where they need a GPU.

    FlashAttention: its extension modules (they only register ops, and load only with
    libcuda) stand in, so vLLM's own ``flash_attn_interface`` decides which versions
    sm90 runs; ``fa_utils`` (which versions, sinks, fp8, MLA) decides as on CUDA, its
    kernel entry points standing in. FlashMLA: ``ops/flashmla.py`` finds its two
    extensions only on CUDA; the wheel ships both. Gated DeltaNet's prefill kernel
    (``_resolve_gdn_prefill_backend``): chosen as on CUDA. FlashInfer is not installed:
    backends needing it are unavailable (on sm90 they rank below FlashAttention and
    FlashMLA for the models here), and the chosen backends are reported with every
    case. All of this is done before the attention backends' modules are imported, so
    their imports of these names see the H200's answers."""
    for name in ("vllm.vllm_flash_attn._vllm_fa2_C", "vllm.vllm_flash_attn._vllm_fa3_C"):
        sys.modules.setdefault(name, types.ModuleType(name))
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn
    from vllm.v1.attention.backends import fa_utils
    from vllm.v1.attention.ops import flashmla

    fa_utils.current_platform = H200()
    for name in ("flash_attn_varlen_func", "get_scheduler_metadata",
                 "compile_flash_attn_varlen_func_from_specs", "reshape_and_cache_flash"):
        if not hasattr(fa_utils, name):
            setattr(fa_utils, name, _kernel)
    _as_on_h200(fa_utils, "flash_attn_supports_mla")
    flashmla._flashmla_C_AVAILABLE = flashmla._flashmla_extension_C_AVAILABLE = True
    _as_on_h200(qwen_gdn_linear_attn, "_resolve_gdn_prefill_backend")


class _AbsentType(type):
    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return cls


class _Absent(metaclass=_AbsentType):
    """Any name of a stand-in module, and any name of that: a class nothing calls."""


def _torchvision_stand_in() -> None:
    """Empty ``torchvision`` modules where it is not installed (it pins a torch of its
    own): transformers' Gemma 3 and Llama 4 image processors import it at module level,
    and vLLM's multimodal model files import those. Put in place after transformers
    has found torchvision missing, so nothing takes it for the real one; no image is
    processed."""
    if importlib.util.find_spec("torchvision") is not None:
        return
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                 "torchvision.transforms.v2.functional"):
        mod = types.ModuleType(name)
        mod.__path__ = []
        mod.__getattr__ = lambda attr: _Absent
        sys.modules[name] = mod


platforms._current_platform = CpuAsH200()
_h200_kernel_probes()

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.config.vllm import get_layers_from_vllm_config  # noqa: E402
from vllm.distributed import (  # noqa: E402
    ensure_model_parallel_initialized,
    init_distributed_environment,
)
from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase  # noqa: E402
from vllm.model_executor.model_loader.utils import get_model_architecture  # noqa: E402
from vllm.model_executor.models import registry as model_registry  # noqa: E402
from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: E402
from vllm.v1.attention.backends.utils import (  # noqa: E402
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs  # noqa: E402
from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec  # noqa: E402
from vllm.v1.worker.utils import customize_attention_spec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_reference import kind_of, plan_and_measure  # noqa: E402

_torchvision_stand_in()
# vLLM inspects a model class in a fresh subprocess (to keep CUDA uninitialised there);
# here it is inspected in this process, where the stand-ins above are in place.
model_registry._run_in_subprocess = lambda fn: fn()


def _init_distributed() -> None:
    """One rank over gloo (once per process); tensor and pipeline parallel 1, made
    again for each model (the expert-parallel group exists only for MoE models)."""
    from vllm.distributed.parallel_state import (
        destroy_model_parallel,
        model_parallel_is_initialized,
    )

    if model_parallel_is_initialized():
        destroy_model_parallel()
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
    ensure_model_parallel_initialized(1, 1)


#: weight formats the CPU platform has no kernel for (its layers pick one as they are
#: built) and that leave the KV cache alone: the reference drops them
_WEIGHT_ONLY_QUANT = ("fp8", "mxfp4")


def _without_weight_quant(config):
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") in _WEIGHT_ONLY_QUANT and not any("kv" in k for k in quant):
        return {k: v for k, v in config.items() if k != "quantization_config"}, quant["quant_method"]
    return config, None


def engine_config(case, model_dir):
    """The VllmConfig ``vllm serve`` would build for this case (no tokenizer)."""
    chunked = case.get("hybrid_chunked")          # None: vLLM's default (envs.py: on)
    if chunked is None:
        os.environ.pop("VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE", None)
    else:
        os.environ["VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE"] = "1" if chunked else "0"
    args = EngineArgs(
        model=model_dir, skip_tokenizer_init=True, load_format="dummy", enforce_eager=True,
        max_model_len=case["max_model_len"],
        enable_prefix_caching=case["enable_prefix_caching"],
        max_num_batched_tokens=case["max_num_batched_tokens"],
        kv_cache_dtype=case.get("kv_cache_dtype", "auto"),
        block_size=case.get("block_size"),
    )
    return args.create_engine_config()


def layer_specs(vllm_config):
    """Every layer's spec as GPUModelRunner.get_kv_cache_spec collects it."""
    specs = {}
    for name, layer in get_layers_from_vllm_config(vllm_config, AttentionLayerBase).items():
        if isinstance(layer, Attention) and layer.kv_sharing_target_layer_name:
            continue
        spec = layer.get_kv_cache_spec(vllm_config)
        if not spec:
            continue
        if isinstance(spec, AttentionSpec):
            spec = customize_attention_spec(layer.get_attn_backend(), spec)
        specs[name] = spec
    return specs


def run_case(case):
    config, dropped = _without_weight_quant(case["config"])
    with tempfile.TemporaryDirectory() as model_dir:
        Path(model_dir, "config.json").write_text(json.dumps(config))
        vllm_config = engine_config(case, model_dir)
        with set_current_vllm_config(vllm_config):
            _init_distributed()
            model_cls, _ = get_model_architecture(vllm_config.model_config)
            with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("meta"):
                model_cls(vllm_config=vllm_config, prefix="")
            platforms.current_platform.update_block_size_for_backend(vllm_config)
            register_all_kvcache_specs(vllm_config)
            specs = layer_specs(vllm_config)
            # engine/core.py resolves one layout from what the workers' backends support
            layouts = [x.name for x in get_supported_kv_cache_layouts(get_current_attn_backends(vllm_config))]
            resolve_kv_cache_layout(vllm_config, [layouts], specs.values())
            cc = vllm_config.cache_config
            attn_layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
            backends = sorted({layer.get_attn_backend().get_name() for layer in attn_layers.values()})
            mamba = [s for s in specs.values() if isinstance(s, MambaSpec)]
            out = {
                "architecture": vllm_config.model_config.architecture,
                "block_size": cc.block_size,
                "mamba_block_size": cc.mamba_block_size if mamba else None,
                "mamba_cache_mode": cc.mamba_cache_mode,
                "mamba_page_size_padded": cc.mamba_page_size_padded,
                "max_in_flight_tokens": vllm_config.max_in_flight_tokens,
                "attention_backends": backends,
                "weight_quantization_dropped": dropped,
                "layer_kinds": sorted({kind_of(s) for s in specs.values()}),
                "num_prefill_checkpoint_blocks": sorted({s.num_prefill_checkpoint_blocks for s in mamba}),
                "prefill_checkpoint_alignment": sorted({s.prefill_checkpoint_alignment or 0 for s in mamba}),
            }
            out.update(plan_and_measure(vllm_config, specs, case["available_memory"],
                                        case.get("seq_lens", [])))
            return out


def main():
    logging.disable(logging.WARNING)
    cases = json.load(open(sys.argv[1]))["cases"]
    with open(sys.argv[2], "w") as out:
        for case in cases:
            try:
                result = run_case(case)
            except Exception as e:  # noqa: BLE001 - reported per case, the run goes on
                result = {"error": f"{type(e).__name__}: {e}"}
            out.write(json.dumps(result) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
