"""Per-rank implementations of the nodes whose local form is not the global op itself."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

import spdsl.env as env
from spdsl.collectives import all_reduce, all_to_all, all_to_all_many, all_to_all_many_start
from spdsl.kernels import flash_attn
from spdsl.kernels import masked_attn as _masked_attn  # noqa: F401  (spdsl::masked_attn)
from spdsl.kernels.masked_attn_flex import masked_attn_auto
from spdsl.propagate.heads import kv_repeat

aten = torch.ops.aten


# Head groups a rank's Ulysses attention pipelines (``SPDSL_ULYSSES_GROUPS``; 1: one exchange
# of all the rank's heads in, one out). With G > 1 the exchange of group i + 1 is in flight
# while group i attends, and group i's output goes back while group i + 1 attends; the bytes
# are the same, in G all-to-alls each way. Heads are independent, so the output is bitwise
# the one-group output; a kv head read by two groups gets its gradient in two parts (fp32
# rounding). One by default: on CPU ranks the pipelined exchange measured no faster
# (bench/RESULTS.md) and no GPU has measured it yet.
ULYSSES_GROUPS = int(env.value("SPDSL_ULYSSES_GROUPS"))


class HeadGroup(NamedTuple):
    """One group's heads, in the rank's local head indices after the exchange: query heads
    ``[q, q + nq)`` attend; kv heads ``[k, k + nk)`` travel with this group (those no earlier
    group brought), and the group reads kv heads ``[read, read + n_read)``."""

    q: int
    nq: int
    k: int
    nk: int
    read: int
    n_read: int


def head_groups(hq: int, hk: int, parts: int, groups: int | None = None) -> list[HeadGroup]:
    """How a rank's Ulysses attention splits its heads into pipelined groups: the largest
    ``G <= groups`` (default :data:`ULYSSES_GROUPS`) that divides the rank's ``H_q / P`` query
    heads into groups each reading whole kv heads (a group's query heads a multiple or a
    divisor of the query heads per kv head). A kv head crosses once, with the first group
    that reads it. The plan (``spdsl.lower.calls``) lists one all-to-all per group each way.

    Example::

        head_groups(8, 4, 4, 2)    # 2 query heads and 1 kv head per rank
        # [HeadGroup(q=0, nq=1, k=0, nk=1, read=0, n_read=1),
        #  HeadGroup(q=1, nq=1, k=1, nk=0, read=0, n_read=1)]
    """
    n = hq // parts
    m = hk * kv_repeat(hq, hk, parts) // parts           # kv heads a rank holds after it
    per = max(1, n // max(1, m))                         # query heads per kv head
    g = max(1, min(ULYSSES_GROUPS if groups is None else groups, n))
    while g > 1 and not (n % g == 0 and ((n // g) % per == 0 or per % (n // g) == 0)):
        g -= 1
    s = n // g
    out = []
    for i in range(g):
        k0, k1 = -(-i * s // per), -(-(i + 1) * s // per)
        r0, r1 = i * s // per, ((i + 1) * s - 1) // per + 1
        out.append(HeadGroup(i * s, s, k0, k1 - k0, r0, r1 - r0))
    return out


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None, dropout_p: float, is_causal: bool,
                      scale: float | None, enable_gqa: bool, parts: int, rank: int,
                      group: str, kernel: bool = False, written_out: bool = False,
                      compute_dtype: torch.dtype | None = None,
                      out_dtype: torch.dtype | None = None,
                      project: tuple | None = None) -> torch.Tensor:
    """Local ``[B, H, S/P, D]`` q, k, v -> attention over the whole sequence for ``H/P`` heads
    -> local ``[B, H, S/P, D]`` output. One all-to-all in (q, k, v fused), one out, per head
    group (:func:`head_groups`: pipelined, each group's exchanges in flight while another
    attends).
    ``kernel``: spdsl's flash attention instead of SDPA (set by ``spdsl.lower.kernels``).
    ``compute_dtype``/``out_dtype``: q, k, v arrive before the user's upcast and are cast
    after the exchange; the output is cast down before the exchange back
    (``spdsl.propagate.attention_nodes.uncast_attention``).
    ``project``: ``(wt, bias)``, the output projection fused in (``spdsl.lower.project``):
    the result is ``out.transpose(1, 2).reshape(B * S/P, H * D) @ wt (+ bias)``, each head
    group's share projected as soon as its output is back (:func:`project_heads`)."""
    if parts == 1:
        o = local_attention(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa,
                            kernel=kernel, written_out=written_out,
                            compute_dtype=compute_dtype, out_dtype=out_dtype)
        return o if project is None else project_heads(None, o, project, 1, 0, q.shape[1])
    hq = q.shape[1]
    n = hq // parts
    if mask is not None and mask.dim() >= 3 and mask.shape[-3] == hq and hq > 1:
        mask = mask.narrow(-3, rank * n, n)
    per_head = mask is not None and mask.dim() >= 3 and mask.shape[-3] == n and n > 1

    def attend(g: HeadGroup, qh, kh, vh):
        m = mask.narrow(-3, g.q, g.nq) if per_head else mask
        return local_attention(qh, kh, vh, m, dropout_p, is_causal, scale,
                               qh.shape[1] != kh.shape[1], kernel=kernel,
                               written_out=written_out, compute_dtype=compute_dtype,
                               out_dtype=out_dtype)
    return _pipelined(q, k, v, parts, group, attend, project)


_SEQ, _HEADS = (2, 1), (1, 1)          # (dim, outer) of [B, H, S, D] split on S, on H


def _repeat_kv(q, k, v, parts: int):
    r = kv_repeat(q.shape[1], k.shape[1], parts)
    if r > 1:
        # fewer kv heads than ranks: each rank needs the kv head of its query heads, so repeat
        # each kv head P/H_kv times (not H_q/H_kv: that would move more than needed)
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    return k, v


def _to_heads(q, k, v, parts: int, group: str):
    """Sequence-split q, k, v -> head-split over the whole sequence, in one all-to-all."""
    k, v = _repeat_kv(q, k, v, parts)
    return all_to_all_many([q, k, v], [_SEQ] * 3, [_HEADS] * 3, parts, group)


def _heads(x: torch.Tensor, parts: int, first: int, count: int) -> torch.Tensor:
    """Local heads ``[first, first + count)`` of every rank's share of ``x``'s heads."""
    b, h, s, d = x.shape
    return x.reshape(b, parts, h // parts, s, d).narrow(2, first, count).reshape(
        b, parts * count, s, d)


def project_heads(y: torch.Tensor | None, o: torch.Tensor, project: tuple, parts: int,
                  first: int, per_rank: int) -> torch.Tensor:
    """``y`` plus one head group's share of the output projection: ``o`` is the group's
    output back on the sequence split, ``[B, P * nq, S/P, D]`` with each source rank's
    ``nq`` heads (from its local head ``first`` of ``per_rank``) together; ``project`` is
    ``(wt, bias)``, ``wt`` the ``[H * D, D_model]`` operand of the model's ``mm`` (rows
    head-major), its rows of those heads taken. ``y`` None: the first share, with the bias."""
    wt, bias = project
    b, hh, s, d = o.shape
    x = o.transpose(1, 2).reshape(b * s, hh * d)
    if parts == 1 or hh // parts == per_rank:           # every row: the operand itself
        if y is not None:
            return torch.addmm(y, x, wt)
        return torch.mm(x, wt) if bias is None else torch.addmm(bias, x, wt)
    return _Share.apply(y, x, wt, bias, (parts, per_rank, first, hh // parts, d))


def _share_rows(wt: torch.Tensor, parts: int, per_rank: int, first: int, count: int,
                d: int) -> torch.Tensor:
    """The rows of ``wt`` ``[H * D, D_model]`` (head-major) of local heads ``first ..
    first + count - 1`` on every rank: a copy (the rows are not one stretch)."""
    return wt.view(parts, per_rank, d, wt.shape[-1]).narrow(1, first, count).reshape(
        parts * count * d, wt.shape[-1])


class _Share(torch.autograd.Function):
    """A head group's share of the fused output projection, ``y + x @ rows(wt)`` (the first
    share: ``x @ rows(wt) + bias``). It keeps ``x`` and ``wt`` itself (the model's operand,
    held anyway), not the rows' copy, and takes the rows again in backward: the groups'
    copies would add up to one more weight per layer kept from forward to backward."""

    @staticmethod
    def forward(ctx, y, x, wt, bias, where):
        ctx.save_for_backward(x, wt)
        ctx.where, ctx.has_y = where, y is not None
        ctx.has_bias = bias is not None and y is None       # added by the first share only
        w = _share_rows(wt, *where)
        if y is not None:
            return torch.addmm(y, x, w)
        return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)

    @staticmethod
    def backward(ctx, dy):
        x, wt = ctx.saved_tensors
        parts, per_rank, first, count, d = ctx.where
        dx = dwt = None
        if ctx.needs_input_grad[1]:
            dx = torch.mm(dy, _share_rows(wt, *ctx.where).t())
        if ctx.needs_input_grad[2]:
            dwt = wt.new_zeros(wt.shape)
            dwt.view(parts, per_rank, d, wt.shape[-1]).narrow(1, first, count).copy_(
                torch.mm(x.t(), dy).view(parts, count, d, wt.shape[-1]))
        dbias = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return dy if ctx.has_y else None, dx, dwt, dbias, None


def _pipelined(q, k, v, parts: int, group: str, attend, project=None) -> torch.Tensor:
    """Ulysses over head groups: issue group 0's exchange, then for each group issue the
    next one's, wait for its own, attend (``attend(group, qh, kh, vh)``) and issue its output
    back; wait for the outputs last. One group: today's single exchange each way.
    ``project`` (``ulysses_attention``'s): the output projection, group i - 1's share
    computed while group i's output is in flight, the last group's behind nothing but the
    others' shares."""
    k, v = _repeat_kv(q, k, v, parts)
    groups = head_groups(q.shape[1], k.shape[1], parts)
    n = q.shape[1] // parts
    if len(groups) == 1:
        qh, kh, vh = all_to_all_many([q, k, v], [_SEQ] * 3, [_HEADS] * 3, parts, group)
        o = all_to_all(attend(groups[0], qh, kh, vh), _HEADS, _SEQ, parts, group)
        return o if project is None else project_heads(None, o, project, parts, 0, n)

    def issue(g: HeadGroup):
        xs = [_heads(q, parts, g.q, g.nq)]
        if g.nk:
            xs += [_heads(k, parts, g.k, g.nk), _heads(v, parts, g.k, g.nk)]
        return all_to_all_many_start(xs, [_SEQ] * len(xs), [_HEADS] * len(xs), parts, group)

    pending, kv, outs, y = [issue(groups[0])], [], [], None
    for i, g in enumerate(groups):
        if i + 1 < len(groups):
            pending.append(issue(groups[i + 1]))
        got = pending[i].wait()
        if g.nk:
            kv.append((g.k, got[1], got[2]))
        kh, vh = _kv_heads(kv, g.read, g.n_read)
        o = attend(g, got[0], kh, vh)
        outs.append(all_to_all_many_start([o], [_HEADS], [_SEQ], parts, group))
        if project is not None and i:       # group i - 1's output, back during this attention
            p = groups[i - 1]
            y = project_heads(y, outs[i - 1].wait()[0], project, parts, p.q, n)
    if project is not None:
        return project_heads(y, outs[-1].wait()[0], project, parts, groups[-1].q, n)
    back = [p.wait()[0] for p in outs]      # [B, P * nq, S/P, D] each, source rank outer
    b, _, s, d = back[0].shape
    return torch.stack([o.reshape(b, parts, -1, s, d) for o in back], dim=2).reshape(
        b, -1, s, d)


def _kv_heads(kv: list, first: int, count: int):
    """kv heads ``[first, first + count)`` from the pieces received so far."""
    for lo, kh, vh in kv:
        if lo <= first and first + count <= lo + kh.shape[1]:
            return kh.narrow(1, first - lo, count), vh.narrow(1, first - lo, count)
    ks = [(lo, kh, vh) for lo, kh, vh in kv if lo < first + count and first < lo + kh.shape[1]]
    k = torch.cat([kh for _, kh, _ in ks], dim=1).narrow(1, first - ks[0][0], count)
    v = torch.cat([vh for _, _, vh in ks], dim=1).narrow(1, first - ks[0][0], count)
    return k, v


class _HeadOffset(torch.nn.Module):
    """A score_mod or mask_mod called with the global head index of a rank's local head."""

    def __init__(self, fn, offset: int, head_arg: int) -> None:
        super().__init__()
        self.fn, self.offset, self.head_arg = fn, offset, head_arg

    def forward(self, *args):
        args = list(args)
        args[self.head_arg] = args[self.head_arg] + self.offset
        return self.fn(*args)


def ulysses_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod, block_mask,
                 scale, kernel_options, score_bufs, mask_bufs, parts: int, rank: int,
                 group: str):
    """``flex_attention`` (the higher-order op) on local ``[B, H, S/P, D]`` q, k, v: one
    all-to-all to ``[B, H/P, S, D]``, the rank's heads over the whole sequence, the output
    back. ``score_mod``/``mask_mod`` see global head indices (offset by the rank's first
    head); BlockMask tensors with one entry per head are cut to the rank's. Returns (output
    split on the sequence, log-sum-exp and max split on the heads)."""
    hq = q.shape[1]
    qh, kh, vh = _to_heads(q, k, v, parts, group)
    n = hq // parts
    first = rank * n
    if first:
        score_mod = _HeadOffset(score_mod, first, 2)         # (score, b, h, q_idx, kv_idx)
    bm = list(block_mask)
    for i, t in enumerate(bm):      # [B, H, ...] block counts and indices; H = 1: all heads
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == hq and hq > 1:
            bm[i] = t.narrow(1, first, n)
    if first:
        bm[-1] = _HeadOffset(bm[-1], first, 1)                # mask_mod(b, h, q_idx, kv_idx)
    out, lse, mx = torch.ops.higher_order.flex_attention(
        qh, kh, vh, score_mod, tuple(bm), scale, kernel_options, tuple(score_bufs),
        tuple(mask_bufs))
    return all_to_all(out, _HEADS, _SEQ, parts, group), lse, mx


def ulysses_attention_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list,
                         program: str, is_causal: bool, scale: float | None, parts: int,
                         rank: int, group: str, compute_dtype: torch.dtype | None = None,
                         out_dtype: torch.dtype | None = None,
                         project: tuple | None = None) -> torch.Tensor:
    """``ulysses_attention`` for a mask given as a program of per-token ``leaves``
    (``spdsl.propagate.masks``): the rank's heads over the whole sequence, a block of queries
    at a time (``spdsl.kernels.masked_attn``), pipelined by head groups as
    ``ulysses_attention``; per-head leaves (ALiBi slopes) are cut to the rank's heads (and to
    each group's). ``project``: the output projection fused in, as ``ulysses_attention``'s."""
    hq = q.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)

    def attend(g: HeadGroup | None, q, k, v, leaves=leaves):
        if compute_dtype is not None:
            q, k, v = (t.to(compute_dtype) for t in (q, k, v))
        o = masked_attn_auto(q, k, v, list(leaves), program, is_causal, scale)  # flex/blocks
        return o.to(out_dtype) if out_dtype is not None else o

    if parts == 1:
        o = attend(None, q, k, v)
        return o if project is None else project_heads(None, o, project, 1, 0, hq)
    n = hq // parts
    heads = [hq > 1 and t.shape[1] == hq for t in leaves]
    leaves = [t.narrow(1, rank * n, n) if h else t for t, h in zip(leaves, heads)]
    return _pipelined(q, k, v, parts, group, lambda g, qh, kh, vh: attend(
        g, qh, kh, vh, [t.narrow(1, g.q, g.nq) if h else t for t, h in zip(leaves, heads)]),
        project)


def local_attention(q, k, v, mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False, kernel: bool = False, written_out: bool = False,
                    compute_dtype: torch.dtype | None = None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``written_out``: attention the user wrote out in ops (``spdsl.propagate.eager_attention``),
    computed the same way, so that rows whose every key is masked (left padding) get what
    the user's ops give them (a uniform average), not SDPA's convention."""
    if compute_dtype is not None:
        q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    if out_dtype is not None:
        return local_attention(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa,
                               kernel=kernel, written_out=written_out).to(out_dtype)
    if kernel:      # the kernel pass only sets this where there is no mask and no dropout
        return flash_attn(q, k, v, causal=is_causal, scale=scale)
    if written_out:
        if k.shape[1] != q.shape[1]:
            r = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        s = torch.matmul(q, k.transpose(-2, -1))
        s = s * (scale if scale is not None else q.shape[-1] ** -0.5)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
        w = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(w, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def nll_mean(logp: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
             ignore_index: int, group: str, two_d: bool = False):
    """Global mean NLL: all-reduce (local sum, local weight) and divide."""
    op = aten.nll_loss2d_forward if two_d else aten.nll_loss_forward
    total, _ = op(logp, target, weight, 2, ignore_index)
    valid = target != ignore_index
    if weight is None:
        count = valid.sum()
    else:
        count = (weight[target.clamp_min(0)] * valid).sum()
    both = all_reduce(torch.stack([total, count.to(total.dtype)]), group)
    return both[0] / both[1], both[1]


def mean_partial(x: torch.Tensor, dims, keepdim: bool, count: int, dtype=None) -> torch.Tensor:
    """Local share of a mean over a split dim: local sum / global count (a partial sum)."""
    dims = list(range(x.dim())) if dims is None else dims
    s = x.sum(dims, keepdim=keepdim, dtype=dtype)
    return s / count


def loss_mean(op, args: tuple, count: int) -> torch.Tensor:
    """``op(..., reduction=mean)`` over split values as a partial sum."""
    from spdsl.propagate.rules.loss import reduction_index
    i = reduction_index(op)
    args = list(args)
    args += [None] * (i + 1 - len(args))     # defaults before reduction are all None
    args[i] = 2
    return op(*args) / count


def select_owner(x: torch.Tensor, dim: int, index: int, lo: int, hi: int) -> torch.Tensor:
    """``X.select(dim, index)`` as a partial sum: the owner gives the row, others zeros."""
    if lo <= index < hi:
        return x.select(dim, index - lo)
    return x.select(dim, 0) * 0
