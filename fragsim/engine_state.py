"""What the stretch and request-batching helpers see of the engine.

:mod:`fragsim.stretch` and :mod:`fragsim.request_batching` advance the engine's
state in bulk; they are written against this protocol rather than the
:class:`~fragsim.engine.Engine` class, so the engine imports them and they import
nothing of the engine's module.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from fragsim.allocators import Allocator
from fragsim.batch import DecodeBatch
from fragsim.costmodel import CostModel
from fragsim.engine_config import EngineConfig
from fragsim.kv_manager import KVManager
from fragsim.metrics import Recorder


class EngineState(Protocol):
    """The engine's per-run state and the step pieces the helpers call."""

    cfg: EngineConfig
    alloc: Allocator
    cost: CostModel
    rec: Recorder
    batch: DecodeBatch
    observer: Any
    N: int
    now: float
    g: int
    num_steps: int
    num_prefill_tokens: int
    grows: bool
    block_size: int
    capacity: int
    arrival: np.ndarray
    final: np.ndarray
    generated: np.ndarray
    first_token: np.ndarray
    preemptions: np.ndarray
    next_servable: np.ndarray
    servable_cum: np.ndarray
    waiting: deque[int]
    swapped: deque[tuple[int, int, int]]
    prefilling: list[Any]
    _next: int
    _quiet: bool
    _decode_step_time: Callable[[int, int], float] | None
    _freed: bool
    _budget: int
    _step_extra: float
    _chunks: list[tuple[Any, int]]
    _static_running: bool

    @property
    def kv(self) -> KVManager: ...

    def _pull_arrivals(self) -> None: ...

    def _expire_waiting(self) -> None: ...

    def _admit(self) -> bool: ...

    def _take(self, req: int, owned: int, delta: int = 1) -> None: ...

    def _finish(self, req: int) -> None: ...

    def _check(self) -> None: ...
