"""One simulation, as a library call: a workload, a model on a GPU, an allocator.

    >>> from fragsim.simulate import RunSpec, load_workload, simulate
    >>> spec = RunSpec(trace="azure-conv", num_requests=200)
    >>> result = simulate(load_workload(spec), "vllm", spec)
    >>> result.summary["token_states_frac"]            # doctest: +SKIP

``RunSpec`` holds every parameter of a run (it is what ``config.json`` stores);
``simulate`` builds the allocator, cost model and engine from it, runs, and
returns the summary row, the per-request table and the time series.

Where it lives: :class:`RunSpec` and what it names (the workload, the model and
GPU, the pool size) in :mod:`fragsim.simulate_spec`, building the allocator, cost
model and engine in :mod:`fragsim.simulate_build`, the summary row and request table
in :mod:`fragsim.simulate_summary`; :func:`simulate` runs them and this module
re-exports their names.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from fragsim import __version__

# re-exported: fragsim.simulate is where callers look
from fragsim.simulate_build import (  # noqa: F401
    is_hybrid_manager,
    make_allocator,
    make_engine,
    make_hybrid_manager,
)
from fragsim.simulate_spec import (  # noqa: F401
    DEFAULT_ALLOCATORS,
    DEFAULT_BEAM_THETA,
    RunSpec,
    _model_gpu,
    beam_theta,
    load_workload,
    pool_bytes,
    pool_slots,
)
from fragsim.simulate_summary import summarize


@dataclass
class RunResult:
    allocator: str
    summary: dict[str, Any]
    requests: pd.DataFrame
    timeseries: pd.DataFrame
    address_map: dict[str, Any] | None = field(default=None)


def simulate(trace: Any, allocator_name: str, spec: RunSpec,
             progress: Callable[[int], None] | None = None, check: bool = False,
             cost: Any = None) -> RunResult:
    """One run; with ``spec.instances > 1`` a cluster of them behind ``spec.router``
    (:func:`fragsim.cluster.run_cluster`, whose result reads the same)."""
    if spec.instances > 1 or spec.prefill_instances or spec.decode_instances or spec.kv_transfer_layerwise:
        from fragsim.cluster import run_cluster

        return run_cluster(trace, allocator_name, spec, spec.instances, spec.router,  # type: ignore[return-value]
                           progress=progress, check=check, slo_ttft_s=spec.slo_ttft_s,
                           slo_tpot_s=spec.slo_tpot_s)
    engine = make_engine(trace, allocator_name, spec, progress=progress, check=check, cost=cost)
    t0 = time.perf_counter()
    engine.run()
    wall = time.perf_counter() - t0
    model, _ = _model_gpu(spec)
    summary, requests = summarize(engine, allocator_name, wall, model.kv_bytes_per_token_per_gpu(spec.tp))
    series = pd.DataFrame(engine.rec.timeseries())
    if engine.kv.unit == "bytes":
        kinds = pd.DataFrame(engine.kv.timeseries())  # type: ignore[attr-defined]
        series = series.merge(kinds, on="time_s", how="left") if len(kinds) else series
    return RunResult(allocator_name, summary, requests, series, engine.address_sampler.address_map())


def run_config(spec: RunSpec, allocators: list[str]) -> dict[str, Any]:
    """What ``config.json`` records: every parameter, the seed and the version."""
    return {"fragsim_version": __version__, "allocators": allocators, **spec.to_dict()}
