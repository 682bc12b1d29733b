"""How long one engine step takes.

A step runs the whole batch once: ``num_prefill_tokens`` prompt tokens (possibly
chunks of several prompts) and one token for each of ``num_decode`` decoding
sequences that together read ``decode_context`` stored tokens of KV.

Three models:

* ``fixed``: every step takes ``step_time`` seconds. For analytic checks.
* ``roofline``: a step is bound either by compute or by memory traffic::

      compute = (2 * params * tokens + attention_flops) / tp / (fp16_flops * flops_efficiency)
      memory  = (weight_bytes + kv_bytes_per_token * decode_context) / tp
                / (hbm_bandwidth * bandwidth_efficiency)
      step    = overhead + max(compute, memory) + tp_comm

  Prefill is compute bound, decode memory bound on the weights plus the KV it
  reads; tensor parallelism splits both over ``tp`` GPUs and adds two all-reduces
  per layer of the step's activations over ``tp_comm_bandwidth``. It is fitted
  to nothing: the fallback where no fitted model exists.
* ``fitted`` (:class:`StepCostModel`): the same two regimes with every
  coefficient a number fitted to measurements (``fragsim calibrate``), plus the
  per-step and per-sequence costs real engines pay (scheduling, sampling,
  detokenisation, launches)::

      step = overhead + per_seq * num_decode
             + max(prefill_token * P + attention_unit * (U + C) + decode_token * num_decode,
                   weights + context_token * C)

  with ``P`` prompt tokens computed, ``U`` their attention units (Σ over prompt
  tokens of the earlier tokens each attends to) and ``C`` the decode context (the
  stored tokens the decoding sequences read, and attend to). This is the
  shape Vidur (profiled operators) and BLIS (trained coefficients) use; BLIS's
  ``beta0 + beta1 * prefill tokens + beta2 * decode tokens`` is the case with no
  memory term. Fitted models are TOML files; the bundled ones are presets
  (:data:`COST_MODEL_PRESETS`, ``fragsim/cost_models/``).

Every model evaluates :meth:`CostModel.decode_step_times` on a whole array of
consecutive decode-only steps; the engine's exact mode evaluates one step at a
time, with the models' ``decode_step_time`` where they have one (plain floats: a
step is a few microseconds of arithmetic, and an array of one element costs more
than the arithmetic), else the same method with arrays of one element. Scalar and
array evaluations are the same operations in the same order, so both modes see
bit-identical step times (tests check).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from functools import cache, cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from fragsim.errors import FragsimError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

if TYPE_CHECKING:
    from fragsim.catalog import GPUConfig, ModelConfig


class CostModel(Protocol):
    @property
    def name(self) -> str: ...

    def step_time(self, num_prefill_tokens: int, prefill_attention_units: int,
                  num_decode: int, decode_context: int) -> float:
        """One step. ``prefill_attention_units`` = Σ over prefill tokens of the
        number of earlier tokens they attend to (the QKᵀ/PV work of a prompt)."""
        ...

    def decode_step_times(self, num_decode: int, decode_context: np.ndarray) -> np.ndarray:
        """Decode-only steps, one per element of ``decode_context``."""
        ...

    def to_dict(self) -> dict[str, object]: ...


@dataclass(frozen=True)
class FixedCostModel:
    """Every step takes ``step_time`` seconds, whatever it computes."""

    step_time_s: float = 0.02
    name: str = "fixed"

    def __post_init__(self) -> None:
        if not self.step_time_s > 0:
            raise ValueError(f"step_time must be > 0 seconds, got {self.step_time_s}")

    def step_time(self, num_prefill_tokens: int, prefill_attention_units: int,
                  num_decode: int, decode_context: int) -> float:
        return float(self.step_time_s)

    def decode_step_times(self, num_decode: int, decode_context: np.ndarray) -> np.ndarray:
        return np.full(len(decode_context), float(self.step_time_s))

    def decode_step_time(self, num_decode: int, decode_context: int) -> float:
        """One decode-only step (:meth:`decode_step_times` of one element, as a float)."""
        return float(self.step_time_s)

    def to_dict(self) -> dict[str, object]:
        return {"cost_model": self.name, "step_time_s": self.step_time_s}


@dataclass(frozen=True)
class RooflineCostModel:
    """Roofline of a model on a GPU; see the module docstring for the formula.

    Efficiency defaults are typical of well-tuned serving engines: about 60% of
    dense tensor FLOP/s in prefill, 80% of HBM bandwidth in decode, and a fixed
    per-step overhead for scheduling and kernel launches.
    """

    model: ModelConfig
    gpu: GPUConfig
    tp: int = 1
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    overhead_s: float = 0.002
    tp_comm_bandwidth: float = 300e9  # bytes/s per GPU, NVLink-class interconnect
    name: str = "roofline"

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        for field_name in ("flops_efficiency", "bandwidth_efficiency"):
            value = getattr(self, field_name)
            if not 0 < value <= 1:
                raise ValueError(f"{field_name} must be in (0, 1], got {value}")
        if self.overhead_s < 0:
            raise ValueError(f"overhead_s must be >= 0, got {self.overhead_s}")

    # Coefficients, so that a step is overhead + max(c0 + c1*x, m0 + m1*y) + comm.
    @property
    def _flop_rate(self) -> float:
        return self.gpu.fp16_flops * self.flops_efficiency * self.tp

    @property
    def _byte_rate(self) -> float:
        return self.gpu.hbm_bandwidth * self.bandwidth_efficiency * self.tp

    def _attention_flops_per_unit(self) -> float:
        # QK^T and PV: 2 matmuls x 2 flops per multiply-add, over all query heads.
        m = self.model
        return 4.0 * m.num_layers * m.num_heads * m.head_dim

    def _comm_time(self, tokens: np.ndarray | int) -> np.ndarray | float:
        if self.tp == 1:
            return 0.0 * tokens
        m = self.model
        # Two ring all-reduces per layer, each moving 2(tp-1)/tp of the activations.
        nbytes = 2 * m.num_layers * tokens * m.hidden_size * m.dtype_bytes * 2 * (self.tp - 1) / self.tp
        return nbytes / self.tp_comm_bandwidth

    @cached_property
    def _coefficients(self) -> tuple[float, float, float, float, float, float]:
        """What every step time needs from the model and the GPU, computed once: FLOPs per
        token, attention FLOPs per unit, weight bytes, KV bytes per token, FLOP/s, bytes/s."""
        m = self.model
        return (2.0 * m.num_params, self._attention_flops_per_unit(), float(m.weight_bytes),
                float(m.kv_bytes_per_token), self._flop_rate, self._byte_rate)

    def _times(self, tokens: np.ndarray | int, attention_units: np.ndarray | int,
               context: np.ndarray | int) -> np.ndarray:
        per_token, per_unit, weight_bytes, kv_bytes, flop_rate, byte_rate = self._coefficients
        flops = per_token * np.asarray(tokens, dtype=np.float64) \
            + per_unit * np.asarray(attention_units, dtype=np.float64)
        nbytes = weight_bytes + kv_bytes * np.asarray(context, dtype=np.float64)
        compute = flops / flop_rate
        memory = nbytes / byte_rate
        return self.overhead_s + np.maximum(compute, memory) + self._comm_time(np.asarray(tokens))

    def _time(self, tokens: int, attention_units: int, context: int) -> float:
        """:meth:`_times` for one step in plain Python floats: the same operations in the
        same order, so the result is bit-identical to the array version (tests check)."""
        per_token, per_unit, weight_bytes, kv_bytes, flop_rate, byte_rate = self._coefficients
        compute = (per_token * float(tokens) + per_unit * float(attention_units)) / flop_rate
        memory = (weight_bytes + kv_bytes * float(context)) / byte_rate
        comm = 0.0
        if self.tp > 1:
            comm = float(np.asarray(self._comm_time(np.array([tokens])))[0])
        return self.overhead_s + max(compute, memory) + comm

    def step_time(self, num_prefill_tokens: int, prefill_attention_units: int,
                  num_decode: int, decode_context: int) -> float:
        return self._time(num_prefill_tokens + num_decode, prefill_attention_units + decode_context,
                          decode_context)

    def decode_step_times(self, num_decode: int, decode_context: np.ndarray) -> np.ndarray:
        if len(decode_context) == 1:
            ctx = int(decode_context[0])
            return np.array([self._time(num_decode, ctx, ctx)])
        tokens = np.full(len(decode_context), num_decode)
        return self._times(tokens, decode_context, decode_context)

    def decode_step_time(self, num_decode: int, decode_context: int) -> float:
        """One decode-only step (:meth:`decode_step_times` of one element, as a float)."""
        return self._time(num_decode, decode_context, decode_context)

    def to_dict(self) -> dict[str, object]:
        return {
            "cost_model": self.name, "model": self.model.name, "gpu": self.gpu.name,
            "tp": self.tp, "flops_efficiency": self.flops_efficiency,
            "bandwidth_efficiency": self.bandwidth_efficiency, "overhead_s": self.overhead_s,
            "tp_comm_bandwidth": self.tp_comm_bandwidth,
        }


# The coefficients of a fitted step, in seconds (per step, per sequence, per token, ...).
TERMS = ("overhead_s", "per_seq_s", "prefill_token_s", "attention_unit_s", "decode_token_s",
         "weights_s", "context_token_s")
TERM_HELP = {
    "overhead_s": "per step (scheduling, launches)",
    "per_seq_s": "per decoding sequence (sampling, detokenisation, block tables)",
    "prefill_token_s": "per prompt token computed (compute-bound regime)",
    "attention_unit_s": "per attention unit: an earlier token a computed token attends to",
    "decode_token_s": "per decoded token (compute-bound regime)",
    "weights_s": "reading the weights once (memory-bound regime)",
    "context_token_s": "per token of KV a decode step reads (memory-bound regime)",
}


@dataclass(frozen=True)
class StepCostModel:
    """A step cost with fitted coefficients; see the module docstring for the formula.

    ``model``, ``gpu`` and ``tp`` say what the coefficients were fitted for (a run
    of anything else gets a warning, not an error: a what-if may mean it);
    ``source`` says where they came from.
    """

    overhead_s: float = 0.0
    per_seq_s: float = 0.0
    prefill_token_s: float = 0.0
    attention_unit_s: float = 0.0
    decode_token_s: float = 0.0
    weights_s: float = 0.0
    context_token_s: float = 0.0
    name: str = "fitted"
    model: str = ""
    gpu: str = ""
    tp: int = 1
    source: str = ""
    fit: dict[str, Any] | None = None  # how it was fitted: inputs, free terms, errors

    def __post_init__(self) -> None:
        for term in TERMS:
            value = getattr(self, term)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise FragsimError(f"cost model {self.name!r}: {term} must be a finite number "
                                   f">= 0 seconds, got {value!r}")
        if not any(getattr(self, term) for term in TERMS):
            raise FragsimError(f"cost model {self.name!r}: every coefficient is 0, so every step "
                               "would take no time")

    @classmethod
    def from_roofline(cls, roofline: RooflineCostModel) -> StepCostModel:
        """The roofline's coefficients in this shape. Its tensor-parallel all-reduces, linear
        in the step's tokens and outside its max, go to the per-sequence term for decode
        tokens and into the prompt-token term (compute bound, so inside the max is exact)."""
        per_token, per_unit, weight_bytes, kv_bytes, flop_rate, byte_rate = roofline._coefficients
        comm = float(np.asarray(roofline._comm_time(np.array([1])))[0])
        return cls(overhead_s=roofline.overhead_s, per_seq_s=comm,
                   prefill_token_s=per_token / flop_rate + comm,
                   attention_unit_s=per_unit / flop_rate, decode_token_s=per_token / flop_rate,
                   weights_s=weight_bytes / byte_rate, context_token_s=kv_bytes / byte_rate,
                   name="roofline-prior", model=roofline.model.name, gpu=roofline.gpu.name,
                   tp=roofline.tp, source="fragsim's roofline (fitted to nothing)")

    def coefficients(self) -> dict[str, float]:
        return {term: float(getattr(self, term)) for term in TERMS}

    def with_coefficients(self, **terms: float) -> StepCostModel:
        return replace(self, **terms)  # type: ignore[arg-type]

    def _time(self, num_prefill_tokens: int, prefill_attention_units: int,
              num_decode: int, decode_context: int) -> float:
        d = float(num_decode)
        c = float(decode_context)
        compute = (self.prefill_token_s * float(num_prefill_tokens)
                   + self.attention_unit_s * (float(prefill_attention_units) + c) + self.decode_token_s * d)
        memory = self.weights_s + self.context_token_s * c
        return self.overhead_s + self.per_seq_s * d + max(compute, memory)

    def step_time(self, num_prefill_tokens: int, prefill_attention_units: int,
                  num_decode: int, decode_context: int) -> float:
        return self._time(num_prefill_tokens, prefill_attention_units, num_decode, decode_context)

    def step_times(self, num_prefill_tokens: np.ndarray, prefill_attention_units: np.ndarray,
                   num_decode: np.ndarray, decode_context: np.ndarray) -> np.ndarray:
        """Many steps at once (the fit's predictions): the same operations as :meth:`step_time`."""
        d = np.asarray(num_decode, dtype=np.float64)
        c = np.asarray(decode_context, dtype=np.float64)
        compute = (self.prefill_token_s * np.asarray(num_prefill_tokens, dtype=np.float64)
                   + self.attention_unit_s * (np.asarray(prefill_attention_units, dtype=np.float64) + c)
                   + self.decode_token_s * d)
        memory = self.weights_s + self.context_token_s * c
        return self.overhead_s + self.per_seq_s * d + np.maximum(compute, memory)

    def decode_step_times(self, num_decode: int, decode_context: np.ndarray) -> np.ndarray:
        if len(decode_context) == 1:
            return np.array([self._time(0, 0, num_decode, int(decode_context[0]))])
        n = len(decode_context)
        return self.step_times(np.zeros(n), np.zeros(n), np.full(n, num_decode), decode_context)

    def decode_step_time(self, num_decode: int, decode_context: int) -> float:
        """One decode-only step (:meth:`decode_step_times` of one element, as a float)."""
        return self._time(0, 0, num_decode, decode_context)

    def to_dict(self) -> dict[str, object]:
        return {"cost_model": self.name, **self.coefficients(), "fitted_for_model": self.model,
                "fitted_for_gpu": self.gpu, "fitted_for_tp": self.tp, "source": self.source}

    def to_toml(self) -> str:
        """The model as a TOML file that ``--cost-model`` and experiment files can name."""
        lines = [f"# fragsim step-cost model: {self.name}", "# step = overhead + per_seq * num_decode",
                 "#        + max(prefill_token * P + attention_unit * (U + C) + decode_token * num_decode,",
                 "#              weights + context_token * C)",
                 "", f"name = {_toml_str(self.name)}", f"source = {_toml_str(self.source)}",
                 "", "[fitted_for]", f"model = {_toml_str(self.model)}", f"gpu = {_toml_str(self.gpu)}",
                 f"tp = {self.tp}", "", "[coefficients]  # seconds"]
        lines += [f"{term} = {float(getattr(self, term))!r}  # {TERM_HELP[term]}" for term in TERMS]
        if self.fit:
            lines += ["", "[fit]"] + [f"{k} = {_toml_value(v)}" for k, v in self.fit.items()]
        return "\n".join(lines) + "\n"


def _toml_str(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_str(str(k))} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return _toml_str(str(value))


PRESET_DIR = Path(__file__).parent / "cost_models"
COST_MODEL_PRESETS = tuple(sorted(p.stem for p in PRESET_DIR.glob("*.toml")))


def load_cost_model(path_or_name: str | Path) -> StepCostModel:
    """A fitted model from a TOML file, or a bundled preset by name (read once)."""
    if str(path_or_name) in COST_MODEL_PRESETS:
        return _preset(str(path_or_name))
    return _read_cost_model(Path(path_or_name))


@cache
def _preset(name: str) -> StepCostModel:
    return _read_cost_model(PRESET_DIR / f"{name}.toml")


def _read_cost_model(path: Path) -> StepCostModel:
    if not path.is_file():
        raise FragsimError(f"cost model {str(path)!r}: no such preset or file; presets: "
                           f"{', '.join(COST_MODEL_PRESETS)}; or roofline, fixed, auto")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise FragsimError(f"{path}: not valid TOML: {exc}") from None
    coefficients = data.get("coefficients")
    if not isinstance(coefficients, dict):
        raise FragsimError(f"{path}: needs a [coefficients] table with {', '.join(TERMS)}")
    unknown = sorted(set(coefficients) - set(TERMS))
    if unknown:
        raise FragsimError(f"{path}: [coefficients] {', '.join(unknown)} unknown; "
                           f"allowed: {', '.join(TERMS)}")
    fitted_for = data.get("fitted_for", {})
    return StepCostModel(**{t: float(coefficients.get(t, 0.0)) for t in TERMS},
                         name=str(data.get("name", path.stem)), model=str(fitted_for.get("model", "")),
                         gpu=str(fitted_for.get("gpu", "")), tp=int(fitted_for.get("tp", 1)),
                         source=str(data.get("source", "")), fit=data.get("fit"))


def preset_for(model: str, gpu: str, tp: int) -> str | None:
    """The bundled fitted preset for this model, GPU and tp, if there is one."""
    for name in COST_MODEL_PRESETS:
        cm = load_cost_model(name)
        if (cm.model, cm.gpu, cm.tp) == (model, gpu, tp):
            return name
    return None


def fitted_for_note(cost: StepCostModel, model: str, gpu: str, tp: int) -> str | None:
    """A warning when a fitted model is used for another model, GPU or tp than its own."""
    want = (cost.model, cost.gpu, cost.tp)
    if not cost.model or want == (model, gpu, tp):
        return None
    return (f"cost model {cost.name!r} was fitted for {cost.model} on {cost.gpu} (tp={cost.tp}); "
            f"this run is {model} on {gpu} (tp={tp}), so its step times are a what-if")


COST_MODELS = ("auto", "roofline", "fixed", *COST_MODEL_PRESETS)


def resolve_cost_model_name(name: str, model: str, gpu: str, tp: int) -> str:
    """``auto``: the fitted preset for this model, GPU and tp, else the roofline."""
    if name != "auto":
        return name
    return preset_for(model, gpu, tp) or "roofline"


def describe_cost_model(name: str, model: ModelConfig, gpu: GPUConfig, tp: int) -> tuple[str, str | None]:
    """What a run's step times come from, in words, and a warning if a fitted model was
    fitted for another deployment (a bad name or file raises here, before anything runs)."""
    resolved = resolve_cost_model_name(name, model.name, gpu.name, tp)
    if resolved in ("roofline", "fixed"):
        label = "roofline (fitted to nothing)" if resolved == "roofline" else "fixed"
        return (label if name != "auto" else f"{label}; no fitted preset for {model.name} on "
                f"{gpu.name}"), None
    cost = load_cost_model(resolved)
    return f"{cost.name} (fitted)", fitted_for_note(cost, model.name, gpu.name, tp)


def make_cost_model(name: str, *, model: ModelConfig | None = None, gpu: GPUConfig | None = None,
                    tp: int = 1, step_time: float = 0.02, **options: float) -> CostModel:
    """``fixed``, ``roofline``, ``auto`` (a fitted preset for the model and GPU, else the
    roofline), a preset name, or a path to a fitted model's TOML file."""
    if name == "auto":
        if model is None or gpu is None:
            raise ValueError("the auto cost model needs a model and a GPU")
        name = resolve_cost_model_name(name, model.name, gpu.name, tp)
    if name == "fixed":
        return FixedCostModel(step_time_s=step_time)
    if name == "roofline":
        if model is None or gpu is None:
            raise ValueError("the roofline cost model needs a model and a GPU")
        return RooflineCostModel(model=model, gpu=gpu, tp=tp, **options)  # type: ignore[arg-type]
    if name in COST_MODEL_PRESETS or name.endswith(".toml"):
        return load_cost_model(name)
    raise ValueError(f"unknown cost model {name!r}; choose one of {', '.join(COST_MODELS)}, "
                     "or a fitted model's .toml file")
