"""Flash attention forward: Triton kernel and host launcher (``[B, H, S, D]`` layout).

One program owns ``BLOCK_M`` query rows of one (batch, query head) and streams the key/value
blocks of its kv head through an online softmax (FlashAttention-2, Triton tutorial 06). GQA
maps query head ``h`` to kv head ``h // groups`` by index, so kv heads are never repeated in
memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spdsl.kernels.backend import interpreting

LOG2E = 1.4426950408889634


@triton.jit
def _flash_fwd_kernel(
    Q, K, V, SEG, O, LSE,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos, s_seg,
    H, GROUPS, S_Q, S_K, D, qk_scale,
    CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUPS
    q_base = Q + b * sqb + h * sqh
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < S_Q
    d_ok = offs_d < D
    q = tl.load(q_base + offs_m[:, None] * sqs + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if HAS_SEG:
        seg_q = tl.load(SEG + b * s_seg + offs_m, mask=m_ok, other=-1)

    # Scores live in the log2 domain (qk_scale = scale * log2 e) so the loop uses exp2.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = S_K
    if CAUSAL:
        hi = (pid_m + 1) * BLOCK_M
        # Not min(): under the interpreter it yields a 1-element array that range() rejects.
        if hi > S_K:  # noqa: PLR1730
            hi = S_K
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        n_ok = cols < S_K
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + cols[:, None] * sks + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        keep = n_ok[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])
        if HAS_SEG:
            seg_k = tl.load(SEG + b * s_seg + cols, mask=n_ok, other=-2)
            keep = keep & (seg_q[:, None] == seg_k[None, :])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row whose blocks so far are all masked (a later document) has m = -inf; shifting
        # by 0 instead keeps exp2(-inf - -inf) from turning into NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * svs + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    o_base = O + b * sob + h * soh
    tl.store(o_base + offs_m[:, None] * sos + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + pid_bh.to(tl.int64) * S_Q + offs_m, lse, mask=m_ok)


def block_d(d: int) -> int:
    """Head dim padded to a power of two; tl.dot needs at least 16."""
    return max(16, triton.next_power_of_2(d))


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for inputs of ``dtype``.

    Triton's default for fp32 operands is TF32 (10-bit mantissa, about 1e-3 relative error per
    product), which would make an fp32 run silently inexact; "ieee" keeps full fp32 products.
    fp16/bf16 operands ignore the setting, so they keep the default. The interpreter computes
    fp32 and fp16 dots in numpy at full precision whatever is asked (only a GPU run tells
    IEEE from TF32); its bf16 dots multiply the raw uint16 bit patterns, so bf16 flash
    attention is tested on a GPU only.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


def fwd_config(d: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Tile sizes for the forward; tiny tiles under the interpreter to exercise block edges."""
    if interpreting():
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32:
        # IEEE fp32 dots run on FMA units, not tensor cores, and fp32 tiles take twice the
        # shared memory: smaller tiles keep both registers and shared memory in bounds.
        return {"BLOCK_M": 64 if d <= 128 else 32, "BLOCK_N": 32, "num_warps": 4,
                "num_stages": 2 if d <= 128 else 1}
    if d <= 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    if d <= 128:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}


def strides3(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None,
              causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward; returns ``(out [B, H, S_q, D] contiguous, lse fp32 [B, H, S_q])``."""
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    b, h, s_q, d = q.shape
    s_k = k.shape[2]
    out = torch.empty((b, h, s_q, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, s_q), dtype=torch.float32, device=q.device)
    seg = segment_ids.contiguous() if segment_ids is not None else lse
    cfg = fwd_config(d, q.dtype)
    grid = (triton.cdiv(s_q, cfg["BLOCK_M"]), b * h)
    _flash_fwd_kernel[grid](
        q, k, v, seg, out, lse,
        *strides3(q), *strides3(k), *strides3(v), *strides3(out),
        seg.stride(0) if segment_ids is not None else 0,
        h, h // k.shape[1], s_q, s_k, d, scale * LOG2E,
        CAUSAL=causal, HAS_SEG=segment_ids is not None, BLOCK_D=block_d(d),
        DOT_PRECISION=dot_precision(q.dtype), **cfg,
    )
    return out, lse
