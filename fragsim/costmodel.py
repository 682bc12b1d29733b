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

Where it lives: the protocol and the fixed and roofline models in
:mod:`fragsim.costmodel_analytic`, the fitted model and its TOML form in
:mod:`fragsim.costmodel_fitted`, the presets, reading TOML files and choosing a
model by name in :mod:`fragsim.costmodel_presets`. This module keeps the short
import path and re-exports them all.
"""

# re-exported: fragsim.costmodel is where callers look
from fragsim.costmodel_analytic import CostModel, FixedCostModel, RooflineCostModel  # noqa: F401
from fragsim.costmodel_fitted import TERM_HELP, TERMS, StepCostModel  # noqa: F401
from fragsim.costmodel_presets import (  # noqa: F401
    COST_MODEL_PRESETS,
    COST_MODELS,
    PRESET_DIR,
    describe_cost_model,
    fitted_for_note,
    load_cost_model,
    make_cost_model,
    preset_for,
    resolve_cost_model_name,
)
