"""Fused linear + cross-entropy as ``torch.ops.spdsl.fused_linear_cross_entropy`` + functional.

Returns ``(loss_sum, valid_count)`` instead of a mean so a sequence-parallel caller can
all-reduce both and divide: the exact global mean over valid tokens, however unevenly the
``ignore_index`` labels fall across ranks. Neither pass materialises the ``[N, V]`` logits.

Triton path: gradients are computed in the forward, chunk by chunk, and stashed (see
``_triton/cross_entropy.py``); the op's extra outputs carry them to backward. Reference path:
the same chunking in plain PyTorch, recomputing each chunk in backward (checkpointing). Under
selective activation checkpointing this op should be saved, not recomputed: recomputing it
redoes the whole loss with its gradients.
"""

from __future__ import annotations

import torch

from spdsl.kernels import reference
from spdsl.kernels.backend import use_triton
from spdsl.kernels.reference import IGNORE_INDEX, default_chunk_size


@torch.library.custom_op("spdsl::fused_linear_cross_entropy", mutates_args=())
def _flce_op(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
             ignore_index: int, chunk_size: int, grad_hidden: bool, grad_weight: bool,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from spdsl.kernels._triton.cross_entropy import fused_linear_ce_fwd

    return fused_linear_ce_fwd(hidden, weight, target, ignore_index, chunk_size, grad_hidden,
                               grad_weight)


@_flce_op.register_fake
def _(hidden, weight, target, ignore_index, chunk_size, grad_hidden, grad_weight):
    loss = hidden.new_empty((), dtype=torch.float32)
    count = hidden.new_empty((), dtype=torch.int64)
    dh = hidden.new_empty(hidden.shape if grad_hidden else (0,))
    dw = weight.new_empty(weight.shape if grad_weight else (0,), dtype=torch.float32)
    return loss, count, dh, dw


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, *_ = inputs
    _, count, dh, dw = output
    ctx.mark_non_differentiable(count, dh, dw)
    ctx.save_for_backward(dh, dw)
    ctx.dtypes = hidden.dtype, weight.dtype
    # no zeros for the outputs nobody differentiates: autograd would otherwise make an fp32
    # [V, E] one for the stashed weight gradient (3.8 GiB for a 248,320 x 4,096 LM head)
    ctx.set_materialize_grads(False)


def _scaled(stashed: torch.Tensor, dloss: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(stashed * dloss).to(dtype)`` written straight into a ``dtype`` tensor: the product is
    formed in fp32 and rounded once, as before, without an fp32 temporary of the weight's size
    beside the stash."""
    if torch.is_grad_enabled() and dloss.requires_grad:    # create_graph: out= has no grad
        return (stashed * dloss).to(dtype)
    return torch.mul(stashed, dloss, out=torch.empty_like(stashed, dtype=dtype))


def _backward(ctx, dloss, _dcount, _ddh, _ddw):
    if dloss is None:
        return None, None, None, None, None, None, None
    dh, dw = ctx.saved_tensors
    grad_hidden = _scaled(dh, dloss, ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
    grad_weight = _scaled(dw, dloss, ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
    return grad_hidden, grad_weight, None, None, None, None, None


_flce_op.register_autograd(_backward, setup_context=_setup_context)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               *, ignore_index: int = IGNORE_INDEX,
                               chunk_size: int | None = None,
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of token losses fp32, count of valid targets int64)`` of ``hidden @ weight.T``.

    ``hidden [N, E]``, ``weight [V, E]`` (the LM head), ``target [N]`` with ``ignore_index``
    for tokens without a label. ``chunk_size`` rows go through at a time (default: a logits chunk
    about the size of ``hidden``).

    Example::

        >>> h, w = torch.randn(10, 16, requires_grad=True), torch.randn(50, 16)
        >>> t = torch.tensor([3, 7, -100, 1, 0, 9, 49, -100, 2, 5])
        >>> loss_sum, count = fused_linear_cross_entropy(h, w, t)
        >>> (loss_sum / count).backward()  # the exact mean over the 8 valid targets
        >>> int(count), h.grad.shape
        (8, torch.Size([10, 16]))
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"fused_linear_cross_entropy: hidden {tuple(hidden.shape)} must be "
                         f"[N, E] and weight {tuple(weight.shape)} [V, E]")
    if target.shape != hidden.shape[:1] or target.dtype.is_floating_point:
        raise ValueError(f"fused_linear_cross_entropy: target {target.dtype}{list(target.shape)} "
                         f"must be integer [N] = [{hidden.shape[0]}]")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"fused_linear_cross_entropy: hidden {hidden.dtype} and weight "
                         f"{weight.dtype} must share a dtype")
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden.shape[0], weight.shape[0], weight.shape[1])
    if not use_triton(hidden):
        return reference.fused_linear_cross_entropy(hidden, weight, target.long(),
                                                    ignore_index=ignore_index,
                                                    chunk_size=chunk_size)
    grad_on = torch.is_grad_enabled()
    loss, count, _, _ = _flce_op(hidden, weight, target, ignore_index, chunk_size,
                                 grad_on and hidden.requires_grad,
                                 grad_on and weight.requires_grad)
    return loss, count
