"""RoPE: Triton forward/backward vs the reference, and the reference vs complex rotation."""

from __future__ import annotations

import pytest
import torch

from spdsl.kernels import reference, rope
from tests._util import assert_close
from tests.kernels._harness import (
    GPU_DTYPES,
    INTERP_DTYPES,
    check_vs_reference,
)

TOL = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-2, 2e-3), torch.bfloat16: (2e-2, 1e-2)}


def tables(batch: int | None, s: int, d: int, *, offset: int = 0, base: float = 10000.0):
    """Llama cos/sin tables for positions ``offset..offset+s`` ([S, D], or [B, S, D])."""
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    pos = torch.arange(offset, offset + s, dtype=torch.float64)
    ang = torch.outer(pos, inv).repeat(1, 2)  # [S, D]: the two halves share frequencies
    if batch is not None:
        ang = ang[None] * torch.linspace(0.5, 1.5, batch, dtype=torch.float64)[:, None, None]
    return ang.cos(), ang.sin()


# (B, H, S, D, per_batch_tables, table_grads)
INTERP_CASES = [
    pytest.param((2, 3, 11, 64, False, False), id="s11-d64"),
    pytest.param((1, 2, 37, 128, True, False), id="batch-tables-s37-d128"),
    pytest.param((1, 1, 9, 20, False, True), id="table-grads-s9-d20"),
]
GPU_CASES = [
    pytest.param((2, 16, 1000, 128, False, False), id="s1000-d128"),
    pytest.param((3, 8, 513, 64, True, True), id="batch-tables-grads-s513-d64"),
]


def _check(case, dtype, device):
    b, h, s, d, per_batch, table_grads = case
    x = torch.randn(b, h, s, d, generator=torch.Generator().manual_seed(0))
    cos, sin = tables(b if per_batch else None, s, d, offset=5)
    x, cos, sin = (t.to(device=device, dtype=dtype) for t in (x, cos, sin))
    rtol, atol = TOL[dtype]
    check_vs_reference(rope, reference.rope, [x, cos, sin], [0, 1, 2] if table_grads else [0],
                       rtol=rtol, atol=atol, name=f"rope {dtype}", grad_names=["x", "cos", "sin"])


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
@pytest.mark.parametrize("case", INTERP_CASES)
def test_rope_matches_reference_interpret(case, dtype, interpret_triton):
    _check(case, dtype, interpret_triton)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", GPU_CASES)
def test_rope_matches_reference_gpu(case, dtype, cuda_triton):
    _check(case, dtype, cuda_triton)


def test_reference_matches_complex_rotation():
    """rotate_half RoPE == rotating the pairs (x_i, x_{i+D/2}) by their angle in C."""
    b, h, s, d = 2, 3, 7, 16
    x = torch.randn(b, h, s, d, dtype=torch.float64)
    cos, sin = tables(None, s, d, offset=3)
    got = reference.rope(x, cos, sin)
    z = torch.complex(x[..., : d // 2], x[..., d // 2:])
    angle = torch.atan2(sin[:, : d // 2], cos[:, : d // 2])
    rotated = z * torch.polar(torch.ones_like(angle), angle)
    want = torch.cat((rotated.real, rotated.imag), dim=-1)
    assert_close(got, want, rtol=1e-12, atol=1e-12, name="reference rope")


def test_rope_rejects_bad_tables():
    with pytest.raises(ValueError, match="must both be"):
        rope(torch.randn(1, 1, 4, 8), torch.ones(5, 8), torch.ones(5, 8))
    with pytest.raises(ValueError, match="must be even"):
        rope(torch.randn(1, 1, 4, 7), torch.ones(4, 7), torch.ones(4, 7))
