"""SwiGLU: Triton forward/backward vs the reference, and the reference vs silu(a) * b."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spdsl.kernels import reference, swiglu
from tests._util import assert_close
from tests.kernels._harness import (
    GPU_DTYPES,
    INTERP_DTYPES,
    check_vs_reference,
)

TOL = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-2, 2e-3), torch.bfloat16: (2e-2, 1e-2)}
INTERP_SHAPES = [(5, 77), (2, 3, 300), (1,)]
GPU_SHAPES = [(4, 1000, 11008), (3, 513, 1000)]


def _check(shape, dtype, device):
    gen = torch.Generator().manual_seed(0)
    a, b = ((torch.randn(shape, generator=gen) * 3).to(device=device, dtype=dtype)
            for _ in range(2))
    rtol, atol = TOL[dtype]
    check_vs_reference(swiglu, reference.swiglu, [a, b], [0, 1], rtol=rtol, atol=atol,
                       name=f"swiglu {dtype} {shape}", grad_names=["a", "b"])


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
@pytest.mark.parametrize("shape", INTERP_SHAPES, ids=str)
def test_swiglu_matches_reference_interpret(shape, dtype, interpret_triton):
    _check(shape, dtype, interpret_triton)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_swiglu_matches_reference_gpu(shape, dtype, cuda_triton):
    _check(shape, dtype, cuda_triton)


def test_reference_matches_silu_times_b():
    a = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    got = reference.swiglu(a, b)
    want = a * torch.sigmoid(a) * b
    assert_close(got, want, rtol=1e-12, atol=1e-14, name="reference swiglu")
    assert torch.autograd.gradcheck(reference.swiglu, (a, b))
    assert_close(got, F.silu(a) * b, rtol=1e-12, atol=1e-14, name="silu")
