"""Flash attention as ``torch.ops.spdsl.flash_attn`` (+ ``flash_attn_backward``) and functionals.

Layout ``[B, H, S, D]``; GQA when ``H_q`` is a multiple of ``H_kv``; ``segment_ids`` ``[B, S]``
(int) restricts attention to equal ids, for packed documents; causal is top-left aligned. The op
returns ``(out, lse)`` with ``lse`` fp32 ``[B, H, S_q]``; a gradient on ``lse`` is supported
(ring-style merging of partial attentions differentiates through it).

The custom op keeps the Triton kernels opaque to FX and ``torch.compile``: one node forward, one
node backward. The functionals choose Triton or the reference through ``backend.use_triton``.
"""

from __future__ import annotations

import torch
from torch.overrides import handle_torch_function, has_torch_function_variadic

from spdsl.kernels import reference
from spdsl.kernels.backend import use_triton


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           segment_ids: torch.Tensor | None, causal: bool) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"flash_attn expects [B, H, S, D] tensors; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"flash_attn: k {tuple(k.shape)} and v {tuple(v.shape)} must match "
                         f"each other and q {tuple(q.shape)} in batch and head dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"flash_attn (GQA): query heads {q.shape[1]} must be a multiple of "
                         f"kv heads {k.shape[1]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"flash_attn: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if segment_ids is not None:
        if segment_ids.shape != (q.shape[0], q.shape[2]) or q.shape[2] != k.shape[2]:
            raise ValueError(f"flash_attn: segment_ids {tuple(segment_ids.shape)} must be "
                             f"[B, S] = {(q.shape[0], q.shape[2])} with S_q == S_k")
        if segment_ids.dtype.is_floating_point:
            raise ValueError("flash_attn: segment_ids must be an integer tensor")


@torch.library.custom_op("spdsl::flash_attn", mutates_args=())
def _flash_attn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   segment_ids: torch.Tensor | None, causal: bool, scale: float,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    from spdsl.kernels._triton.flash_fwd import flash_fwd

    return flash_fwd(q, k, v, segment_ids, causal, scale)


@_flash_attn_op.register_fake
def _(q, k, v, segment_ids, causal, scale):
    b, h, s_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, s_q), dtype=torch.float32)


@torch.library.custom_op("spdsl::flash_attn_backward", mutates_args=())
def _flash_attn_backward_op(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor,
                            k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                            lse: torch.Tensor, segment_ids: torch.Tensor | None, causal: bool,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from spdsl.kernels._triton.flash_bwd import flash_bwd

    return flash_bwd(dout, q, k, v, out, lse, dlse, segment_ids, causal, scale)


@_flash_attn_backward_op.register_fake
def _(dout, dlse, q, k, v, out, lse, segment_ids, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, segment_ids, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, segment_ids)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, segment_ids = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _flash_attn_backward_op(dout, dlse, q, k, v, out, lse, segment_ids,
                                         ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None


_flash_attn_op.register_autograd(_backward, setup_context=_setup_context)


def flash_attn_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        causal: bool = False, scale: float | None = None,
                        segment_ids: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention returning ``(out [B, H, S_q, D], lse fp32 [B, H, S_q])``; both differentiable.

    Example::

        >>> q, kv = torch.randn(1, 4, 9, 16), torch.randn(1, 1, 9, 16)
        >>> out, lse = flash_attn_with_lse(q, kv, kv, causal=True,
        ...                                segment_ids=torch.tensor([[0] * 4 + [1] * 5]))
        >>> out.shape, lse.dtype
        (torch.Size([1, 4, 9, 16]), torch.float32)
    """
    _check(q, k, v, segment_ids, causal)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if use_triton(q):
        return _flash_attn_op(q, k, v, segment_ids, causal, scale)
    return reference.flash_attn_with_lse(q, k, v, causal=causal, scale=scale,
                                         segment_ids=segment_ids)


def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
               scale: float | None = None, segment_ids: torch.Tensor | None = None,
               ) -> torch.Tensor:
    """Drop-in for ``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)``
    on ``[B, H, S, D]``, plus GQA and packed-document ``segment_ids``.

    Example::

        >>> flash_attn(torch.randn(2, 4, 7, 64), torch.randn(2, 2, 7, 64),
        ...            torch.randn(2, 2, 7, 64), causal=True).shape
        torch.Size([2, 4, 7, 64])
    """
    if has_torch_function_variadic(q, k, v):     # a tracer sees the call itself (spdsl's:
        return handle_torch_function(            # an attention form)
            flash_attn, (q, k, v), q, k, v, causal=causal, scale=scale, segment_ids=segment_ids)
    return flash_attn_with_lse(q, k, v, causal=causal, scale=scale, segment_ids=segment_ids)[0]
