"""The one backend switch: auto / triton / reference, its override, and its errors."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from spdsl.kernels import backend
from spdsl.kernels.backend import backend_mode, kernel_backend, use_triton


def test_auto_picks_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("SPDSL_KERNELS", raising=False)
    assert backend_mode() == "auto"
    assert use_triton(torch.zeros(1)) is False
    assert use_triton(torch.zeros(1, device="meta")) is False


def test_auto_picks_triton_on_cuda_when_installed(monkeypatch):
    monkeypatch.delenv("SPDSL_KERNELS", raising=False)
    monkeypatch.setattr(backend, "_TRITON_AVAILABLE", True)
    assert use_triton(torch.zeros(1, device="meta")) is False
    fake_cuda = SimpleNamespace(device=torch.device("cuda"))  # use_triton reads only .device
    assert use_triton(fake_cuda) is True
    monkeypatch.setattr(backend, "_TRITON_AVAILABLE", False)
    assert use_triton(fake_cuda) is False


def test_env_var_and_override_nest(monkeypatch):
    monkeypatch.setenv("SPDSL_KERNELS", "reference")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(backend, "_TRITON_AVAILABLE", True)
    assert backend_mode() == "reference"
    with kernel_backend("triton"):
        assert use_triton(torch.zeros(1)) is True
        with kernel_backend("reference"):
            assert use_triton(torch.zeros(1)) is False
        assert backend_mode() == "triton"
    assert backend_mode() == "reference"


def test_bad_mode_names_the_choices(monkeypatch):
    monkeypatch.setenv("SPDSL_KERNELS", "cuda")
    with pytest.raises(ValueError, match="auto, triton, reference"):
        backend_mode()
    with pytest.raises(ValueError, match="auto, triton, reference"), kernel_backend("fast"):
        pass


def test_forcing_triton_on_cpu_without_the_interpreter_says_how(monkeypatch):
    monkeypatch.setattr(backend, "_TRITON_AVAILABLE", True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with kernel_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        use_triton(torch.zeros(1))
    monkeypatch.setattr(backend, "_TRITON_AVAILABLE", False)
    with kernel_backend("triton"), pytest.raises(RuntimeError, match="not installed"):
        use_triton(torch.zeros(1))


def test_package_imports_and_runs_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` fail
        "import torch, spdsl.kernels as K\n"
        "assert not K.triton_available()\n"
        "x = torch.randn(2, 8)\n"
        "print(K.rms_norm(x, torch.ones(8)).shape, 'triton' in sys.modules and sys.modules['triton'])"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "SPDSL_KERNELS": "auto", "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env,
                         cwd=root, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch.Size([2, 8]) None"
