"""A vLLM start-up log, read: the memory figures it prints and the settings it ran with.

vLLM logs its memory profile at start-up in lines that changed wording between
releases; :func:`read_log` takes any of them (0.6 to 0.33)::

    Model loading took 14.99 GiB memory and 31.46 seconds            weights
    Memory profiling takes 9.80 seconds ... total_gpu_memory (79.19GiB) x
      gpu_memory_utilization (0.90) = 71.27GiB ... model weights take 14.99GiB;
      non_torch_memory takes 0.13GiB; PyTorch activation peak memory takes 4.76GiB;
      the rest of the memory reserved for KV Cache is 51.38GiB.    0.7 - 0.10 (INFO)
    Free memory on device (78.57/79.18 GiB) on startup. ... Actual usage is 14.99
      GiB for weight, 4.76 GiB for peak activation, 0.13 GiB for non-torch memory,
      and -0.45 GiB for CUDAGraph memory.                              0.11 and later
    Available KV cache memory: 51.38 GiB
    GPU KV cache size: 420,928 tokens
    Maximum concurrency for 16,000 tokens per request: 26.31x
    Graph capturing finished in 5 secs, took 0.45 GiB

and the settings from the engine's config line and the non-default arguments
(model, tensor_parallel_size, gpu_memory_utilization, max_model_len / max_seq_len,
max_num_seqs, max_num_batched_tokens, kv_cache_dtype, quantization, enforce_eager,
the version). Every figure is optional; :func:`require` names what a use needs
and a log lacks.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field, fields
from typing import Any

from fragsim.errors import FragsimError

GiB = 1 << 30

_NUM = r"(-?[\d,]*\.?\d+)"
_GIB = _NUM + r"\s*Gi?B"

#: figure → patterns, first match wins (values in GiB unless named otherwise)
_FIGURES: dict[str, tuple[str, ...]] = {
    "weights_gib": (r"Model loading took " + _GIB, r"model weights take " + _GIB,
                    r"weights memory: " + _GIB,
                    r"Loading model weights took " + _GIB,
                    r"Actual usage is " + _GIB + r" for weight"),
    "total_gib": (r"total_gpu_memory \(" + _GIB + r"\)", r"total_gpu_memory=" + _GIB,
                  r"\btotal_memory=" + _GIB, r"Free memory on device[^(]*\(" + _NUM
                  + r"/" + _NUM + r" GiB\)"),
    "free_gib": (r"Free memory on device[^(]*\(" + _NUM + r"/",),
    "requested_gib": (r"gpu_memory_utilization \([\d.]+\) = " + _GIB,
                      r"Desired GPU memory utilization is \([\d.]+, " + _GIB + r"\)",
                      r"Requested memory: [\d.]+ \(util\), " + _GIB),
    "peak_torch_gib": (r"peak_torch_memory=" + _GIB,),
    "non_torch_gib": (r"non-torch forward increase memory(?: takes|:) " + _GIB,
                      r"non_torch_memory takes " + _GIB, _GIB + r" for non-torch memory",
                      r"Memory profiling results:.*?non_torch_memory=" + _GIB),
    "activation_gib": (r"PyTorch activation peak memory takes " + _GIB,
                       r"torch peak memory increase(?: takes|:) " + _GIB,
                       _GIB + r" for peak activation"),
    "cuda_graph_gib": (r"Graph capturing finished in [\d.]+ secs?, took " + _GIB,
                       _GIB + r" GiB for CUDAGraph memory", _GIB + r" for CUDAGraph memory"),
    "cuda_graph_estimate_gib": (r"Estimated CUDA graph memory: " + _GIB,),
    "non_kv_gib": (r"Total non KV cache memory: " + _GIB,),
    "kv_cache_gib": (r"Available KV cache memory: " + _GIB, r"kv_cache_size=" + _GIB,
                     r"the rest of the memory reserved for KV Cache is " + _GIB),
    "kv_cache_tokens": (r"GPU KV cache size:\s*" + _NUM + r" tokens",
                        r"tokens that can be stored in KV cache \(" + _NUM + r"\)"),
    "concurrency": (r"Maximum concurrency for " + _NUM + r" tokens per request: " + _NUM + r"x",),
    "num_gpu_blocks": (r"# (?:GPU|CUDA) blocks: " + _NUM, r"\bGPU blocks: " + _NUM,
                       r"num_gpu_blocks is: " + _NUM),
}

#: setting → patterns over the engine config line and the non-default args
_SETTINGS: dict[str, tuple[str, ...]] = {
    "vllm_version": (r"vLLM API server version ([\w.+-]+)", r"\bversion (\d+\.\d+[\w.+-]*)", r"Initializing an? (?:V1 )?LLM engine \(v"
                     r"([\w.+-]+)\)", r"vLLM version ([\w.+-]+)"),
    "model": (r"with config: model='([^']+)'", r"'model': '([^']+)'", r"model='([^']+)'"),
    "tensor_parallel_size": (r"tensor_parallel_size=(\d+)", r"'tensor_parallel_size': (\d+)"),
    "gpu_memory_utilization": (r"'gpu_memory_utilization': ([\d.]+)",
                               r"gpu_memory_utilization=([\d.]+)",
                               r"gpu_memory_utilization \(([\d.]+)\)",
                               r"Desired GPU memory utilization is \(([\d.]+),",
                               r"Requested memory: ([\d.]+) \(util\)"),
    "max_model_len": (r"max_seq_len=(\d+)", r"'max_model_len': (\d+)",
                      r"Maximum concurrency for ([\d,]+) tokens"),
    "max_num_seqs": (r"'max_num_seqs': (\d+)", r"max_num_seqs=(\d+)"),
    "max_num_batched_tokens": (r"'max_num_batched_tokens': (\d+)", r"max_num_batched_tokens=(\d+)"),
    "kv_cache_dtype": (r"kv_cache_dtype=(\w+)", r"'kv_cache_dtype': '(\w+)'"),
    "quantization": (r"quantization=(\w[\w-]*)", r"'quantization': '([\w-]+)'"),
    "enforce_eager": (r"enforce_eager=(True|False)", r"'enforce_eager': (True|False)"),
}


@dataclass
class LoggedStartup:
    """What one start-up log says; ``None`` where it says nothing."""

    weights_gib: float | None = None
    total_gib: float | None = None
    free_gib: float | None = None
    requested_gib: float | None = None
    non_torch_gib: float | None = None
    activation_gib: float | None = None
    peak_torch_gib: float | None = None   # V0: weights + activation peak
    cuda_graph_gib: float | None = None
    cuda_graph_estimate_gib: float | None = None
    non_kv_gib: float | None = None
    kv_cache_gib: float | None = None
    kv_cache_tokens: int | None = None
    concurrency: float | None = None
    num_gpu_blocks: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    def figures(self) -> dict[str, float | int]:
        """The figures the log gives, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "settings" and getattr(self, f.name) is not None}


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _setting(name: str, text: str) -> Any:
    if name in ("tensor_parallel_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        return int(text.replace(",", ""))
    if name == "gpu_memory_utilization":
        return float(text)
    if name == "enforce_eager":
        return text == "True"
    return text


def _non_default_args(text: str) -> dict[str, Any]:
    """vLLM's ``non-default args: {...}`` line, read as the Python literal it is."""
    m = re.search(r"non-default args: (\{.*\})", text)
    if not m:
        return {}
    try:
        value = ast.literal_eval(m.group(1))
    except (ValueError, SyntaxError):
        return {}
    return value if isinstance(value, dict) else {}


def read_log(text: str) -> LoggedStartup:
    """The figures and settings of a vLLM start-up log (see the module docstring).

    Where a figure is printed twice (several ranks, a restart), the last one counts:
    it is the one the engine went on with."""
    out = LoggedStartup()
    for name, patterns in _FIGURES.items():
        for pattern in patterns:
            found = list(re.finditer(pattern, text))
            if found:
                m = found[-1]
                if name == "concurrency":
                    value: float = _number(m.group(2))
                elif name == "total_gib" and m.lastindex == 2:
                    value = _number(m.group(2))
                else:
                    value = _number(m.group(1))
                setattr(out, name, int(value) if name in ("kv_cache_tokens", "num_gpu_blocks")
                        else value)
                break
    for name, patterns in _SETTINGS.items():
        for pattern in patterns:
            hit = re.search(pattern, text)
            if hit:
                out.settings[name] = _setting(name, hit.group(1))
                break
    args = _non_default_args(text)
    for key in ("tensor_parallel_size", "gpu_memory_utilization", "max_model_len", "max_num_seqs",
                "max_num_batched_tokens", "kv_cache_dtype", "quantization", "enforce_eager"):
        if key in args and args[key] is not None:
            out.settings[key] = args[key]
    if "model_tag" in args and "model" not in out.settings:
        out.settings["model"] = args["model_tag"]
    return out


def require(logged: LoggedStartup, where: str, *names: str) -> None:
    """Refuse, in one line, a log that lacks any of ``names``."""
    missing = [n for n in names if getattr(logged, n, None) is None and n not in logged.settings]
    if missing:
        labels = {"kv_cache_gib": "'Available KV cache memory: X GiB'",
                  "weights_gib": "'Model loading took X GiB'",
                  "kv_cache_tokens": "'GPU KV cache size: N tokens'"}
        named = ", ".join(labels.get(n, n) for n in missing)
        raise FragsimError(f"{where}: not a complete vLLM start-up log: no {named} found")
