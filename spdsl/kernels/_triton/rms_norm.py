"""RMSNorm forward/backward: Triton kernels and host launchers (rows of ``[N, D]``, fp32 math).

Forward saves ``rstd`` per row so backward needs no second reduction over ``x``. The weight
gradient is summed per program into an fp32 ``[programs, D]`` buffer and reduced on the host
(Liger-Kernel's scheme): deterministic, no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spdsl.kernels.backend import interpreting


@triton.jit
def _rms_norm_fwd_kernel(X, W, Y, RSTD, N, D, sx, sy, eps,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < N)[:, None] & (cols < D)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + rows64[:, None] * sy + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rows < N)


@triton.jit
def _rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW_PARTIAL, N, D, sdy, sx, sdx, rows_per_prog,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], tl.float32)
    start = pid * rows_per_prog
    end = start + rows_per_prog
    if end > N:  # noqa: PLR1730  (min() breaks range() under the interpreter)
        end = N
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < end
        mask = row_ok[:, None] & (cols < D)[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * sdy + cols[None, :], mask=mask,
                     other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        x_hat = x * rstd[:, None]
        g = dy * w[None, :]
        # d/dx of x * rstd(x): rstd * (g - x_hat * mean(g * x_hat)).
        dx = rstd[:, None] * (g - x_hat * (tl.sum(g * x_hat, 1) / D)[:, None])
        tl.store(DX + rows64[:, None] * sdx + cols[None, :], dx.to(DX.dtype.element_ty),
                 mask=mask)
        dw += tl.sum(dy * x_hat, 0)
    tl.store(DW_PARTIAL + pid * D + cols, dw, mask=cols < D)


def _tiles(d: int) -> tuple[int, int, int]:
    """(BLOCK_R rows per tile, BLOCK_D, num_warps): a tile of about 4096 elements on GPU."""
    bd = triton.next_power_of_2(d)
    budget = 1024 if interpreting() else 4096
    block_r = max(1, min(64, budget // bd))
    return block_r, bd, 4 if bd <= 2048 else 8 if bd <= 8192 else 16


def _num_programs(n_rows: int, block_r: int, device: torch.device) -> int:
    if device.type == "cuda":
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 4
    return max(1, min(target, triton.cdiv(n_rows, block_r)))


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward on ``x [..., D]``; returns ``(y like x, rstd fp32 [...])``."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = x2.shape[0]
    y = torch.empty((n, d), dtype=x.dtype, device=x.device)
    rstd = torch.empty((n,), dtype=torch.float32, device=x.device)
    block_r, bd, warps = _tiles(d)
    _rms_norm_fwd_kernel[(triton.cdiv(n, block_r),)](
        x2, weight.contiguous(), y, rstd, n, d, x2.stride(0), y.stride(0), eps,
        BLOCK_R=block_r, BLOCK_D=bd, num_warps=warps)
    return y.view(x.shape), rstd.view(x.shape[:-1])


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward; returns ``(dx like x, dweight like weight)``."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    dy2 = dy.reshape(-1, d).contiguous()
    n = x2.shape[0]
    dx = torch.empty((n, d), dtype=x.dtype, device=x.device)
    block_r, bd, warps = _tiles(d)
    progs = _num_programs(n, block_r, x.device)
    rows_per_prog = triton.cdiv(n, progs)
    dw_partial = torch.empty((progs, d), dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(progs,)](
        dy2, x2, weight.contiguous(), rstd.reshape(-1).contiguous(), dx, dw_partial, n, d,
        dy2.stride(0), x2.stride(0), dx.stride(0), rows_per_prog,
        BLOCK_R=block_r, BLOCK_D=bd, num_warps=warps)
    return dx.view(x.shape), dw_partial.sum(0).to(weight.dtype)
