"""``fragsim run``'s runs, one per allocator: one after another in this process, or
each in a process of a pool (``--workers``), their progress and results handed back
in the allocators' order (:func:`simulate_all`).
"""

from __future__ import annotations

import functools
from typing import Any

_progress_queue: Any = None


def _init_worker(queue: Any) -> None:
    global _progress_queue
    _progress_queue = queue


def _simulate_in_worker(task: tuple[Any, int, str, Any]) -> Any:
    """Run ``i``, one allocator's, in a pool worker; its progress goes back through the queue."""
    from fragsim.simulate import simulate

    trace, i, name, spec = task
    queue = _progress_queue

    def report(done: int) -> None:
        queue.put((i, done))

    return simulate(trace, name, spec, progress=None if queue is None else report)


def simulate_all(trace: Any, allocators: list[str], spec: Any, workers: int,
                 progress: Any, on_result: Any) -> list[Any]:
    """Every allocator's run, in the order given; ``progress(i, done)`` as run ``i``'s
    requests finish (``done`` is the trace's length once it has ended) and ``on_result(i, result)`` as soon as run ``i`` and every run before it are
    done (so that what is printed keeps the allocators' order).

    With one worker the runs go one after another in this process; with more, each
    runs in a process of a pool (:func:`fragsim.sweep.process_context`), and the
    first failure cancels the runs not yet started."""
    results: list[Any] = [None] * len(allocators)
    if workers <= 1 or len(allocators) <= 1:
        from fragsim.simulate import simulate

        for i, name in enumerate(allocators):
            progress(i, 0)
            results[i] = simulate(trace, name, spec, progress=functools.partial(progress, i))
            progress(i, len(trace))
            on_result(i, results[i])
        return results
    import queue as queue_module
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    from fragsim.sweep import process_context

    context = process_context(["fragsim.simulate"])
    queue = context.Queue()
    pool = ProcessPoolExecutor(max_workers=min(workers, len(allocators)), mp_context=context,
                               initializer=_init_worker, initargs=(queue,))
    shown = 0
    try:
        pending = {pool.submit(_simulate_in_worker, (trace, i, name, spec)): i for i, name in enumerate(allocators)}
        for i in range(len(allocators)):
            progress(i, 0)
        while pending:
            done, _ = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            while True:
                try:
                    i, count = queue.get_nowait()
                except queue_module.Empty:
                    break
                if results[i] is None:   # a report may come after its run's result
                    progress(i, count)
            for future in done:
                i = pending.pop(future)
                results[i] = future.result()
                progress(i, len(trace))
            while shown < len(results) and results[shown] is not None:
                on_result(shown, results[shown])
                shown += 1
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return results
