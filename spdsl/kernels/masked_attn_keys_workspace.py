"""The scratch of the fused CPU path (``spdsl.kernels.masked_attn_keys_cpu``) beyond the op's
inputs and outputs, from the shapes and the :class:`KeyMask` alone: what the memory planner
counts for a masked attention that runs there."""

from __future__ import annotations

import dataclasses

import torch

from spdsl.kernels.cpu_flash import flash_cpu_backward, flash_cpu_forward
from spdsl.kernels.masked_attn_keys import KeyMask


def _window_bytes(q, mask: KeyMask, backward: bool) -> int:
    """A sliding window's scratch at its largest block: ``n = window - 1`` query rows and
    ``min(n, S - n)`` keys before them. Forward: the first call's output held through the
    second, whose q, k and v are reversed copies, then the merge (weights, a product in fp32
    at least, the key row's running counts); backward: the reversed output, its gradient,
    q, k and v, and the kernel's gradients of the block, besides its tiles. The planner,
    not seeing the width (``window == 0``): the most over every width. Up to half the row
    (``m = n``) it grows with ``n``; beyond, ``m = S - n`` shrinks as ``n`` grows, the
    copies' sum grows or stays, the kernel's tiles stay until ``m`` is under their 512 keys,
    then the two change linearly: the most is at ``n = S / 2``, ``S - 512`` or ``S - 1``."""
    b, h, s, d = q.shape
    if not mask.window:
        return max(_window_bytes(q, dataclasses.replace(mask, window=n + 1), backward)
                   for n in {s // 2, s - 512, s - 1} if n >= 1)
    n = min(s - 1, mask.window - 1)
    m = min(n, s - n)
    size, rows, rows_b = b * h * d * q.element_size(), b * h, 0
    qb, kb = size * n, size * m
    lse = rows * n * torch.promote_types(q.dtype, torch.float32).itemsize
    q_piece = torch.empty(b, h, n, d, device="meta", dtype=q.dtype)
    k_piece = torch.empty(b, h, m, d, device="meta", dtype=q.dtype)
    flipped_row = counts = making = 0
    if mask.bias is not None:
        rows_b = mask.bias.shape[0] * mask.bias.shape[1]
        flipped_row = rows_b * m * mask.bias.element_size()
        counts = rows_b * (s + 1) * 8                   # _running_keep, held through the loop
        making = rows_b * s * 17                        # its kept flags, int64 copy, cumsum
    if not backward:
        call = 3 * qb + 2 * kb + 2 * lse + flipped_row + \
            flash_cpu_forward((q_piece, k_piece), {})
        # _empty_rows: a slice's padded copy, a difference, a comparison
        wide = qb * torch.promote_types(q.dtype, torch.float32).itemsize // q.element_size()
        merge = 2 * qb + (qb if wide == qb else 2 * wide) + 5 * lse + rows * n + \
            (25 * n * rows_b if counts else 0)
        return max(making, counts + max(call, merge))
    own = 3 * qb + lse + flash_cpu_backward((q_piece, q_piece, q_piece), {})
    before = 4 * qb + 4 * kb + lse + flipped_row + \
        flash_cpu_backward((q_piece, q_piece, k_piece), {})
    return max(own, before)


def workspace_bytes(q, k, v, mask: KeyMask, backward: bool = False) -> int:
    """Scratch beyond the op's inputs and outputs: the key row; k and v repeated to the query
    heads (GQA) and, backward, their gradients before each group is summed; the fused
    kernel's tiles (``spdsl.kernels.cpu_flash``); its ``[B, S, H, D]`` results before they
    are made contiguous (a copy only with several heads); forward the log-sum-exp before it
    goes into the statistics, backward its contiguous copy. Documents: each call's results
    are copied into the op's own, so the kernel's buffers are always extra, counted for one
    document as long as the row (the most there can be; the planner does not see the ids)."""
    b, h, s_q, d = q.shape
    size = q.element_size()
    row = mask.bias.shape[0] * mask.bias.shape[1] * mask.bias.shape[3] * \
        mask.bias.element_size() if mask.bias is not None else 0
    gqa = k.shape[1] != h
    kv_h = b * h * k.shape[2] * (k.shape[3] + v.shape[3]) * k.element_size()   # at H heads
    lse = b * h * s_q * torch.promote_types(q.dtype, torch.float32).itemsize
    q_bytes = b * h * s_q * d * size
    if mask.window is not None:
        windowed = row + (2 if gqa and backward else 1 if gqa else 0) * kv_h + \
            _window_bytes(q, mask, backward)
        if mask.documents is None:
            return windowed
        # per document: a windowed one's results copied into the op's (a document as long as
        # the row: its output and statistics, backward its three gradients), or the plain call
        copies = 3 * q_bytes if backward else q_bytes + 2 * lse
        return max(windowed + copies,
                   workspace_bytes(q, k, v, dataclasses.replace(mask, window=None), backward))
    # a [B, S, H, D] buffer is [B, H, S, D]-contiguous at H=1; per document, always copied
    copied = h > 1 or mask.documents is not None
    # an additive mask's rows that keep no key, averaged after the kernel: forward their flags
    # and the values' mean; backward the rows' output gradients and two products at a time
    rows_b = (mask.bias.shape[0] * mask.bias.shape[1] if mask.bias is not None else 1)
    if not backward:
        averaged = rows_b * s_q * size + b * h * d * size if mask.additive else 0
        return row + (kv_h if gqa else 0) + lse + (q_bytes if copied else 0) + \
            flash_cpu_forward((q, k), {}) + averaged
    dout = torch.empty(b, h, s_q, d, device="meta", dtype=q.dtype)   # as autograd makes it
    grads = kv_h if gqa or copied else 0            # dk, dv at H heads, or before the copy
    if mask.documents is not None and gqa:
        grads += kv_h                   # the kernel's per document, and the op's at H heads
    held = row + (kv_h if gqa else 0) + grads
    kernel = lse + (q_bytes if copied else 0) + flash_cpu_backward((dout, q, k), {})
    averaged = 3 * q_bytes + b * h * s_q * size if mask.additive else 0
    return held + max(kernel, averaged)
