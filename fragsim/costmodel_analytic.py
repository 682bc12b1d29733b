"""The step-cost protocol every model meets, and the two models fitted to nothing.

:class:`CostModel` is what the engine asks of a cost model; :class:`FixedCostModel`
gives every step the same time (for analytic checks) and :class:`RooflineCostModel`
bounds a step by compute or by memory traffic (the formula is in
:mod:`fragsim.costmodel`). The fitted model is :mod:`fragsim.costmodel_fitted`'s;
choosing one by name is :mod:`fragsim.costmodel_presets`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

import numpy as np

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
    """Roofline of a model on a GPU; see :mod:`fragsim.costmodel` for the formula.

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
