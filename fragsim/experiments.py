"""Experiments as data: the public entry points of :mod:`fragsim.studies`.

    >>> from fragsim.experiments import load_study, expand, run_study
    >>> study = load_study("experiments/vllm_fig2.toml")      # doctest: +SKIP
    >>> [run.run_id for run in expand(study, scale=0.1)]      # doctest: +SKIP
    >>> result = run_study(study, scale=0.1, out="results")   # doctest: +SKIP
    >>> result.table[["case", "allocator", "token_states_frac"]]  # doctest: +SKIP

The implementation lives in the :mod:`fragsim.studies` package (schema, grid,
workloads, runner, figures, locate); this module keeps the short import path.
"""

from fragsim.studies import *  # noqa: F403  (the short import path re-exports it all)
from fragsim.studies import __all__  # noqa: F401
