"""RMSNorm: Triton forward/backward vs the reference, and the reference vs torch's rms_norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spdsl.kernels import reference, rms_norm
from tests._util import assert_close
from tests.kernels._harness import (
    GPU_DTYPES,
    INTERP_DTYPES,
    check_vs_reference,
)

TOL = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-2, 2e-3), torch.bfloat16: (2e-2, 1e-2)}

# x shapes: rows not a multiple of the row tile, D not a power of two, a 1-D input, a wide row.
INTERP_SHAPES = [(3, 7, 96), (5, 64), (128,), (2, 3, 5, 1000)]
GPU_SHAPES = [(4, 1000, 4096), (3, 777, 5120), (17, 128)]


def _check(shape, dtype, device, eps=1e-6):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(device=device, dtype=dtype)
    rtol, atol = TOL[dtype]
    check_vs_reference(lambda x, w: rms_norm(x, w, eps), lambda x, w: reference.rms_norm(x, w, eps),
                       [x, w], [0, 1], rtol=rtol, atol=atol, name=f"rms_norm {dtype} {shape}",
                       grad_names=["x", "weight"])


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
@pytest.mark.parametrize("shape", INTERP_SHAPES, ids=str)
def test_rms_norm_matches_reference_interpret(shape, dtype, interpret_triton):
    _check(shape, dtype, interpret_triton)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_rms_norm_matches_reference_gpu(shape, dtype, cuda_triton):
    _check(shape, dtype, cuda_triton)


@pytest.mark.parametrize("shape", INTERP_SHAPES, ids=str)
def test_reference_matches_torch_rms_norm(shape):
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(shape[-1], dtype=torch.float64, requires_grad=True)
    got = reference.rms_norm(x, w, 1e-5)
    want = F.rms_norm(x, (shape[-1],), w, eps=1e-5)
    assert_close(got, want, rtol=1e-12, atol=1e-12, name="reference rms_norm")
    cot = torch.randn_like(got)
    for n, g, e in zip(("x", "w"), torch.autograd.grad((got * cot).sum(), (x, w)),
                       torch.autograd.grad((want * cot).sum(), (x, w))):
        assert_close(g, e, rtol=1e-10, atol=1e-12, name=f"reference d{n}")


def test_rms_norm_rejects_wrong_weight():
    with pytest.raises(ValueError, match=r"weight \(8,\) must be \[D\]"):
        rms_norm(torch.randn(2, 4), torch.ones(8))
