"""One comparison used by every kernel test: forward outputs and every gradient vs the reference.

The kernel runs in the test dtype; the reference runs in fp32 on the same (already rounded)
inputs, so the tolerance measures the kernel's own error. Gradients come from one backward of
``sum(out_i * cotangent_i)`` with fixed random cotangents on every floating output, so a wrong
gradient through any output (the attention log-sum-exp included) shows up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from spdsl.kernels import kernel_backend
from tests._util import assert_close

INTERP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BF16_REASON = ("bf16 is not supported by the Triton interpreter (TRITON_INTERPRET=1); "
               "the gpu-marked test covers it")


def skip_if_interpreter_cannot(dtype: torch.dtype, device: torch.device) -> None:
    if device.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip(BF16_REASON)


def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _fwd_bwd(fn: Callable, args: Sequence, grad_idx: Sequence[int], cotangents: list | None):
    outs = _as_tuple(fn(*args))
    if cotangents is None:
        gen = torch.Generator().manual_seed(1234)
        cotangents = [torch.randn(o.shape, generator=gen).to(o.device)
                      if o.is_floating_point() else None for o in outs]
    loss = sum((o.float() * c).sum() for o, c in zip(outs, cotangents) if c is not None)
    grads = torch.autograd.grad(loss, [args[i] for i in grad_idx])
    return outs, grads, cotangents


def check_vs_reference(kernel_fn: Callable, reference_fn: Callable, args: Sequence,
                       grad_idx: Sequence[int], *, rtol: float, atol: float, name: str,
                       grad_names: Sequence[str] | None = None) -> None:
    """Compare ``kernel_fn`` (Triton forced) with ``reference_fn`` (fp32) on ``args``.

    ``atol`` is relative to the largest magnitude of each expected tensor, so one table serves
    outputs and gradients of different scales.
    """
    args = [a.detach().requires_grad_(i in grad_idx) if isinstance(a, torch.Tensor) else a
            for i, a in enumerate(args)]
    with kernel_backend("triton"):
        outs, grads, cots = _fwd_bwd(kernel_fn, args, grad_idx, None)
    ref_args = [a.detach().float().requires_grad_(i in grad_idx)
                if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for i, a in enumerate(args)]
    ref_outs, ref_grads, _ = _fwd_bwd(reference_fn, ref_args, grad_idx, cots)
    grad_names = grad_names or [f"arg{i}" for i in grad_idx]
    pairs = [(f"out{i}", o, r) for i, (o, r) in enumerate(zip(outs, ref_outs))]
    pairs += [(f"d{n}", g, r) for n, g, r in zip(grad_names, grads, ref_grads)]
    for label, got, want in pairs:
        scale = want.detach().abs().max().item() if want.numel() else 0.0
        assert_close(got, want, rtol=rtol, atol=atol * max(scale, 1e-6), name=f"{name} {label}")
