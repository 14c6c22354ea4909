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
def _ce_chunk_kernel(LOGITS, TARGET, LOSS, V, s_row, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * s_row
    cols = tl.arange(0, BLOCK_V)
    t = tl.load(TARGET + row)
    if t == ignore_index:
        for v0 in range(0, V, BLOCK_V):
            tl.store(ptr + v0 + cols, tl.zeros([BLOCK_V], LOGITS.dtype.element_ty),
                     mask=v0 + cols < V)
        tl.store(LOSS + row, 0.0)
        return
    # Pass 1: online max / sum-exp over the vocab, in fp32 whatever the logits dtype.
    m = float("-inf")
    s = 0.0
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(ptr + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    x_t = tl.load(ptr + t).to(tl.float32)
    # Pass 2: overwrite the logits with d loss / d logits = softmax - onehot(target).
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + cols
        x = tl.load(ptr + idx, mask=idx < V, other=0.0).to(tl.float32)
        g = tl.exp(x - lse)
        g = tl.where(idx == t, g - 1.0, g)
        tl.store(ptr + idx, g.to(LOGITS.dtype.element_ty), mask=idx < V)
    tl.store(LOSS + row, lse - x_t)


def ce_chunk_(logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Per-row loss (fp32 ``[C]``, 0 where ignored); ``logits`` becomes its own gradient."""
    c, v = logits.shape
    loss = torch.empty((c,), dtype=torch.float32, device=logits.device)
    block_v = min(1024 if interpreting() else 8192, triton.next_power_of_2(v))
    _ce_chunk_kernel[(c,)](logits, target, loss, v, logits.stride(0), ignore_index,
                           BLOCK_V=block_v, num_warps=16 if block_v >= 4096 else 8)
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
                dw += torch.mm(logits.t(), h_c)
        del logits
    count = (target != ignore_index).sum()
    return loss, count, dh, dw
