"""RoPE as ``torch.ops.spdsl.rope`` (+ ``rope_backward``) and its functional.

Rotate-half formulation on ``[B, H, S, D]``: ``out = x * cos + rotate_half(x) * sin``, with
``cos``/``sin`` ``[S, D]`` or ``[B, S, D]`` already sliced to the rank's positions (spdsl's
lowering hands each rank its slice of the global tables).
"""

from __future__ import annotations

import torch

from spdsl.kernels import reference
from spdsl.kernels.backend import use_triton


@torch.library.custom_op("spdsl::rope", mutates_args=())
def _rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from spdsl.kernels._triton.rope import rope_apply

    return rope_apply(x, cos, sin, backward=False)


@_rope_op.register_fake
def _(x, cos, sin):
    return x.new_empty(x.shape)


@torch.library.custom_op("spdsl::rope_backward", mutates_args=())
def _rope_backward_op(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from spdsl.kernels._triton.rope import rope_apply

    return rope_apply(dy, cos, sin, backward=True)


@_rope_backward_op.register_fake
def _(dy, cos, sin):
    return dy.new_empty(dy.shape)


def _setup_context(ctx, inputs, output) -> None:
    x, cos, sin = inputs
    # x is only needed for gradients of the tables, which are usually constant buffers:
    # saving it otherwise would keep one more activation alive per layer.
    ctx.table_grads = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    ctx.save_for_backward(cos, sin, x if ctx.table_grads else None)


def _table_grad(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    dims = (0, 1) if like.dim() == 2 else (1,)
    return g.sum(dims).to(like.dtype)


def _backward(ctx, dy):
    cos, sin, x = ctx.saved_tensors
    dx = _rope_backward_op(dy, cos, sin)
    dcos = dsin = None
    if ctx.table_grads:
        dyf, xf = dy.float(), x.float()
        dcos = _table_grad(dyf * xf, cos)
        dsin = _table_grad(dyf * reference.rotate_half(xf), sin)
    return dx, dcos, dsin


_rope_op.register_autograd(_backward, setup_context=_setup_context)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply rotary position embeddings to ``x [B, H, S, D]``.

    Example::

        >>> x = torch.randn(2, 4, 6, 16)
        >>> ang = torch.arange(6.0)[:, None] * torch.ones(16)
        >>> rope(x, ang.cos(), ang.sin()).shape
        torch.Size([2, 4, 6, 16])
    """
    b, _, s, d = x.shape
    if d % 2:
        raise ValueError(f"rope: head dim {d} of x {tuple(x.shape)} must be even")
    if cos.shape != sin.shape or cos.shape not in ((s, d), (b, s, d)):
        raise ValueError(f"rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be "
                         f"[S, D] = {(s, d)} or [B, S, D] = {(b, s, d)} for x {tuple(x.shape)}")
    if use_triton(x):
        return _rope_op(x, cos, sin)
    return reference.rope(x, cos, sin)
