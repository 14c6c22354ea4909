"""Every Triton kernel, with its GPU tile sizes, compiles to an sm_90 cubin (no GPU needed);
flash attention in bf16 and in fp32 (IEEE dots, smaller tiles)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from spdsl.kernels.backend import triton_available

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    if not triton_available():
        pytest.skip("triton is not installed")
    # A fresh process: kernels defined under TRITON_INTERPRET=1 cannot be compiled.
    code = ("import sys, torch\n"
            "from tests.kernels.sm90_compile import compile_recorded, record_all_launches\n"
            "lines = compile_recorded(record_all_launches((torch.bfloat16, torch.float32)))\n"
            "print('\\n'.join(lines))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) >= 15, out.stdout
    bad = [line for line in lines if not line.startswith("ok")]
    assert not bad, "\n".join(bad)
