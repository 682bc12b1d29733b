"""Shared test setup.

The GPU backend's Triton kernels run through Triton's interpreter on CPU tensors
when no CUDA device is present; the interpreter must be switched on before
``triton`` is first imported, so it is done here, before any test module loads.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# `--hypothesis-profile=long` for a deeper search than CI's default (profiles must
# exist before test modules load, hence here).
settings.register_profile("long", max_examples=2000, deadline=None)


def _cuda_available() -> bool:
    # Importing torch costs seconds; only ask it when an NVIDIA driver is there at all.
    if not (Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists()):
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


if not os.environ.get("FRAGSIM_TEST_CUDA") and not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
# The public traces the project was built on sit beside the repository, in
# shared/traces; FRAGSIM_SHARED_TRACES points elsewhere.
SHARED_TRACES = Path(os.environ.get("FRAGSIM_SHARED_TRACES", REPO_ROOT.parent / "shared" / "traces"))


@pytest.fixture
def shared_traces() -> Path:
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"public traces folder not found at {SHARED_TRACES}")
    return SHARED_TRACES
