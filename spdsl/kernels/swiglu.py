"""SwiGLU as ``torch.ops.spdsl.swiglu`` (+ ``swiglu_backward``) and its functional.

``silu(a) * b`` elementwise, fp32 math, result in ``a.dtype``: the gate of Llama's MLP,
``down(swiglu(gate(x), up(x)))``.
"""

from __future__ import annotations

import torch

from spdsl.kernels import reference
from spdsl.kernels.backend import use_triton


@torch.library.custom_op("spdsl::swiglu", mutates_args=())
def _swiglu_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from spdsl.kernels._triton.swiglu import swiglu_fwd

    return swiglu_fwd(a, b)


@_swiglu_op.register_fake
def _(a, b):
    return a.new_empty(a.shape)


@torch.library.custom_op("spdsl::swiglu_backward", mutates_args=())
def _swiglu_backward_op(dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    from spdsl.kernels._triton.swiglu import swiglu_bwd

    return swiglu_bwd(dy, a, b)


@_swiglu_backward_op.register_fake
def _(dy, a, b):
    return a.new_empty(a.shape), b.new_empty(b.shape)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    a, b = ctx.saved_tensors
    return _swiglu_backward_op(dy, a, b)


_swiglu_op.register_autograd(_backward, setup_context=_setup_context)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` for two tensors of the same shape and dtype.

    Example::

        >>> swiglu(torch.randn(2, 3, 8), torch.randn(2, 3, 8)).shape
        torch.Size([2, 3, 8])
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"swiglu: a {a.dtype}{list(a.shape)} and b {b.dtype}{list(b.shape)} "
                         "must have the same shape and dtype")
    if use_triton(a):
        return _swiglu_op(a, b)
    return reference.swiglu(a, b)
