"""Flash attention backward: Triton kernels and host launcher (``[B, H, S, D]`` layout).

Three kernels, as in FlashAttention-2: a preprocess computes ``delta = rowsum(dO * O) - dlse``,
one kernel walks query blocks for each key/value block (dK, dV), one walks key/value blocks for
each query block (dQ). The dK/dV program of kv head ``j`` loops over the ``groups`` query heads
that share it, so GQA gradients are summed in registers: no repeated kv heads, no atomics, and
the result is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spdsl.kernels._triton.flash_fwd import (
    LOG2E,
    block_d,
    dot_precision,
    last_dim_contiguous,
    strides3,
)
from spdsl.kernels.backend import interpreting


@triton.jit
def _flash_bwd_preprocess(O, DO, DLSE, DELTA, soh, sos, sdoh, sdos, S_Q, D,
                          HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < S_Q)[:, None] & (offs_d < D)[None, :]
    o = tl.load(O + bh * soh + offs_m[:, None] * sos + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + bh * sdoh + offs_m[:, None] * sdos + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        # d lse_i / d s_ij = p_ij, so a gradient on lse enters exactly like -delta.
        delta -= tl.load(DLSE + bh * S_Q + offs_m, mask=offs_m < S_Q, other=0.0)
    tl.store(DELTA + bh * S_Q + offs_m, delta, mask=offs_m < S_Q)


@triton.jit
def _keep_mask(q_idx, k_idx, SEG, seg_off, S_Q, S_K, CAUSAL: tl.constexpr,
               HAS_SEG: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """Mask of (query, key) pairs that attend: [queries, keys], or [keys, queries]."""
    if HAS_SEG:
        seg_q = tl.load(SEG + seg_off + q_idx, mask=q_idx < S_Q, other=-1)
        seg_k = tl.load(SEG + seg_off + k_idx, mask=k_idx < S_K, other=-2)
    # Built directly in the orientation wanted: transposing a boolean tile is avoided.
    if KEYS_FIRST:
        keep = (k_idx < S_K)[:, None] & (q_idx < S_Q)[None, :]
        if CAUSAL:
            keep = keep & (k_idx[:, None] <= q_idx[None, :])
        if HAS_SEG:
            keep = keep & (seg_k[:, None] == seg_q[None, :])
    else:
        keep = (q_idx < S_Q)[:, None] & (k_idx < S_K)[None, :]
        if CAUSAL:
            keep = keep & (k_idx[None, :] <= q_idx[:, None])
        if HAS_SEG:
            keep = keep & (seg_q[:, None] == seg_k[None, :])
    return keep


@triton.jit
def _flash_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, SEG, DK, DV,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdob, sdoh, sdos, s_seg,
    H, GROUPS, S_Q, S_K, D, scale, qk_scale,
    CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bhk = tl.program_id(1)
    h_kv = H // GROUPS
    b = (pid_bhk // h_kv).to(tl.int64)
    hk = (pid_bhk % h_kv).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n < S_K)[:, None] & (offs_d < D)[None, :]
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * sks + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svs + offs_d[None, :],
                mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # Causal: query rows before this key block never see it; start at its first query block.
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for g in range(GROUPS):
        h = hk * GROUPS + g
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdob + h * sdoh
        row_base = (b * H + h) * S_Q
        for start_m in range(lo, S_Q, BLOCK_M):
            rows = start_m + offs_m
            q_mask = (rows < S_Q)[:, None] & (offs_d < D)[None, :]
            q = tl.load(q_base + rows[:, None] * sqs + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(do_base + rows[:, None] * sdos + offs_d[None, :], mask=q_mask, other=0.0)
            lse = tl.load(LSE + row_base + rows, mask=rows < S_Q, other=0.0) * 1.4426950408889634
            delta = tl.load(DELTA + row_base + rows, mask=rows < S_Q, other=0.0)
            # [BLOCK_N, BLOCK_M]: keys x queries
            s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
            keep = _keep_mask(rows, offs_n, SEG, b * s_seg, S_Q, S_K, CAUSAL, HAS_SEG, True)
            p_t = tl.where(keep, tl.exp2(s_t - lse[None, :]), 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    out = b * (h_kv * S_K * D) + hk * (S_K * D) + offs_n[:, None] * D + offs_d[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _flash_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, SEG, DQ,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdob, sdoh, sdos, s_seg,
    H, GROUPS, S_Q, S_K, D, scale, qk_scale,
    CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUPS
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (rows < S_Q)[:, None] & (offs_d < D)[None, :]
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + offs_d[None, :],
                mask=q_mask, other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + rows[:, None] * sdos + offs_d[None, :],
                 mask=q_mask, other=0.0)
    row_base = pid_bh.to(tl.int64) * S_Q
    lse = tl.load(LSE + row_base + rows, mask=rows < S_Q, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + row_base + rows, mask=rows < S_Q, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = S_K
    if CAUSAL:
        hi = (pid_m + 1) * BLOCK_M
        # Not min(): under the interpreter it yields a 1-element array that range() rejects.
        if hi > S_K:  # noqa: PLR1730
            hi = S_K
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols < S_K)[:, None] & (offs_d < D)[None, :]
        k = tl.load(k_base + cols[:, None] * sks + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * svs + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        keep = _keep_mask(rows, cols, SEG, b * s_seg, S_Q, S_K, CAUSAL, HAS_SEG, False)
        p = tl.where(keep, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    tl.store(DQ + pid_bh.to(tl.int64) * (S_Q * D) + rows[:, None] * D + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


def bwd_config(d: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Tile sizes for both backward kernels; tiny tiles under the interpreter."""
    if interpreting():
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32:  # IEEE dots on FMA units; see fwd_config
        return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    if d <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    if d <= 128:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1}


def flash_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
              segment_ids: torch.Tensor | None, causal: bool, scale: float,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward; returns contiguous ``(dq, dk, dv)`` in the input dtypes."""
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    # The preprocess indexes O and dO by (b*h) with one stride: make them [B*H, S, D]-shaped.
    out, dout = out.contiguous(), dout.contiguous()
    b, h, s_q, d = q.shape
    h_kv, s_k = k.shape[1], k.shape[2]
    cfg = bwd_config(d, q.dtype)
    bd = block_d(d)
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    dlse_arg = dlse.contiguous() if dlse is not None else lse
    pre_grid = (triton.cdiv(s_q, cfg["BLOCK_M"]), b * h)
    _flash_bwd_preprocess[pre_grid](out, dout, dlse_arg, delta, out.stride(1), out.stride(2),
                                    dout.stride(1), dout.stride(2), s_q, d,
                                    HAS_DLSE=dlse is not None, BLOCK_M=cfg["BLOCK_M"], BLOCK_D=bd)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    seg = segment_ids.contiguous() if segment_ids is not None else lse
    common = (*strides3(q), *strides3(k), *strides3(v), *strides3(dout),
              seg.stride(0) if segment_ids is not None else 0,
              h, h // h_kv, s_q, s_k, d, scale, scale * LOG2E)
    flags = {"CAUSAL": causal, "HAS_SEG": segment_ids is not None, "BLOCK_D": bd,
             "DOT_PRECISION": dot_precision(q.dtype), **cfg}
    _flash_bwd_dkdv_kernel[(triton.cdiv(s_k, cfg["BLOCK_N"]), b * h_kv)](
        q, k, v, dout, lse, delta, seg, dk, dv, *common, **flags)
    _flash_bwd_dq_kernel[(triton.cdiv(s_q, cfg["BLOCK_M"]), b * h)](
        q, k, v, dout, lse, delta, seg, dq, *common, **flags)
    return dq, dk, dv
