"""One comparison used by every kernel test: forward outputs and every gradient vs the reference.

The kernel runs in the test dtype; the reference runs in fp32 on the same (already rounded)
inputs, so the tolerance measures the kernel's own error. Gradients come from one backward of
``sum(out_i * cotangent_i)`` with fixed random cotangents on every floating output, so a wrong
gradient through any output (the attention log-sum-exp included) shows up.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import pytest
import torch

from spdsl.kernels import kernel_backend
from tests._util import assert_close

INTERP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Checked with triton 3.8.0: the interpreter keeps bf16 tensors as their uint16 bit patterns
# (numpy has no bf16). Loads, stores, casts and elementwise math convert them correctly, but
# ``create_dot`` (triton/runtime/interpreter.py) hands the raw uint16 arrays to np.matmul, so a
# bf16 ``tl.dot`` multiplies bit patterns: results near 1e8 for unit inputs, wrong rather than
# imprecise. Kernels without ``tl.dot`` (RMSNorm, RoPE, SwiGLU, the cross-entropy chunk) run bf16.
BF16_DOT_REASON = ("the Triton interpreter's tl.dot multiplies bf16 operands as raw uint16 bit "
                   "patterns (numpy has no bf16 matmul), so a bf16 dot is wrong, not rounded; "
                   "the gpu-marked test covers bf16")


@functools.cache
def interpreter_dot_is_exact(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` on ``dtype`` operands matches torch's fp32 matmul under the interpreter.

    >>> interpreter_dot_is_exact(torch.float32)  # doctest: +SKIP
    True
    """
    import triton
    import triton.language as tl

    @triton.jit
    def _dot_kernel(A, B, C, N: tl.constexpr):
        r = tl.arange(0, N)
        idx = r[:, None] * N + r[None, :]
        tl.store(C + idx, tl.dot(tl.load(A + idx), tl.load(B + idx)))

    gen = torch.Generator().manual_seed(0)
    # small integers: exact in every float dtype, and their products sum exactly in fp32
    a, b = (torch.randint(-4, 5, (16, 16), generator=gen).to(dtype) for _ in range(2))
    c = torch.empty(16, 16)
    _dot_kernel[(1,)](a, b, c, N=16)
    return torch.equal(c, a.float() @ b.float())


def skip_if_interpreter_cannot_dot(dtype: torch.dtype, device: torch.device) -> None:
    """Skip a kernel built on ``tl.dot`` when the interpreter gets that dtype's dot wrong."""
    if device.type == "cpu" and not interpreter_dot_is_exact(dtype):
        pytest.skip(BF16_DOT_REASON if dtype == torch.bfloat16 else
                    f"the Triton interpreter's tl.dot is wrong for {dtype}")


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
