"""Executors: run a list of independent tasks and hand each result back as it arrives.

All three keep one rule that makes sweeps resumable: workers only compute, and
the caller's ``on_done`` (in the driver process) stores each result the moment
it arrives. A crash, a Ctrl-C or a failing task therefore loses only the tasks
still in flight; everything already handed back is on disk.

- ``serial``: in this process, one after the other (tests, notebooks, ``--workers 1``).
- ``local``: a ``concurrent.futures.ProcessPoolExecutor`` on this machine.
- ``ray``: Ray tasks, on a local instance or on a cluster at ``address``. Ray is
  an optional dependency (``pip install 'fragsim[distributed]'``), imported only
  here. Workers on a cluster need fragsim installed and any trace files at the
  same paths.

The first failing task stops the executor (pending tasks are cancelled) and its
exception propagates: a configuration error fails every point, and there is no
use waiting for all of them to say so.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any, TypeVar

from fragsim.errors import FragsimError

T = TypeVar("T")
R = TypeVar("R")

EXECUTORS = ("serial", "local", "ray")


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def execute(tasks: Sequence[T], fn: Callable[[T], R], on_done: Callable[[T, R], None],
            executor: str = "local", workers: int | None = None, address: str | None = None) -> None:
    """Run ``fn(task)`` for every task; call ``on_done(task, result)`` in this process."""
    if executor not in EXECUTORS:
        raise FragsimError(f"unknown executor {executor!r}; choose from {', '.join(EXECUTORS)}")
    if workers is not None and workers < 1:
        raise FragsimError(f"--workers must be >= 1, got {workers}")
    if not tasks:
        return
    if executor == "ray":
        _ray(tasks, fn, on_done, workers, address)
    elif executor == "serial" or workers == 1 or len(tasks) == 1:
        for task in tasks:
            on_done(task, fn(task))
    else:
        _local(tasks, fn, on_done, workers or default_workers())


def _local(tasks: Sequence[T], fn: Callable[[T], R], on_done: Callable[[T, R], None],
           workers: int) -> None:
    pool = ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=process_context([fn.__module__]))
    try:
        pending: dict[Future[R], T] = {pool.submit(fn, task): task for task in tasks}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                task = pending.pop(future)
                on_done(task, future.result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def process_context(preload: list[str]) -> Any:
    """A forkserver that has already imported the modules ``preload``, where there is one.

    Plain fork copies whatever threads the driver runs (a progress bar's refresh
    thread, say), which is unsafe and deprecated; spawn re-imports pandas, simpy
    and fragsim in every worker. A forkserver imports them once and forks clean
    workers from that.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(preload)
    return context


def _ray(tasks: Sequence[T], fn: Callable[[T], R], on_done: Callable[[T, R], None],
         workers: int | None, address: str | None) -> None:
    try:
        import ray
    except ImportError:
        raise FragsimError(
            "--executor ray needs Ray, an optional dependency: "
            "pip install 'fragsim[distributed]' (or pip install ray)") from None
    started_here = not ray.is_initialized()
    if started_here:
        options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if address:
            options["address"] = address
        else:
            options["num_cpus"] = workers or default_workers()
        ray.init(**options)
    pending: dict[Any, T] = {}
    try:
        remote = ray.remote(num_cpus=1, max_retries=0)(fn)
        pending = {remote.remote(task): task for task in tasks}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                task = pending.pop(ref)
                on_done(task, _ray_result(ray, ref))
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise
    finally:
        if started_here:
            ray.shutdown()


def _ray_result(ray: Any, ref: Any) -> Any:
    """``ray.get``, with a task's FragsimError re-raised as itself (not wrapped in Ray's)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, FragsimError):
            raise exc.cause from None
        raise
