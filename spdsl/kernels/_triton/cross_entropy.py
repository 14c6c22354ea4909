"""Chunked linear + cross-entropy: the per-chunk Triton softmax/CE kernel and the chunk loop.

Strategy (Liger-Kernel's): gradients are computed during the forward, chunk by chunk, and
stashed; backward only scales them by the incoming gradient. Per chunk of ``C`` rows:
``logits = h_c @ W.T`` (``[C, V]``, input dtype), the kernel turns it *in place* into
``softmax - onehot`` while writing each row's loss, then ``dh_c = g @ W`` and ``dW += g.T @ h_c``.
Peak extra memory is one ``[C, V]`` chunk plus the ``[N, E]`` and ``[V, E]`` gradients, never
``[N, V]``; and the logits are computed once instead of twice as a recomputing backward would.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spdsl.kernels.backend import interpreting


@triton.jit
def _ce_chunk_kernel(LOGITS, TARGET, LOSS, C, V, s_row, ignore_index,
                     BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < C
    t = tl.load(TARGET + rows, mask=row_ok, other=ignore_index)
    valid = row_ok & (t != ignore_index)
    base = LOGITS + rows.to(tl.int64)[:, None] * s_row
    cols = tl.arange(0, BLOCK_V)
    # Pass 1: online max / sum-exp over the vocab in fp32. Ignored rows are masked out of the
    # loads, so they cost no memory traffic.
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_R], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + cols
        x = tl.load(base + idx[None, :], mask=valid[:, None] & (idx < V)[None, :],
                    other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 1))
        m_safe = tl.where(valid, m_new, 0.0)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), 1)
        m = m_new
    lse = tl.where(valid, m + tl.log(tl.where(valid, s, 1.0)), 0.0)
    x_t = tl.load(LOGITS + rows.to(tl.int64) * s_row + t, mask=valid, other=0.0).to(tl.float32)
    # Pass 2: overwrite the logits with d loss / d logits = softmax - onehot (0 where ignored).
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + cols
        in_v = (idx < V)[None, :]
        x = tl.load(base + idx[None, :], mask=valid[:, None] & in_v, other=0.0).to(tl.float32)
        g = tl.exp(x - lse[:, None])
        g = tl.where(idx[None, :] == t[:, None], g - 1.0, g)
        g = tl.where(valid[:, None], g, 0.0)
        tl.store(base + idx[None, :], g.to(LOGITS.dtype.element_ty), mask=row_ok[:, None] & in_v)
    tl.store(LOSS + rows, tl.where(valid, lse - x_t, 0.0), mask=row_ok)


def ce_chunk_(logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Per-row loss (fp32 ``[C]``, 0 where ignored); ``logits`` becomes its own gradient."""
    c, v = logits.shape
    loss = torch.empty((c,), dtype=torch.float32, device=logits.device)
    # A row per program on GPU (Liger's layout); 16 under the interpreter, whose cost is per
    # program and per reduction, not per element.
    block_r = 16 if interpreting() else 1
    block_v = min(1024 if interpreting() else 8192, triton.next_power_of_2(v))
    _ce_chunk_kernel[(triton.cdiv(c, block_r),)](
        logits, target, loss, c, v, logits.stride(0), ignore_index,
        BLOCK_R=block_r, BLOCK_V=block_v, num_warps=16 if block_v >= 4096 else 8)
    return loss


def fused_linear_ce_fwd(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                        ignore_index: int, chunk_size: int, grad_hidden: bool, grad_weight: bool,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(loss_sum fp32, count int64, dloss/dhidden or [0], dloss/dweight fp32 or [0])``."""
    hidden, weight, target = hidden.contiguous(), weight.contiguous(), target.contiguous()
    n, e = hidden.shape
    v = weight.shape[0]
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    dh = torch.empty_like(hidden) if grad_hidden else hidden.new_empty((0,))
    # fp32 accumulator: summing many bf16 chunk products in bf16 would lose the small ones.
    dw = (torch.zeros((v, e), dtype=torch.float32, device=weight.device) if grad_weight
          else weight.new_empty((0,), dtype=torch.float32))
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        h_c = hidden[start:end]
        logits = torch.mm(h_c, weight.t())
        loss += ce_chunk_(logits, target[start:end], ignore_index).sum()
        if grad_hidden:
            torch.mm(logits, weight, out=dh[start:end])
        if grad_weight:
            if logits.dtype == torch.float32:
                dw.addmm_(logits.t(), h_c)
            else:
                # the chunk's [V, E] product in pieces of the vocabulary, each no larger than
                # the logits chunk: a whole one would be a transient of the head's size beside
                # the accumulator (1.9 GiB bf16 for a 248,320 x 4,096 head)
                rows = max(1, logits.numel() // e)
                for v0 in range(0, v, rows):
                    dw[v0:v0 + rows] += torch.mm(logits[:, v0:v0 + rows].t(), h_c)
        del logits
    count = (target != ignore_index).sum()
    return loss, count, dh, dw
