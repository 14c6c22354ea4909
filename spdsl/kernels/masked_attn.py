"""Attention with its mask given as a function of per-token values, never as an ``[S, S]``
tensor: ``torch.ops.spdsl.masked_attn`` (+ ``masked_attn_backward``) and ``masked_attn``.

The mask is ``fn(*leaves)``: ``leaves`` are 4-D tensors that broadcast to the scores
``[B, H, S_q, S_k]`` and are full-sized on at most one of the two sequence dims (a query
position ``[1, 1, S, 1]``, a padding flag ``[B, 1, 1, S]``, a per-head slope ``[1, H, 1, 1]``);
``fn`` is a pointwise program over them returning a boolean keep-mask or an additive float
bias (Hugging Face's ``finfo.min`` masks, ALiBi). Masks such a program expresses: causal,
padding, packed documents, sliding windows, position biases, and any pointwise combination.

How it runs (CPU and GPU alike, plain PyTorch): queries in blocks; for each block the mask
program runs on the block's slice of the leaves (``[.., bq, S_k]``), the span of keys any row
of the block keeps is found (causal: up to the block's last query; a window or a document:
its extent), and an ordinary softmax over that span gives the block's rows. The backward recomputes each block's softmax (no probabilities are kept). The block size keeps a
block's scores within ``BLOCK_ELEMENTS``, so the working memory is a constant (16 MiB of
fp32 scores, a few such tensors at once), not ``S_q x S_k``.

Exactness: fp32 scores, one softmax per row over the kept span: equal to SDPA and to the
written-out ``softmax(q k^T * scale + mask) v`` within fp32 rounding. Keys outside the span
and entries at or below ``finfo.min`` contribute ``exp(-huge) = 0`` exactly whenever the row
keeps any key. A row that keeps no key (left padding's first rows) gets what the dense computation
gives: zeros for a boolean mask (SDPA's convention), and for an additive one the softmax of
the whole row (every entry ``finfo.min``: a uniform average over every key, as Hugging Face's
eager attention computes it; the last padding row's output predicts the first real label).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable

import torch

BLOCK_ELEMENTS = 1 << 22        # scores per query block (B * H * bq * span): 16 MiB in fp32
_PROGRAMS: dict[str, Callable] = {}
_IDS = itertools.count()


def register_mask_program(fn: Callable, name: str = "mask") -> str:
    """Store ``fn(*leaves) -> keep (bool) or bias (float)``; returns the key the op takes.
    A program with source code (an FX graph's ``code``) is keyed by it: the same mask traced
    twice gets the same key (equal graphs, one compiled program)."""
    code = getattr(fn, "code", None)
    if isinstance(code, str):
        key = f"{name}@{hashlib.sha1(code.encode()).hexdigest()[:16]}"
    else:
        key = f"{name}#{next(_IDS)}"
    _PROGRAMS[key] = fn
    return key


def mask_program(key: str) -> Callable:
    return _PROGRAMS[key]


def block_rows(b: int, h: int, s_k: int) -> int:
    """Query rows per block: as many as keep one block's scores within ``BLOCK_ELEMENTS``."""
    return max(1, min(1024, BLOCK_ELEMENTS // max(1, b * h * s_k)))


def workspace_bytes(b: int, h: int, s_q: int, s_k: int) -> int:
    """The kernel's peak scratch beyond its inputs and outputs (backward: scores,
    probabilities, their gradient and a mask block, fp32) for the memory planner."""
    rows = min(s_q, block_rows(b, h, s_k))
    return 4 * b * h * rows * s_k * 4


def _mask_block(program, leaves, i0: int, i1: int, causal: bool, s_k: int, device):
    """The block's keep-mask (bool) and bias (float or None), and the kept key span."""
    cut = [t.narrow(2, i0, i1 - i0) if t.shape[2] > 1 else t for t in leaves]
    m = program(*cut) if program is not None else None
    keep, bias = None, None
    if m is not None:
        if m.dtype == torch.bool:
            keep = m
        else:
            bias = m
            keep = bias > torch.finfo(m.dtype).min
    if causal:
        tri = torch.arange(i0, i1, device=device)[:, None] >= torch.arange(s_k, device=device)
        keep = tri if keep is None else keep & tri
    if keep is None:
        return None, None, 0, s_k
    if bias is not None and not causal:
        # an additive mask: a row whose every entry is at finfo.min softmaxes the whole row
        # (a uniform average, as the written-out ops give): the block keeps every key then
        if not keep.any(-1).all():
            return None, bias, 0, s_k
        keep = None
        cols = (bias > torch.finfo(bias.dtype).min)
    else:
        cols = keep
    cols = cols.reshape(-1, cols.shape[-2], cols.shape[-1]).any(0).any(0)
    cols = cols.expand(s_k) if cols.numel() == 1 else cols
    idx = cols.nonzero()
    if idx.numel() == 0:
        return keep, bias, 0, 0
    lo, hi = int(idx[0]), int(idx[-1]) + 1
    return keep, bias, lo, hi


def _scores(q_blk, k, keep, bias, lo, hi, scale):
    s = torch.matmul(q_blk, k[:, :, lo:hi].transpose(-2, -1)) * scale
    if bias is not None:
        s = s + bias[..., lo:hi] if bias.shape[-1] > 1 else s + bias
    if keep is not None:
        s = s.masked_fill(~(keep[..., lo:hi] if keep.shape[-1] > 1 else keep), float("-inf"))
    return s


def _up(*ts: torch.Tensor) -> list[torch.Tensor]:
    """fp32 (or wider) copies: scores and sums accumulate in fp32, as SDPA's do."""
    dt = torch.promote_types(ts[0].dtype, torch.float32)
    return [t.to(dt) for t in ts]


def _softmax(s: torch.Tensor) -> torch.Tensor:
    """Softmax over the kept span; a row keeping no key (all -inf) gets zeros, not NaN."""
    return torch.softmax(s, -1).nan_to_num(0.0)


def _grouped(k: torch.Tensor, h: int) -> torch.Tensor:
    return k if k.shape[1] == h else k.repeat_interleave(h // k.shape[1], dim=1)


def _forward(q, k, v, leaves, program_key, causal, scale):
    program = mask_program(program_key) if program_key else None
    b, h, s_q, _ = q.shape
    s_k = k.shape[2]
    qf, kf, vf = _up(q, _grouped(k, h), _grouped(v, h))
    out = qf.new_zeros(b, h, s_q, v.shape[-1])
    lse = qf.new_full((b, h, s_q), float("-inf"))
    rows = block_rows(b, h, s_k)
    for i0 in range(0, s_q, rows):
        i1 = min(s_q, i0 + rows)
        keep, bias, lo, hi = _mask_block(program, leaves, i0, i1, causal, s_k, q.device)
        if hi <= lo:
            continue
        s = _scores(qf[:, :, i0:i1], kf, keep, bias, lo, hi, scale)
        out[:, :, i0:i1] = torch.matmul(_softmax(s), vf[:, :, lo:hi])
        lse[:, :, i0:i1] = torch.logsumexp(s, -1)
    return out.to(q.dtype), lse


def _backward(dout, q, k, v, out, lse, leaves, program_key, causal, scale):
    program = mask_program(program_key) if program_key else None
    b, h, s_q, _ = q.shape
    hk, s_k = k.shape[1], k.shape[2]
    qf, kf, vf = _up(q, _grouped(k, h), _grouped(v, h))
    do, of = _up(dout, out)
    delta = (do * of).sum(-1, keepdim=True)              # [B, H, S_q, 1]
    dq = torch.zeros_like(qf)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
    rows = block_rows(b, h, s_k)
    for i0 in range(0, s_q, rows):
        i1 = min(s_q, i0 + rows)
        keep, bias, lo, hi = _mask_block(program, leaves, i0, i1, causal, s_k, q.device)
        if hi <= lo:
            continue
        s = _scores(qf[:, :, i0:i1], kf, keep, bias, lo, hi, scale)
        # the softmax again, not exp(s - lse): a row of finfo.min entries has an lse that
        # absorbed its log(count)
        p = _softmax(s)
        dv[:, :, lo:hi] += torch.matmul(p.transpose(-2, -1), do[:, :, i0:i1])
        dp = torch.matmul(do[:, :, i0:i1], vf[:, :, lo:hi].transpose(-2, -1))
        ds = p * (dp - delta[:, :, i0:i1]) * scale
        dq[:, :, i0:i1] = torch.matmul(ds, kf[:, :, lo:hi])
        dk[:, :, lo:hi] += torch.matmul(ds.transpose(-2, -1), qf[:, :, i0:i1])
    if hk != h:
        dk = dk.view(b, hk, h // hk, s_k, -1).sum(2)
        dv = dv.view(b, hk, h // hk, s_k, -1).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@torch.library.custom_op("spdsl::masked_attn", mutates_args=())
def _masked_attn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    leaves: list[torch.Tensor], program: str, causal: bool, scale: float,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, leaves, program, causal, scale)


@_masked_attn_op.register_fake
def _(q, k, v, leaves, program, causal, scale):
    b, h, s_q, _ = q.shape
    return (q.new_empty((b, h, s_q, v.shape[-1])),
            q.new_empty((b, h, s_q), dtype=torch.promote_types(q.dtype, torch.float32)))


@torch.library.custom_op("spdsl::masked_attn_backward", mutates_args=())
def _masked_attn_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                             leaves: list[torch.Tensor], program: str, causal: bool,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dout, q, k, v, out, lse, leaves, program, causal, scale)


@_masked_attn_backward_op.register_fake
def _(dout, q, k, v, out, lse, leaves, program, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, leaves, program, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *leaves)
    ctx.program, ctx.causal, ctx.scale = program, causal, scale


def _backward_rule(ctx, dout, dlse):
    q, k, v, out, lse, *leaves = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _masked_attn_backward_op(dout, q, k, v, out, lse, leaves, ctx.program,
                                          ctx.causal, ctx.scale)
    return dq, dk, dv, [None] * len(leaves), None, None, None


_masked_attn_op.register_autograd(_backward_rule, setup_context=_setup_context)


def masked_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                mask_fn: Callable | str | None = None, leaves: list[torch.Tensor] = (),
                causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Attention over ``[B, H, S, D]`` q and ``[B, H_kv, S, D]`` k, v whose mask is
    ``mask_fn(*leaves)`` evaluated a block of queries at a time (see the module docstring).

    Example::

        >>> pos = torch.arange(8)
        >>> window = lambda qp, kp: (kp <= qp) & (qp - kp < 3)      # a sliding window of 3
        >>> q = torch.randn(1, 2, 8, 4)
        >>> masked_attn(q, q, q, mask_fn=window,
        ...             leaves=[pos.view(1, 1, 8, 1), pos.view(1, 1, 1, 8)]).shape
        torch.Size([1, 2, 8, 4])
    """
    key = mask_fn if isinstance(mask_fn, str) or mask_fn is None else \
        register_mask_program(mask_fn, getattr(mask_fn, "__name__", "mask"))
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _masked_attn_op(q, k, v, list(leaves), key or "", bool(causal), scale)[0]
