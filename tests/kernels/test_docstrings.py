"""The examples in spdsl.kernels' docstrings run and print what they claim (reference path)."""

from __future__ import annotations

import doctest
import importlib

import pytest

from spdsl.kernels import kernel_backend

MODULES = ["spdsl.kernels", "spdsl.kernels.backend", "spdsl.kernels.reference",
           "spdsl.kernels.flash_attn", "spdsl.kernels.rms_norm", "spdsl.kernels.rope",
           "spdsl.kernels.swiglu", "spdsl.kernels.fused_linear_ce"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, monkeypatch):
    monkeypatch.delenv("SPDSL_KERNELS", raising=False)
    module = importlib.import_module(name)
    with kernel_backend("auto"):
        result = doctest.testmod(module, extraglobs={"torch": importlib.import_module("torch")})
    assert result.attempted > 0 and result.failed == 0
