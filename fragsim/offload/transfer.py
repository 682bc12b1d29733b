"""A transfer between the GPU and a tier: its phases (host link, disk I/O), run in order
as a SimPy process, each holding one resource (:mod:`fragsim.offload.connector`)."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import simpy

from fragsim.offload.level import Level


@dataclass(eq=False)
class Transfer:
    """One job: phases run in order, each holding one resource for its seconds."""

    kind: str                                   # "load", "store" or "disk_write"
    req: int                                    # -1: no request (lazy stores)
    keys: list[int]
    tokens: int
    phases: list[tuple[simpy.Resource, float]]
    ready: float                                # when it may start
    level: Level | None = None                  # the tier it reads or writes
    start: float | None = None                  # when its first phase took its resource
    end: float | None = None                    # known once its last phase holds its resource

    @property
    def seconds(self) -> float:
        return sum(s for _, s in self.phases)


def run(env: simpy.Environment, job: Transfer) -> Generator[simpy.Event, Any, None]:
    """``job``'s phases in order, each holding its resource for its seconds."""
    if job.ready > env.now:
        yield env.timeout(job.ready - env.now)
    last = len(job.phases) - 1
    for i, (resource, seconds) in enumerate(job.phases):
        with resource.request() as turn:
            yield turn
            if job.start is None:
                job.start = float(env.now)
            if i == last:
                job.end = float(env.now) + seconds
            yield env.timeout(seconds)


def next_done(jobs: list[Transfer], now: float, env: simpy.Environment | None) -> float | None:
    """The earliest time a transfer in flight may land (None: nothing in flight)."""
    ends = [job.end for job in jobs if job.end is not None]
    if ends:
        return min(ends)
    waits = [job.ready + job.seconds for job in jobs]
    if not waits:
        return None
    # A job still queued for a later phase may be later than its bound: then the
    # next event of the environment (a phase ending) is the earliest change.
    earliest = min(waits)
    if earliest <= now and env is not None:
        earliest = max(earliest, float(env.peek()))
    return earliest
