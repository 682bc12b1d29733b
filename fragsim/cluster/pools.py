"""A cluster's pools and who serves what: the instances' roles, and the router process
that sends each request to them.

Roles: ``mixed`` instances serve a request whole; with prefill/decode disaggregation
(:mod:`fragsim.cluster.disagg`) a request's prompt runs on a ``prefill`` instance and
its answer on a ``decode`` instance. Each pool has its own copy of the router policy
(:mod:`fragsim.cluster.routers`), which picks among that pool's instances.

At a request's arrival the router picks its decode instance first. The decider then
asks, as llm-d's P/D decider does, whether the prompt is worth a prefill instance: a
prompt whose tokens not already cached there (by the router's estimate) are fewer
than the threshold runs whole on a mixed instance, or, with no mixed pool, on that
decode instance. Else it picks a prefill instance and sends the request there; the
decode instance gets it when its prefill ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import simpy

from fragsim.errors import FragsimError

ROLES = ("mixed", "prefill", "decode")


def roles_of(spec: Any) -> list[str]:
    """Each instance's role: prefill ones first, then decode, then mixed."""
    n, p, d = spec.instances, spec.prefill_instances, spec.decode_instances
    if p < 0 or d < 0:
        raise FragsimError(f"--prefill-instances and --decode-instances must be >= 0, got {p} and {d}")
    if p and not d:
        raise FragsimError(f"--prefill-instances {p}: a prefill pool needs a decode pool "
                           "(--decode-instances >= 1)")
    if d and not p:
        raise FragsimError(f"--decode-instances {d}: a decode pool needs a prefill pool "
                           "(--prefill-instances >= 1)")
    if p + d > n:
        raise FragsimError(f"--prefill-instances {p} plus --decode-instances {d} exceed --instances {n}")
    if spec.pd_threshold < 0:
        raise FragsimError(f"--pd-threshold must be >= 0 tokens, got {spec.pd_threshold}")
    return ["prefill"] * p + ["decode"] * d + ["mixed"] * (n - p - d)


class Pools:
    """The instances grouped by role, each pool with its own router policy."""

    def __init__(self, roles: Sequence[str], engines: Sequence[Any], make_policy: Any) -> None:
        self.roles = list(roles)
        self.members = {role: [i for i, r in enumerate(roles) if r == role] for role in ROLES}
        self.policies = {role: make_policy([engines[i] for i in members])
                         for role, members in self.members.items() if members}
        self.decode_of: dict[int, int] = {}   # req -> the decode instance its prefill hands to
        self.num_disaggregated = 0

    def pick(self, role: str, req: int, engines: Sequence[Any]) -> int:
        members = self.members[role]
        return members[self.policies[role].pick(req, [engines[i] for i in members])]

    def routed(self, role: str, req: int, instance: int, engines: Sequence[Any]) -> None:
        members = self.members[role]
        self.policies[role].routed(req, members.index(instance), [engines[i] for i in members])

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"num_disaggregated": self.num_disaggregated}
        estimates = [p.summary().get("router_estimated_hit_tokens") for p in self.policies.values()]
        if any(e is not None for e in estimates):
            out["router_estimated_hit_tokens"] = int(sum(e or 0 for e in estimates))
        return out


def route_disaggregated(env: simpy.Environment, arrival: np.ndarray, prompt: np.ndarray,
                        engines: Sequence[Any], pools: Pools, threshold: int,
                        urgent: Any, push: Any = None):  # type: ignore[no-untyped-def]
    """At each arrival, first of everything at that time: its decode instance, then
    where its prompt runs (see the module docstring). ``push(req, prefill, decode)``:
    the decode instance gets the request now, for a layer-wise push
    (:mod:`fragsim.cluster.layerwise`); False: it gets it when its prefill ends."""
    for req, t in enumerate(arrival.tolist()):
        if t > env.now:
            yield urgent(env, t - env.now)
        d = pools.pick("decode", req, engines)
        uncached = int(prompt[req]) - pools.policies["decode"].expected_hit(req)
        if uncached < threshold:
            whole = pools.pick("mixed", req, engines) if pools.members["mixed"] else d
            role = pools.roles[whole]
            engines[whole].requests.route(req)
            pools.routed(role, req, whole, engines)
            if whole != d:
                pools.policies["decode"].forget(req)
            engines[whole].poke()
            continue
        pools.routed("decode", req, d, engines)
        p = pools.pick("prefill", req, engines)
        engines[p].requests.route(req)
        pools.routed("prefill", req, p, engines)
        pools.num_disaggregated += 1
        if push is None or not push(req, p, d):
            pools.decode_of[req] = d
            engines[d].requests.num_expected += 1  # its load, as the router counts it
        engines[p].poke()
    for i, engine in enumerate(engines):
        if pools.roles[i] != "decode":  # a decode instance gets hand-ins until every prefill ends
            engine.requests.routing_done = True
            engine.poke()
