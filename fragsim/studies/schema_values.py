"""Checking an experiment file's keys and values: errors that name the file, the
table and the key (:class:`Where`), tables and arrays of tables, required keys,
typed values, :class:`~fragsim.simulate.RunSpec` parameters against the field's type
and allowed values (:data:`SPEC_TYPES`, :data:`CHOICES`) and sweep axes. The tables
of a study are read with these in :mod:`fragsim.studies.schema_tables`.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Any

from fragsim.cluster.routers import ROUTERS
from fragsim.costmodel import COST_MODELS
from fragsim.engine_config import SCHEDULERS
from fragsim.errors import FragsimError
from fragsim.offload.policies import POLICIES as OFFLOAD_POLICIES
from fragsim.offload.spec import BACKENDS as OFFLOAD_BACKENDS
from fragsim.simulate import RunSpec

#: RunSpec fields a study may set, with their types (the seed lives in [study])
SPEC_TYPES: dict[str, Any] = {
    name: hint for name, hint in typing.get_type_hints(RunSpec).items() if name != "seed"
}
#: a study's own parameters beside RunSpec's: ``duration_s`` replays rate × duration_s
#: requests (:func:`fragsim.steady.requests_over`) in place of ``num_requests``
STUDY_PARAMS: dict[str, Any] = {"duration_s": float}
PARAM_TYPES = {**SPEC_TYPES, **STUDY_PARAMS}
SWEEPABLE = {**PARAM_TYPES, "seed": int}

#: RunSpec string fields with a closed set of values, checked before anything runs
CHOICES: dict[str, tuple[str, ...]] = {
    "batching": ("continuous", "static"),
    "scheduler": SCHEDULERS,
    "preemption": ("recompute", "swap"),
    "arrival": ("poisson", "gamma"),
    "cost_model": COST_MODELS,
    "fit": ("first", "best"),
    "reserve": ("max", "pow2", "oracle"),
    "kv_offloading_backend": OFFLOAD_BACKENDS,
    "kv_offloading_policy": tuple(OFFLOAD_POLICIES),
    "router": ROUTERS,
}


class Where:
    """Builds error messages that name the file and the table."""

    def __init__(self, path: Path) -> None:
        self.file = path.name

    def error(self, table: str, key: str | None, message: str) -> FragsimError:
        where = f"{self.file}: {table}" + (f" {key}" if key else "")
        return FragsimError(f"{where}: {message}")


def read_toml(path: Path, kind: str) -> dict[str, Any]:
    """``path`` read as TOML (``kind``: what the file is, for the error)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FragsimError(f"{path}: no such {kind}") from None
    except tomllib.TOMLDecodeError as exc:
        raise FragsimError(f"{path.name}: not valid TOML: {exc}") from None


# ---------------------------------------------------------------- tables and keys

def _table(where: Where, raw: Mapping[str, Any], name: str, required: bool = False) -> dict[str, Any]:
    if name not in raw:
        if required:
            raise where.error(f"[{name}]", None, "missing table")
        return {}
    value = raw[name]
    if not isinstance(value, dict):
        raise where.error(f"[{name}]", None, f"expected a table, got {type(value).__name__}")
    return value


def _list(where: Where, raw: Mapping[str, Any], name: str) -> list[Any]:
    value = raw.get(name, [])
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise where.error(f"[[{name}]]", None, "expected an array of tables")
    return value


def _no_unknown(where: Where, table: str, values: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise where.error(table, unknown[0], f"unknown key; allowed: {', '.join(sorted(allowed))}")


def _required(where: Where, table: str, key: str, values: Mapping[str, Any]) -> Any:
    if key not in values:
        raise where.error(table, key, "required")
    return values[key]


def _typed(where: Where, table: str, key: str, value: Any, kind: type) -> Any:
    if not _is_a(value, kind):
        raise where.error(table, key, f"expected {_type_name(kind)}, got {value!r}")
    return float(value) if kind is float else value


def _is_a(value: Any, kind: Any) -> bool:
    """Does a TOML value fit a RunSpec annotation (int, float, str, bool, X | None, tuple)?"""
    if isinstance(kind, UnionType) or typing.get_origin(kind) is typing.Union:
        return any(_is_a(value, k) for k in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if typing.get_origin(kind) is tuple:
        args = typing.get_args(kind)
        return (isinstance(value, list | tuple) and len(value) == len(args)
                and all(_is_a(v, a) for v, a in zip(value, args, strict=True)))
    return isinstance(value, kind)


def _type_name(kind: Any) -> str:
    if isinstance(kind, UnionType) or typing.get_origin(kind) is typing.Union:
        return " or ".join(_type_name(k) for k in typing.get_args(kind) if k is not type(None))
    if typing.get_origin(kind) is tuple:
        return f"a list of {len(typing.get_args(kind))} numbers"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        kind, getattr(kind, "__name__", str(kind)))


def spec_param(where: Where, table: str, key: str, value: Any, allow_seed: bool = False) -> Any:
    """One RunSpec value, checked against the field's type and its allowed values."""
    kind = (SWEEPABLE if allow_seed else PARAM_TYPES).get(key)
    if kind is None:
        if key == "seed":
            raise where.error(table, key, "set the seed in [study] (or sweep it in [sweep])")
        raise where.error(table, key, "unknown parameter; allowed: duration_s or any RunSpec field "
                          f"({', '.join(sorted(SPEC_TYPES))})")
    if not _is_a(value, kind):
        raise where.error(table, key, f"expected {_type_name(kind)}, got {value!r}")
    if key == "duration_s" and not value > 0:
        raise where.error(table, key, f"expected seconds > 0, got {value!r}")
    if key in CHOICES and value is not None and value not in CHOICES[key]:
        raise where.error(table, key, f"expected one of {', '.join(CHOICES[key])}, got {value!r}")
    if isinstance(value, list):
        return tuple(float(v) for v in value)
    if kind is float and isinstance(value, int):
        return float(value)
    return value


def _params(where: Where, table: str, values: Mapping[str, Any]) -> dict[str, Any]:
    _one_length(where, table, values)
    return {k: spec_param(where, table, k, v) for k, v in values.items()}


def _one_length(where: Where, table: str, values: Mapping[str, Any]) -> None:
    """A table gives a point's length as ``num_requests`` or ``duration_s``, not both (a
    more specific table may give the other: a case's ``duration_s`` over [fixed]'s count)."""
    if "num_requests" in values and "duration_s" in values:
        raise where.error(table, "duration_s", "set together with num_requests; give one "
                          "(duration_s replays rate × duration_s requests)")


def _axes(where: Where, table: str, values: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
    """Sweep axes: every value a non-empty list; workload parameters as ``workload.x``."""
    _one_length(where, table, values)
    axes: dict[str, tuple[Any, ...]] = {}
    for key, value in values.items():
        if key == "workload" and isinstance(value, dict):
            for wkey, wvalues in value.items():
                axes[f"workload.{wkey}"] = _axis(where, table, f"workload.{wkey}", wvalues)
            continue
        axes[key] = tuple(spec_param(where, table, key, v, allow_seed=True)
                          for v in _axis(where, table, key, value))
    return axes


def _axis(where: Where, table: str, key: str, value: Any) -> tuple[Any, ...]:
    if not isinstance(value, list) or not value:
        raise where.error(table, key, "expected a non-empty list")
    if len({repr(v) for v in value}) != len(value):
        raise where.error(table, key, f"repeated values in {value!r}")
    return tuple(value)
