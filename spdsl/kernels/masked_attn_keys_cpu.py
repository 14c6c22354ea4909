"""Masked attention on ATen's fused CPU flash attention, forward and backward, for a mask
:func:`spdsl.kernels.masked_attn_keys.split` took (a :class:`KeyMask`): one call, one call per
document, or a sliding window's blocks of two calls merged by log-sum-exp; rows that keep no
key added in closed form (see ``spdsl.kernels.masked_attn_keys`` for what each covers)."""

from __future__ import annotations

import itertools

import torch

from spdsl.kernels.masked_attn import _grouped
from spdsl.kernels.masked_attn_keys import KeyMask

aten = torch.ops.aten


def _spans(documents: tuple | None, s: int):
    """(batch rows, start, end) of each document (``KeyMask.documents``), or of the whole row
    without them."""
    rows = documents or ((0, s),)
    for i, row in enumerate(rows):
        take = slice(None) if len(rows) == 1 else slice(i, i + 1)
        for s0, s1 in itertools.pairwise(row):
            yield take, s0, s1


def _bias(mask: KeyMask, take: slice, s0: int, s1: int):
    if mask.bias is None:
        return None
    b = mask.bias if mask.bias.shape[0] == 1 else mask.bias[take]
    return b[..., s0:s1]



def forward(q, k, v, mask: KeyMask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and the block kernel's row statistics ``[B, H, S_q, 2]`` (max, sum), here
    ``(log-sum-exp, 1)``: the same probabilities ``exp(s - max) / sum``. Documents: one call
    of the kernel per document, over its own tokens (no score across two documents)."""
    h = q.shape[1]
    k, v = _grouped(k, h), _grouped(v, h)
    out, stats = _forward(q, k, v, mask, scale)
    if mask.averaged is not None:          # rows keeping no key (zeros so far): every value's mean
        out.addcmul_(mask.averaged.to(out.dtype), v.mean(2, keepdim=True))
    return out, stats


def _forward(q, k, v, mask: KeyMask, scale: float):
    h = q.shape[1]
    if mask.window and mask.documents is None:
        return _forward_window(q, k, v, mask, scale)
    if mask.documents is None:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, mask.causal, attn_mask=mask.bias, scale=scale)[:2]
        stats = lse.new_ones(*lse.shape, 2)
        stats[..., 0] = lse
        # the kernel's output is a [B, S, H, D] buffer seen as [B, H, S, D]: made contiguous,
        # as the op's fake (and Inductor's plan of a compiled step) has it
        return out.contiguous(), stats
    b, _, s, _ = q.shape
    out = q.new_empty(b, h, s, v.shape[-1])
    stats = q.new_ones(b, h, s, 2, dtype=torch.promote_types(q.dtype, torch.float32))
    for take, s0, s1 in _spans(mask.documents, s):
        part = (take, slice(None), slice(s0, s1))
        if mask.window and s1 - s0 > mask.window:       # a window inside the document
            out[part], stats[part] = _forward_window(q[part], k[part], v[part],
                                                     _in_document(mask, take, s0, s1), scale)
            continue
        o, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q[part], k[part], v[part], 0.0, mask.causal,
            attn_mask=_bias(mask, take, s0, s1), scale=scale)[:2]
        out[part] = o
        stats[take, :, s0:s1, 0] = lse
        del o, lse
    return out, stats


def _in_document(mask: KeyMask, take: slice, s0: int, s1: int) -> KeyMask:
    """The window's mask over one document's tokens (the window counts from the row's index,
    the same inside a document)."""
    return KeyMask(True, _bias(mask, take, s0, s1), window=mask.window)


def backward(dout, q, k, v, out, stats, mask: KeyMask, scale: float):
    """dq, dk, dv (k and v at their own heads: a group's gradients summed)."""
    b, h = q.shape[:2]
    hk = k.shape[1]
    kg, vg = _grouped(k, h), _grouped(v, h)
    if mask.window and mask.documents is None:
        dq, dk, dv = _backward_window(dout, q, kg, vg, out, stats, mask, scale)
    elif mask.documents is None:
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, kg, vg, out, stats[..., 0].contiguous(), 0.0, mask.causal,
            attn_mask=mask.bias, scale=scale)
    else:
        dq, dk, dv = _backward_documents(dout, q, kg, vg, out, stats, mask, scale)
    if mask.averaged is not None:
        _averaged_backward(dout, q, kg, vg, out, mask.averaged, scale, dq, dk, dv)
    if hk != h:
        dk = dk.reshape(b, hk, h // hk, *dk.shape[2:]).sum(2)
        dv = dv.reshape(b, hk, h // hk, *dv.shape[2:]).sum(2)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


def _averaged_backward(dout, q, k, v, out, rows, scale: float, dq, dk, dv) -> None:
    """Adds the gradients of the rows that average every value (``rows``; the kernel gave
    them none): all their scores equal, ``P = 1 / S``, so with ``delta_i = dO_i . out_i`` the
    score gradient is ``(dO_i . v_j - delta_i) / S`` and the sums over keys and rows are
    products with ``[D, D]`` matrices: ``dq_i = scale / S (dO_i V^T K - delta_i sum_j k_j)``,
    ``dk_j = scale / S (Q^T dO v_j - sum_i delta_i q_i)``, ``dv_j = sum_i dO_i / S``."""
    s = k.shape[2]
    do = dout * rows.to(dout.dtype)                      # the rows' output gradients, others 0
    delta = (do * out).sum(-1, keepdim=True)
    dv.add_(do.sum(2, keepdim=True), alpha=1 / s)
    f = scale / s
    dq.add_(torch.matmul(do, torch.matmul(v.transpose(-2, -1), k)).sub_(
        delta * k.sum(2, keepdim=True)), alpha=f)
    a = torch.matmul(q.transpose(-2, -1), do)           # sum_i q_i dO_i^T
    dk.add_(torch.matmul(v, a.transpose(-2, -1)).sub_(torch.matmul(delta.transpose(-2, -1), q)),
            alpha=f)


def _backward_documents(dout, q, k, v, out, stats, mask: KeyMask, scale: float):
    """The kernel's backward per document (``k``, ``v`` at the query's heads)."""
    s = q.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for take, s0, s1 in _spans(mask.documents, s):
        part = (take, slice(None), slice(s0, s1))
        if mask.window and s1 - s0 > mask.window:
            g = _backward_window(dout[part], q[part], k[part], v[part], out[part], stats[part],
                                 _in_document(mask, take, s0, s1), scale)
        else:
            g = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout[part], q[part], k[part], v[part], out[part],
                stats[take, :, s0:s1, 0].contiguous(), 0.0, mask.causal,
                attn_mask=_bias(mask, take, s0, s1), scale=scale)
        dq[part], dk[part], dv[part] = g
        del g
    return dq, dk, dv


def _window_blocks(s: int, window: int):
    """(first row, end, first key before the block) of the query blocks of ``window - 1``
    rows, laid from the end: only the first block (key 0 on) is shorter, and has no keys
    before it."""
    n = window - 1
    ends = range(s % n or n, s + 1, n)
    for a, e in zip((0, *ends), ends):
        yield a, e, max(0, a - n)


def _pieces(q, k, v, bias, a: int, e: int, c: int):
    """A block's two causal calls' operands: (q, k, v, key row, read backwards): its own keys,
    then (``a > 0``) the keys ``c .. a - 1`` before it, both sides reversed: row ``r`` keeps
    key ``t`` there when ``t >= r``, which reversed is the triangle (top-left aligned: the
    first block's fewer keys before it included)."""
    row = None if bias is None else bias[..., a:e]
    yield q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], row, False
    if a > 0:
        row = None if bias is None else bias[..., c:a].flip(-1)
        yield q[:, :, a:e].flip(-2), k[:, :, c:a].flip(-2), v[:, :, c:a].flip(-2), row, True


def _running_keep(bias):
    """How many keys the key row keeps before each key, ``[B | 1, H | 1, S_k + 1]``; None
    without a row."""
    if bias is None:
        return None
    return torch.nn.functional.pad((bias[:, :, 0, :] == 0).to(torch.int64).cumsum(-1), (1, 0))


def _empty_rows(counts, a: int, e: int, backwards: bool):
    """Rows of the block ``a .. e - 1`` that keep no key in one of its calls,
    ``[B | 1, H | 1, e - a, 1]`` (``counts``: :func:`_running_keep`); None without a key row.
    Row ``a + r`` sees keys ``a .. a + r`` in the first call, ``a - n + r .. a - 1`` in the
    second (``n = e - a``; none before key 0)."""
    if counts is None:
        return None
    if backwards:
        n = e - a
        before = counts[..., max(0, a - n):a]
        before = torch.nn.functional.pad(before, (n - before.shape[-1], 0))
        kept = counts[..., a:a + 1] - before
    else:
        kept = counts[..., a + 1:e + 1] - counts[..., a:a + 1]
    return (kept == 0).unsqueeze(-1)


def _forward_window(q, k, v, mask: KeyMask, scale: float):
    """A sliding window, two causal calls a block (:func:`_pieces`) merged by log-sum-exp
    (``k``, ``v`` at the query's heads). Rows that keep nothing: zeros and log-sum-exp 0, as
    the kernel gives them."""
    b, h, s, _ = q.shape
    out = q.new_empty(b, h, s, v.shape[-1])
    stats = q.new_ones(b, h, s, 2, dtype=torch.promote_types(q.dtype, torch.float32))
    counts = _running_keep(mask.bias)
    for a, e, c in _window_blocks(s, mask.window):
        parts = []
        for qp, kp, vp, bp, backwards in _pieces(q, k, v, mask.bias, a, e, c):
            o, lse = aten._scaled_dot_product_flash_attention_for_cpu(
                qp, kp, vp, 0.0, True, attn_mask=bp, scale=scale)[:2]
            del qp, kp, vp, bp
            if backwards:
                o, lse = o.flip(-2), lse.flip(-1)
            parts.append((o, lse.unsqueeze(-1), backwards))
            del o, lse
        if len(parts) == 1:                 # the first block: its own keys only
            out[:, :, a:e], stats[:, :, a:e, 0:1] = parts[0][:2]
            continue
        (o1, l1, _), (o2, l2, _) = parts
        del parts
        for lse, backwards in ((l1, False), (l2, True)):   # a call's empty row: no weight
            empty = _empty_rows(counts, a, e, backwards)
            if empty is not None:
                lse.masked_fill_(empty, float("-inf"))
        lse = torch.logaddexp(l1, l2)
        nothing = torch.isneginf(lse)
        lse.masked_fill_(nothing, 0.0)
        w1 = (l1 - lse).exp_().masked_fill_(nothing, 0.0)
        w2 = (l2 - lse).exp_().masked_fill_(nothing, 0.0)
        del l1, l2
        merged = o1.to(w1.dtype) * w1                    # in fp32 for bf16 / fp16 inputs
        out[:, :, a:e] = merged.addcmul_(o2.to(w2.dtype), w2)
        stats[:, :, a:e, 0:1] = lse
        del o1, o2, w1, w2, lse, merged
    return out, stats


def _backward_window(dout, q, k, v, out, stats, mask: KeyMask, scale: float):
    """The kernel's backward on each block's two calls with the merged output and log-sum-exp:
    the softmax's gradient of each call is its share of the whole row's."""
    s = q.shape[2]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, e, c in _window_blocks(s, mask.window):
        lse = stats[:, :, a:e, 0]
        for qp, kp, vp, bp, backwards in _pieces(q, k, v, mask.bias, a, e, c):
            do, o, lp = dout[:, :, a:e], out[:, :, a:e], lse
            if backwards:
                do, o, lp = do.flip(-2), o.flip(-2), lp.flip(-1)
            g = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                do, qp, kp, vp, o, lp.contiguous(), 0.0, True, attn_mask=bp, scale=scale)
            del do, o, lp, qp, kp, vp, bp
            if backwards:
                dq[:, :, a:e] += g[0].flip(-2)
                dk[:, :, c:a] += g[1].flip(-2)
                dv[:, :, c:a] += g[2].flip(-2)
            else:
                dq[:, :, a:e] += g[0]
                dk[:, :, a:e] += g[1]
                dv[:, :, a:e] += g[2]
            del g
    return dq, dk, dv
