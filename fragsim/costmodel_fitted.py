"""The fitted step-cost model: :class:`StepCostModel`, its coefficients (:data:`TERMS`,
explained in :data:`TERM_HELP`) and the TOML file it is written as (:meth:`StepCostModel.to_toml`).

The formula is in :mod:`fragsim.costmodel`; fitting it to measurements is
:mod:`fragsim.calibrate`'s, reading its TOML files :mod:`fragsim.costmodel_presets`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from fragsim.costmodel_analytic import RooflineCostModel
from fragsim.errors import FragsimError

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
    """A step cost with fitted coefficients; see :mod:`fragsim.costmodel` for the formula.

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
