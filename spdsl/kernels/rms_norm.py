"""RMSNorm as ``torch.ops.spdsl.rms_norm`` (+ ``rms_norm_backward``) and its functional.

``y = x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, computed in fp32 and stored in
``x.dtype``; the op also returns the fp32 ``rstd`` it saves for backward.
"""

from __future__ import annotations

import torch

from spdsl.kernels import reference
from spdsl.kernels.backend import use_triton


@torch.library.custom_op("spdsl::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    from spdsl.kernels._triton.rms_norm import rms_norm_fwd

    return rms_norm_fwd(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("spdsl::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                          rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from spdsl.kernels._triton.rms_norm import rms_norm_bwd

    return rms_norm_bwd(dy, x, weight, rstd)


@_rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_backward_op(dy, x, weight, rstd)
    return dx, dw, None


_rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim of ``x [..., D]`` with ``weight [D]``.

    Example::

        >>> rms_norm(torch.randn(2, 5, 64), torch.ones(64)).shape
        torch.Size([2, 5, 64])
    """
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} must be [D] = "
                         f"{tuple(x.shape[-1:])} for x {tuple(x.shape)}")
    if use_triton(x):
        return _rms_norm_op(x, weight, float(eps))[0]
    return reference.rms_norm(x, weight, eps)
