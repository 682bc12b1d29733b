"""``fragsim cluster CONFIG.toml``: a cluster of heterogeneous pools, read from TOML.

::

    [cluster]                     # what the instances share (all optional)
    router = "least-loaded"       # round-robin, least-loaded, prefix-aware
    slo_ttft_s = 2.0              # goodput: a request meets both SLOs
    slo_tpot_s = 0.1
    kv_transfer_bandwidth_gbps = 25.0   # prefill -> decode link, GB/s per GPU
    kv_transfer_latency_ms = 1.0
    kv_transfer_layerwise = false # push each layer's KV as the prefill computes it
    pd_threshold = 256            # fewer uncached prompt tokens: served whole

    [workload]                    # the trace: RunSpec's trace fields
    trace = "azure-conv"
    load_scale = 4                # 4 seeded copies merged: 4 times its rate

    [defaults]                    # RunSpec fields every pool starts from (optional)
    model = "llama-3.1-8b"        # as fragsim run: llama-3.1-8b on h100-80gb, the
    max_num_batched_tokens = 8192 # model's context, step times fitted where known
    allocator = "vllm"            # every pool's allocator or KV manager (default vllm)

    [[pools]]                     # one table per pool
    name = "prefill"              # default: its role (numbered if repeated)
    role = "prefill"              # mixed (default), prefill or decode
    count = 2                     # instances (default 1)

    [[pools]]
    role = "decode"
    count = 3
    allocator = "vllm"            # its own (default: [defaults]' allocator)
    gpu = "a100-80gb"             # any RunSpec deployment field: model, gpu, tp,
    max_num_seqs = 512            # block_size, kv_slots, cost_model, preemption, ...

Every error names the file, the table and the key.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from fragsim.cluster.cluster import Member, Settings
from fragsim.cluster.pools import ROLES
from fragsim.errors import FragsimError

#: RunSpec fields that describe the trace, set once in [workload]
WORKLOAD_KEYS = ("trace", "rate", "arrival", "cv", "num_requests", "time_window_s", "seed",
                 "load_scale", "system_prompt_len", "truncate_prompts")
#: RunSpec fields of a cluster as a whole (set in [cluster], or fixed by the pools)
CLUSTER_ONLY = ("instances", "router", "slo_ttft_s", "slo_tpot_s", "prefill_instances",
                "decode_instances", "kv_transfer_bandwidth_gbps", "kv_transfer_latency_ms",
                "kv_transfer_layerwise", "pd_threshold")
_POOL_KEYS = ("name", "role", "count", "allocator")
#: what a pool starts from, as ``fragsim run`` does (max_seq_len: the model's context)
BASE = {"model": "llama-3.1-8b", "gpu": "h100-80gb", "cost_model": "auto"}


@dataclasses.dataclass
class ClusterConfig:
    workload: Any               # a RunSpec holding the trace fields
    members: list[Member]
    settings: Settings
    raw: dict[str, Any]         # the file's tables, as read (for config.json)

    @property
    def label(self) -> str:
        allocators = dict.fromkeys(m.allocator for m in self.members)
        return "+".join(allocators)


def load_cluster(path: str | Path) -> ClusterConfig:
    """Read and check a cluster file (see the module docstring)."""
    from fragsim.simulate import RunSpec
    from fragsim.studies.schema_values import Where, read_toml, spec_param

    path = Path(path)
    where = Where(path)
    raw = read_toml(path, "cluster file")
    unknown = set(raw) - {"cluster", "workload", "defaults", "pools"}
    if unknown:
        raise where.error(f"[{sorted(unknown)[0]}]", None,
                          "unknown table; allowed: [cluster], [workload], [defaults], [[pools]]")
    settings = _settings(where, raw.get("cluster", {}))
    workload = {}
    for key, value in _table(where, raw, "workload").items():
        if key not in WORKLOAD_KEYS:
            raise where.error("[workload]", key, f"not a trace field; allowed: {', '.join(WORKLOAD_KEYS)}")
        workload[key] = value if key == "seed" else spec_param(where, "[workload]", key, value)
    defaults = _table(where, raw, "defaults")
    default_allocator = defaults.get("allocator", "vllm")  # every pool's, unless it names its own
    if not isinstance(default_allocator, str):
        raise where.error("[defaults]", "allocator", f"expected a name, got {default_allocator!r}")
    defaults = _deployment(where, "[defaults]", {k: v for k, v in defaults.items() if k != "allocator"})
    pools = raw.get("pools")
    if not isinstance(pools, list) or not pools:
        raise where.error("[[pools]]", None, "missing: at least one pool")
    members: list[Member] = []
    names: dict[str, int] = {}
    for i, pool in enumerate(pools):
        table = f"[[pools]] #{i + 1}"
        if not isinstance(pool, dict):
            raise where.error(table, None, "expected a table")
        role = pool.get("role", "mixed")
        if role not in ROLES:
            raise where.error(table, "role", f"expected one of {', '.join(ROLES)}, got {role!r}")
        count = pool.get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise where.error(table, "count", f"expected an integer >= 1, got {count!r}")
        name = pool.get("name", role if role not in names else f"{role}{len(names)}")
        if not isinstance(name, str) or not name:
            raise where.error(table, "name", f"expected a non-empty string, got {name!r}")
        if name in names:
            raise where.error(table, "name", f"{name!r} names pool #{names[name] + 1} already")
        names[name] = i
        allocator = pool.get("allocator", default_allocator)
        fields = {**BASE, **defaults,
                  **_deployment(where, table, {k: v for k, v in pool.items() if k not in _POOL_KEYS})}
        spec = _with_context(RunSpec(**{**workload, **fields, "router": settings.router}), fields)
        _check_allocator(where, table, allocator, spec)
        members += [Member(name, role, spec, allocator)] * count
    roles = {m.role for m in members}
    if "decode" in roles and "prefill" not in roles:
        raise where.error("[[pools]]", "role", "a decode pool needs a prefill pool")
    if "prefill" in roles and "decode" not in roles:
        raise where.error("[[pools]]", "role", "a prefill pool needs a decode pool")
    return ClusterConfig(RunSpec(**workload), members, settings, raw)


def _with_context(spec: Any, fields: dict[str, Any]) -> Any:
    """max_seq_len, unless set: the model's context, as ``fragsim run`` takes it."""
    if "max_seq_len" in fields:
        return spec
    from fragsim.simulate_spec import _model_gpu

    try:
        model, _ = _model_gpu(spec)
    except FragsimError:
        return spec  # the pool's check names the unknown model
    return dataclasses.replace(spec, max_seq_len=int(model.max_position_embeddings))


def _table(where: Any, raw: dict[str, Any], name: str) -> dict[str, Any]:
    value = raw.get(name, {})
    if not isinstance(value, dict):
        raise where.error(f"[{name}]", None, "expected a table")
    return value


def _settings(where: Any, values: Any) -> Settings:
    if not isinstance(values, dict):
        raise where.error("[cluster]", None, "expected a table")
    from fragsim.studies.schema_values import spec_param

    known = {f.name for f in dataclasses.fields(Settings)}
    out = {}
    for key, value in values.items():
        if key not in known:
            raise where.error("[cluster]", key, f"unknown key; allowed: {', '.join(sorted(known))}")
        out[key] = spec_param(where, "[cluster]", key, value)
    settings = Settings(**out)
    if settings.kv_transfer_bandwidth_gbps <= 0:
        raise where.error("[cluster]", "kv_transfer_bandwidth_gbps", "must be > 0")
    if settings.kv_transfer_latency_ms < 0:
        raise where.error("[cluster]", "kv_transfer_latency_ms", "must be >= 0")
    if settings.pd_threshold < 0:
        raise where.error("[cluster]", "pd_threshold", "must be >= 0 tokens")
    for key in ("slo_ttft_s", "slo_tpot_s"):
        if getattr(settings, key) <= 0:
            raise where.error("[cluster]", key, "must be > 0 seconds")
    return settings


def _deployment(where: Any, table: str, values: dict[str, Any]) -> dict[str, Any]:
    from fragsim.studies.schema_values import spec_param

    out = {}
    for key, value in values.items():
        if key in WORKLOAD_KEYS:
            raise where.error(table, key, "a trace field: set it once, in [workload]")
        if key in CLUSTER_ONLY:
            raise where.error(table, key, "a cluster setting: set it in [cluster] (or by the pools)")
        out[key] = spec_param(where, table, key, value)
    return out


def _check_allocator(where: Any, table: str, allocator: str, spec: Any) -> None:
    """The allocator exists, and the pool's model leaves room for a KV cache."""
    from fragsim.allocators import PLACEMENTS, PRESETS
    from fragsim.hybrid import MANAGERS
    from fragsim.simulate_spec import pool_bytes

    known = [*PRESETS, *PLACEMENTS, *MANAGERS]
    if allocator not in known:
        raise where.error(table, "allocator", f"unknown allocator {allocator!r}; known: {', '.join(known)}")
    try:  # the model and GPU exist, and the model's weights leave room for KV
        pool_bytes(spec)
    except FragsimError as exc:
        raise where.error(table, None, str(exc)) from None
