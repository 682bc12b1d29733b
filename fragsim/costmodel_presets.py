"""A cost model by name: the bundled fitted presets (:data:`COST_MODEL_PRESETS`,
``fragsim/cost_models/``), a fitted model's TOML file read (:func:`load_cost_model`),
``auto`` resolved to the preset for a model, GPU and tp or else the roofline, the
words a run prints about its step times (:func:`describe_cost_model`), and the model
built (:func:`make_cost_model`).
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from fragsim.costmodel_analytic import CostModel, FixedCostModel, RooflineCostModel
from fragsim.costmodel_fitted import TERMS, StepCostModel
from fragsim.errors import FragsimError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

if TYPE_CHECKING:
    from fragsim.catalog import GPUConfig, ModelConfig

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
    """The bundled fitted preset for this model, GPU and tp, if there is one (the first
    by name where several are: ``vllm-paper`` before ``vllm-paper-transient``)."""
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
