"""Fitting a step-cost model (:class:`~fragsim.costmodel.StepCostModel`) to measurements.

Three kinds of measurement, told apart by their columns or keys:

``steps``
    A table of measured engine steps (CSV, Parquet or JSON Lines), one row per
    step: ``num_prefill_tokens``, ``num_decode``, ``decode_context`` and the step
    time as ``step_time_s``, ``step_time_ms`` or ``step_time_us``; optionally
    ``prefill_attention_units`` (else each step's prompt tokens are taken as one
    fresh prompt, ``P (P - 1) / 2``). The fit is a bounded least-squares fit of the
    relative error of every step time (:func:`scipy.optimize.least_squares`).
``requests``
    Per-request latencies of a real run: a vLLM benchmark result saved with
    ``--save-result --save-detailed`` (JSON with ``start_times``, ``input_lens``,
    ``output_lens``, ``ttfts``, ``itls``), a BLIS trace v2 data file (CSV with
    ``send_time_us``, ``first_chunk_time_us``, ``last_chunk_time_us``,
    ``input_tokens``, ``output_tokens``, ``status``), or any table with
    ``arrival_s``, ``prompt_len``, ``output_len``, ``ttft_s`` and ``tpot_s``
    (fragsim's own ``requests.parquet``). Nobody measured the steps, so the fit
    replays the requests through the engine (``vllm``, the run's options) and
    moves the free coefficients until each request's simulated time per output
    token, and the deciles of the times to first token, match the measured ones
    (Nelder-Mead on the log-coefficients, :func:`scipy.optimize.minimize`). One
    request's wait for its first token hangs on which step it arrived in, which is
    chaotic in the coefficients; their distribution is not.
``points``
    Published operating points (TOML, ``[[points]]``): a workload, its rate, an
    allocator and the mean number of requests the measured system ran at once.
    The fit replays each point and matches the mean batch. Points marked
    ``held_out = true`` are not fitted and only reported. This is how the
    ``vllm-paper`` preset is made (``experiments/calibration/vllm_paper.toml``).
    A point replays ``num_requests`` requests (default 1,000), or its rate times
    ``duration_s`` (the point's or the file's: the paper's one-hour traces are
    ``duration_s = 3600``). After the fit each point's replay says whether its queue
    was still growing when the arrivals ended (:mod:`fragsim.steady`); the command
    refuses to write a fit whose fitted points include such a transient, unless
    ``--allow-transient``.

Measured attention: ``--attention-times kernels.json`` (the GPU backend's decode
kernel timings, :func:`attention_from_kernels`) sets the memory-bound context term
from the rate the real kernel reads KV at, and the fit then holds it.

Coefficients the fit does not free keep their prior: the roofline's (in this
shape) for the model and GPU named, so a fit from decode-only steps does not
invent a prefill cost. One row in five (``holdout``) is held back from the fit,
and the report gives the error on those rows.

Where it lives: reading the measurements in :mod:`fragsim.calibrate_measurements`,
the fits in :mod:`fragsim.calibrate_fit`, the errors they report (and
:func:`evaluate`) in :mod:`fragsim.calibrate_report`. This module keeps the short
import path and re-exports them all.
"""

# re-exported: fragsim.calibrate is where callers look (the tests also reach _steps, _requests)
from fragsim.calibrate_fit import (  # noqa: F401
    MIN_ROWS_PER_TERM,
    POINT_TERMS,
    REQUEST_TERMS,
    RIDGE,
    TYPICAL,
    fit_points,
    fit_requests,
    fit_steps,
    holdout_mask,
)
from fragsim.calibrate_measurements import (  # noqa: F401
    KINDS,
    STEP_COLUMNS,
    Measurements,
    _requests,
    _steps,
    attention_from_kernels,
    load_measurements,
    point_specs,
)
from fragsim.calibrate_report import FitReport, evaluate  # noqa: F401
