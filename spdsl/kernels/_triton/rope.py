"""RoPE (rotate-half form) forward/backward: one Triton kernel and its host launcher.

``out = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``. The backward is
the transposed rotation, ``dx = dy * cos + rotate_half^T(dy * sin)``, which is the same kernel
with the sign of the ``sin`` terms flipped and the halves of ``sin`` swapped; ``BACKWARD`` picks it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spdsl.kernels.backend import interpreting


@triton.jit
def _rope_kernel(X, COS, SIN, OUT, H, S, HALF, sxb, sxh, sxs, scb, scs,
                 BACKWARD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < S)[:, None] & (cols < HALF)[None, :]
    x_ptr = X + b * sxb + h * sxh + rows[:, None].to(tl.int64) * sxs + cols[None, :]
    c_ptr = COS + b * scb + rows[:, None] * scs + cols[None, :]
    s_ptr = SIN + b * scb + rows[:, None] * scs + cols[None, :]
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(c_ptr, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptr, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    o_ptr = OUT + pid_bh.to(tl.int64) * S * (2 * HALF) + rows[:, None] * (2 * HALF) + cols[None, :]
    tl.store(o_ptr, y1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(o_ptr + HALF, y2.to(OUT.dtype.element_ty), mask=mask)


def rope_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool,
               ) -> torch.Tensor:
    """Rotate ``x [B, H, S, D]`` (forward) or un-rotate a gradient (``backward=True``).

    ``cos``/``sin`` are ``[S, D]`` or ``[B, S, D]``; the result is contiguous, in ``x.dtype``.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    b, h, s, d = x.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    if sin.shape != cos.shape:
        sin = sin.expand(cos.shape).contiguous()
    out = torch.empty((b, h, s, d), dtype=x.dtype, device=x.device)
    half = d // 2
    block_h = triton.next_power_of_2(half)
    block_s = max(1, min(64 if interpreting() else 32, 4096 // block_h))
    batch_stride = cos.stride(0) if cos.dim() == 3 else 0
    grid = (b * h, triton.cdiv(s, block_s))
    _rope_kernel[grid](x, cos, sin, out, h, s, half, x.stride(0), x.stride(1), x.stride(2),
                       batch_stride, cos.stride(-2), BACKWARD=backward, BLOCK_S=block_s,
                       BLOCK_H=block_h, num_warps=4)
    return out
