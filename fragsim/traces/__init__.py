"""Request traces: load real ones, generate synthetic ones, cut, speed up and describe them.

A :class:`Trace` holds requests column by column (arrival time, prompt and
output length, optional prefix-block hashes); the engine replays it against an
allocator. Real traces come from files (:func:`load_trace`, which tells Azure,
Vidur, Mooncake, length-only and fragsim's own plain CSV apart by their content)
or from the copies shipped in the package (:data:`BUNDLED_TRACES`); synthetic
ones from :func:`make_workload`. Length-only data gets arrivals from
:func:`assign_arrivals`; :func:`slice_trace` and :func:`scale_time` pick a window
and change the rate; :func:`scale_load` merges copies of a trace for several times its load.
"""

from fragsim.traces.arrivals import ARRIVAL_PROCESSES, assign_arrivals
from fragsim.traces.loaders import BUNDLED_TRACES, load_trace, save_trace
from fragsim.traces.request import Request, Trace
from fragsim.traces.stats import trace_stats
from fragsim.traces.transforms import scale_load, scale_time, slice_trace
from fragsim.traces.workloads import WORKLOADS, Workload, make_workload

__all__ = [
    "ARRIVAL_PROCESSES",
    "BUNDLED_TRACES",
    "WORKLOADS",
    "Request",
    "Trace",
    "Workload",
    "assign_arrivals",
    "load_trace",
    "make_workload",
    "save_trace",
    "scale_load",
    "scale_time",
    "slice_trace",
    "trace_stats",
]
