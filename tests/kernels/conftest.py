"""Kernel-test setup: run Triton under its CPU interpreter when there is no GPU.

``TRITON_INTERPRET`` must be set before triton is first imported (``tests/conftest.py`` sets
it, before any test module loads); set here too for a run of this folder from elsewhere.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from spdsl.kernels.backend import kernel_backend, triton_available


@pytest.fixture
def interpret_triton():
    """Force the Triton path on CPU tensors (the interpreter); skip when triton is absent."""
    if not triton_available():
        pytest.skip("triton is not installed (pip install triton==3.8.0)")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("TRITON_INTERPRET is off (a CUDA device is present): see the gpu tests")
    with kernel_backend("triton"):
        yield torch.device("cpu")


@pytest.fixture
def cuda_triton():
    """Force the Triton path on a real CUDA device; skip without one."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not triton_available():
        pytest.skip("triton is not installed")
    with kernel_backend("triton"):
        yield torch.device("cuda")
