"""Ring attention's steps on local tensors, given the ring's exchange: the op
``torch.ops.spdsl.ring_attn`` (+ ``ring_attn_backward``, :mod:`spdsl.collectives.ring`) runs
:func:`forward` and :func:`backward` with its point-to-point exchange.

Each of the ``parts`` ranks of a ring holds its piece of the sequence of q, k and v
(``[B, H, S/P, D]``; kv heads unrepeated). In ``P`` steps the k/v pieces pass once around the
ring (rank ``r`` sends to ``r + 1`` and receives from ``r - 1``); at each step a rank attends
its queries to the keys it holds, with the block recurrence of
:mod:`spdsl.kernels.masked_attn` (fp32 running row max, sum and output), so the pieces merge
exactly as the flash recurrence merges key blocks: the result is the softmax over the whole
sequence, within fp32 rounding of the single-device computation. The exchange of step
``t + 1`` is posted before step ``t`` computes (``ring.shift``) and waited on after:
transfer overlaps compute, on gloo as on NCCL.

Backward (ring-flash-attn's): the k/v pieces go around again; each rank adds its queries'
contribution to the gradient of the piece it holds into an fp32 accumulator that travels with
the piece, one rank behind it, from the owner's next rank, and reaches the owner after
``P - 1`` hops. A rank attends its own piece last and adds its share to what arrives (the
first piece's transfer is the one not hidden). The probabilities are recomputed from the
saved row max and sum.

Masks: ``causal`` and mask programs of per-token leaves (``spdsl.propagate.masks``) work as in
the block kernel, with global positions: the leaves are the global ones (replicated), cut at
the global rows and columns of each step; a causal step whose keys all follow the queries is
skipped (its transfer still passes), as is every block a program keeps nothing of.

``layout`` says which global positions a rank's piece holds: ``"contiguous"`` (rank ``r``:
the ``r``-th of ``P`` chunks) or ``"zigzag"`` (chunks ``r`` and ``2P - 1 - r`` of ``2P``, which
balances causal work over the ranks).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.profiler import record_function

from spdsl.kernels.masked_attn import (
    _Blocks,
    _grouped,
    attend_rows,
    block_sizes,
    grad_rows,
    mask_program,
    softcap_of,
    typed_leaves,
)

LAYOUTS = ("contiguous", "zigzag")
COMPUTE = "spdsl.ring_attn.compute"   # profiler range: a step's attention, no transfer or wait
# backward has two streams in flight at once (the k/v pieces, the accumulators): their tags
# pair each receive with its send
KV_TAG, DKV_TAG = 7, 8
# mask-free pieces on PyTorch's fused CPU flash attention ([False]: always the block recurrence)
FUSED = [True]


class Received(Protocol):
    def wait(self) -> torch.Tensor: ...


class Exchange(Protocol):
    """What the steps need of the ring (``spdsl.collectives.ring.Ring``): ``shift(x, tag)``
    posts the send of ``x`` to the next rank and the receive of the previous rank's tensor of
    the same shape, and returns at once; ``wait()`` gives what was received."""

    def shift(self, x: torch.Tensor, tag: int) -> Received: ...


def segments(layout: str, n: int, parts: int, rank: int) -> list[tuple[int, int, int]]:
    """``(local start, global start, length)`` of the pieces of the sequence ``rank`` holds,
    ``n`` positions in all."""
    if layout == "zigzag":
        c = n // 2
        return [(0, rank * c, c), (c, (2 * parts - 1 - rank) * c, c)]
    return [(0, rank * n, n)]


def _pack(*ts: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(buf: torch.Tensor, *shapes) -> list[torch.Tensor]:
    out, at = [], 0
    for s in shapes:
        n = torch.Size(s).numel()
        out.append(buf[at:at + n].view(s))
        at += n
    return out


def _pairs(layout, s_q, s_k, parts, rank, src, causal):
    """The (query piece, key piece) pairs a step computes: causal skips keys that all
    follow the queries. The loop over them is the step's compute: a profiler range
    (``COMPUTE``) spans it, transfers and their waits outside."""
    with record_function(COMPUTE):
        for lq, gq, nq in segments(layout, s_q, parts, rank):
            for lk, gk, nk in segments(layout, s_k, parts, src):
                if not (causal and gk > gq + nq - 1):
                    yield lq, gq, nq, lk, gk, nk


def _fused(program, causal: bool, q: torch.Tensor, gq: int, nq: int, gk: int, nk: int):
    """How a (query piece, key piece) pair runs on PyTorch's fused CPU flash attention
    (``"causal"``: the diagonal pair; ``"full"``: keys all visible), or None: the block
    recurrence (a mask program, or not on the CPU). The fused kernel returns each row's
    log-sum-exp, which merges like a block's row max and sum; its backward takes the whole
    row's output and log-sum-exp (ring-flash-attn's use of it)."""
    if program is not None or q.device.type != "cpu" or not FUSED[0]:
        return None
    if not causal:
        return "full"
    if gq == gk and nq == nk:
        return "causal"
    return "full" if gk + nk <= gq else None


def _attend_fused(q_rows, ks, vs, how: str, scale: float, m, den, acc):
    """One pair on the fused kernel (``[B, H, rows, D]``, kv heads repeated to the query
    heads), merged into the running max, sum and output (``[B, H_kv, G, rows, 1 | Dv]``)."""
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_rows, ks, vs, 0.0, how == "causal", scale=scale)
    o, lse = o.unflatten(1, m.shape[1:3]), lse.unflatten(1, m.shape[1:3]).unsqueeze(-1)
    m_new = torch.maximum(m, lse)
    keep = torch.isfinite(m_new)
    alpha = torch.where(torch.isfinite(m), torch.exp(m - m_new), torch.zeros_like(m))
    beta = torch.where(keep & torch.isfinite(lse), torch.exp(lse - m_new), torch.zeros_like(m))
    return m_new, den * alpha + beta, acc * alpha + o * beta


def _grouped_spans(spans, h: int, hk: int):
    """A block's masks ``[B, H | 1, rows, cols]`` as ``[B, H_kv, G | 1, rows, cols]``: the
    query heads as (kv head, member of its group), so that k and v are read at their own
    heads, never repeated."""
    def five(t):
        if t is None or t.dim() < 4:       # [rows, cols] (causal alone) broadcasts as it is
            return t
        return t.unflatten(1, (hk, h // hk)) if t.shape[1] == h and h > 1 else t.unsqueeze(2)
    for j0, j1, keep, bias in spans:
        yield j0, j1, five(keep), five(bias)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list[torch.Tensor],
            program_key: str, causal: bool, scale: float, layout: str, parts: int, rank: int,
            ring: Exchange | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's forward: the output and each row's max and sum (``[B, H, S/P, 2]``, fp32).
    ``ring``: the exchange (None on a ring of one rank). Queries held as ``[B, H_kv, G, S, D]``
    (the query heads grouped by the kv head they read), k and v at their own heads: the
    matmuls broadcast over the group, nothing is repeated; q is cast to fp32 a block of rows
    at a time, k and v a piece at a time."""
    program = mask_program(program_key) if program_key else None
    leaves = typed_leaves(program_key, leaves)
    b, h, s_q, _ = q.shape
    hk, s_k, dv = k.shape[1], k.shape[2], v.shape[3]
    f32 = torch.promote_types(q.dtype, torch.float32)
    q5 = q.unflatten(1, (hk, h // hk))
    m = q.new_full((b, hk, h // hk, s_q, 1), float("-inf"), dtype=f32)
    den = q.new_zeros((b, hk, h // hk, s_q, 1), dtype=f32)
    acc = q.new_zeros((b, hk, h // hk, s_q, dv), dtype=f32)
    rows, cols = block_sizes(b, h, s_q, s_k)
    kv = _pack(k, v)
    for t in range(parts):
        src = (rank - t) % parts
        nxt = ring.shift(kv, KV_TAG) if t < parts - 1 else None
        kt, vt = _unpack(kv, k.shape, v.shape)
        kf, vf = kt.unsqueeze(2), vt.unsqueeze(2)   # [B, H_kv, 1, S, D], cast a block at a time
        for lq, gq, nq, lk, gk, nk in _pairs(layout, s_q, s_k, parts, rank, src, causal):
            ks, vs = kf[..., lk:lk + nk, :], vf[..., lk:lk + nk, :]
            fused = _fused(program, causal, q, gq, nq, gk, nk)
            if fused is not None:
                r = slice(lq, lq + nq)
                m[..., r, :], den[..., r, :], acc[..., r, :] = _attend_fused(
                    q[:, :, r].to(f32), _grouped(ks.squeeze(2), h).to(f32),
                    _grouped(vs.squeeze(2), h).to(f32),
                    fused, scale, m[..., r, :], den[..., r, :], acc[..., r, :])
                continue
            blocks = _Blocks(program, leaves, causal, nk, cols, q.device, gq, gk)
            for i0 in range(0, nq, rows):
                i1 = min(nq, i0 + rows)
                r = slice(lq + i0, lq + i1)
                m[..., r, :], den[..., r, :], acc[..., r, :] = attend_rows(
                    q5[..., r, :].to(f32), ks, vs, _grouped_spans(blocks.spans(i0, i1), h, hk),
                    scale, m[..., r, :], den[..., r, :], acc[..., r, :], softcap_of(program_key))
        kt = vt = kf = vf = ks = vs = None   # views of the piece: it goes once sent
        if nxt is not None:
            kv = nxt.wait()
    out = acc.div_(torch.where(den > 0, den, torch.ones_like(den))).flatten(1, 2)
    return out.to(q.dtype), torch.cat([m, den], dim=-1).flatten(1, 2)


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, stats: torch.Tensor, leaves: list[torch.Tensor], program_key: str,
             causal: bool, scale: float, layout: str, parts: int, rank: int,
             ring: Exchange | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's backward: dq, dk, dv. As forward: grouped query heads, k and v at their own
    heads (dk and dv summed over the group as they are made), q, dout and out cast a block of
    rows at a time."""
    program = mask_program(program_key) if program_key else None
    leaves = typed_leaves(program_key, leaves)
    b, h, s_q, _ = q.shape
    hk, s_k, d, dv = k.shape[1], k.shape[2], k.shape[3], v.shape[3]
    g = h // hk
    f32 = torch.promote_types(q.dtype, torch.float32)
    q5, do5, o5 = (x.unflatten(1, (hk, g)) for x in (q, dout, out))
    m, den = (stats[..., i:i + 1].unflatten(1, (hk, g)) for i in (0, 1))
    lse = None                          # the rows' log-sum-exp, for fused pieces
    dq = q.new_zeros((b, hk, g, s_q, d), dtype=f32)
    rows, cols = block_sizes(b, h, s_q, s_k)
    n_dk, n_dv = b * hk * s_k * d, b * hk * s_k * dv
    # the others' pieces first, the rank's own last: its share of dk/dv is then added to
    # what the others send home, and no accumulator waits for it through the whole loop (the
    # first piece's transfer is not hidden); a piece's accumulator, one flat fp32 buffer
    # that dk and dv are views of, follows it one rank behind
    nxt = ring.shift(_pack(k, v), KV_TAG) if ring is not None else None
    grads = None
    for t in list(range(1, parts)) + [0]:
        src = (rank - t) % parts
        if t:
            kv = nxt.wait()
            nxt = ring.shift(kv, KV_TAG) if t < parts - 1 else None
            kt, vt = _unpack(kv, k.shape, v.shape)
        else:
            kv, kt, vt = None, k, v
        kf, vf = kt.unsqueeze(2), vt.unsqueeze(2)   # [B, H_kv, 1, S, D], cast a block at a time
        mine = q.new_zeros(n_dk + n_dv, dtype=f32)
        dk = mine[:n_dk].view(b, hk, 1, s_k, d)
        dvv = mine[n_dk:].view(b, hk, 1, s_k, dv)
        for lq, gq, nq, lk, gk, nk in _pairs(layout, s_q, s_k, parts, rank, src, causal):
            ks, vs = kf[..., lk:lk + nk, :], vf[..., lk:lk + nk, :]
            fused = _fused(program, causal, q, gq, nq, gk, nk)
            if fused is not None:
                if lse is None:
                    lse = (m + den.log()).flatten(1, 2).squeeze(-1)   # den 0: -inf
                r = slice(lq, lq + nq)
                gq_, gk_, gv_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    dout[:, :, r].to(f32), q[:, :, r].to(f32), _grouped(ks.squeeze(2), h).to(f32),
                    _grouped(vs.squeeze(2), h).to(f32), out[:, :, r].to(f32), lse[:, :, r], 0.0,
                    fused == "causal", scale=scale)
                dq[..., r, :] += gq_.unflatten(1, (hk, g))
                dk[..., lk:lk + nk, :] += gk_.unflatten(1, (hk, g)).sum(2, keepdim=True)
                dvv[..., lk:lk + nk, :] += gv_.unflatten(1, (hk, g)).sum(2, keepdim=True)
                del gq_, gk_, gv_
                continue
            blocks = _Blocks(program, leaves, causal, nk, cols, q.device, gq, gk)
            for i0 in range(0, nq, rows):
                i1 = min(nq, i0 + rows)
                r = slice(lq + i0, lq + i1)
                do_blk, o_blk = do5[..., r, :].to(f32), o5[..., r, :].to(f32)
                grad_rows(q5[..., r, :].to(f32), do_blk, (do_blk * o_blk).sum(-1, keepdim=True),
                          m[..., r, :], den[..., r, :], ks, vs,
                          _grouped_spans(blocks.spans(i0, i1), h, hk), scale, dq[..., r, :],
                          dk[..., lk:lk + nk, :], dvv[..., lk:lk + nk, :], softcap_of(program_key))
                del do_blk, o_blk
        kv = kt = vt = kf = vf = ks = vs = dk = dvv = None   # the piece goes once sent
        if grads is not None:            # the piece's gradient from the ranks before (or,
            mine += grads.wait()         # last, the rank's own from all the others)
            grads = None                 # the received buffer goes before the next is made
        if t:                            # on to the next rank: the owner after the last step
            grads = ring.shift(mine, DKV_TAG)
            mine = None
    dk, dvv = mine[:n_dk].view(b, hk, s_k, d), mine[n_dk:].view(b, hk, s_k, dv)
    # dk and dv are views of one buffer: copies, so the op's outputs do not alias
    return (dq.flatten(1, 2).to(q.dtype), dk.to(k.dtype, copy=True),
            dvv.to(v.dtype, copy=True))


def workspace_bytes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list = (),
                    program: str = "", causal: bool = False, backward: bool = False,
                    parts: int | None = None, layout: str = "contiguous") -> int:
    """The op's peak scratch beyond its inputs and outputs, for the memory planner (checked
    against the allocator in tests/memory/test_ring_workspace.py), on a ring of ``parts``
    ranks (``None``: the most any ring needs, that of four ranks or more).

    Both directions hold the k/v piece attended and the one arriving (packed, k's dtype; cast
    to fp32 a key block at a time, never repeated: the query heads are grouped by the kv head
    they read). Forward: the running row max and sum (fp32; the
    running output is the op's output in fp32, scratch beside a narrow one), a block of rows
    of q in fp32, a block's scratch as in :func:`spdsl.kernels.masked_attn.block_workspace_bytes`
    and the running output of its previous key block and its update. Backward, at the block
    phase of its fullest step: the step's dk/dv (one flat fp32 buffer at the kv heads, sent on
    as the piece's accumulator) and, from the second piece on, the previous accumulator in
    flight and the one arriving (the rank's own piece comes last, so no share of its own
    waits through the loop), a narrow dtype's fp32 dq, a block of rows of q, dout and the
    output in fp32 and their product, and the block's scratch.

    Without a mask program on the CPU, pieces run on the fused flash kernel instead of
    blocks: per pair (``layout``: zigzag pairs are half a piece) k and v repeated to the
    query heads (GQA) and the pair's rows of q (and in backward dout and the output) in
    fp32; forward its output and log-sum-exp, then either its own tiles
    (``spdsl.kernels.cpu_flash``) or the merge's three ``[rows, Dv]`` fp32 temporaries and
    the masks of finite rows; backward its tiles, its dq, dk, dv and the rows' log-sum-exp.

    Example::

        q = torch.empty(1, 4, 65536, 128, dtype=torch.bfloat16, device="meta")
        k = torch.empty(1, 1, 65536, 128, dtype=torch.bfloat16, device="meta")
        workspace_bytes(q, k, k, causal=True, backward=True, parts=8)
    """
    from spdsl.kernels.masked_attn import block_workspace_bytes as block_bytes
    b, h, s_q, d = q.shape
    hk, s_k, dv = k.shape[1], k.shape[2], v.shape[3]
    f32 = torch.promote_types(q.dtype, torch.float32)
    w = torch.empty((), dtype=f32).element_size()
    narrow = q.dtype != f32
    piece = b * hk * s_k * (d + dv) * k.element_size()         # one packed k/v piece
    pieces = piece * (2 if parts is None or parts > 1 else 1)  # attended, arriving
    acc = b * hk * s_k * (d + dv) * w            # dk/dv at the kv heads in fp32
    rows, cols = block_sizes(b, h, s_q, s_k)
    fused = not program and q.device.type in ("cpu", "meta") and FUSED[0]
    if fused:
        from spdsl.kernels.cpu_flash import flash_cpu_backward, flash_cpu_forward
        nq, nk = (s_q // 2, s_k // 2) if layout == "zigzag" else (s_q, s_k)
        with torch.device("meta"):
            qp = torch.empty((b, h, nq, d), dtype=f32)
            kp = torch.empty((b, h, nk, d), dtype=f32)
        rep = b * h * nk * (d + dv) * w if (hk != h or narrow) else 0    # the pair's k, v
        if backward:
            block = flash_cpu_backward((qp, qp, kp), {}) + rep + b * h * s_q * w \
                + b * h * (nq * d + nk * (d + dv)) * w \
                + (b * h * nq * (d + 2 * dv) * w if narrow else 0)    # dout, q, out rows
        else:
            block = rep + (b * h * nq * d * w if narrow else 0) + b * h * nq * (dv + 1) * w \
                + max(flash_cpu_forward((qp, kp), {}), b * h * nq * ((3 * dv + 2) * w + 2))
    else:
        with torch.device("meta"):     # the block's own scratch: fp32, heads as the queries
            qm = torch.empty((b, h, s_q, d), dtype=f32)
            km = torch.empty((b, h, s_k, d), dtype=f32)
            vm = torch.empty((b, h, s_k, dv), dtype=f32)
            block = block_bytes(qm, km, vm, list(leaves), program, causal, backward)
        if backward:                   # a block of rows of q, dout, out and dout * out
            block += b * h * rows * ((d + 2 * dv) * w if narrow else 0) + b * h * rows * dv * w
        else:
            block += 2 * b * h * rows * dv * w + (b * h * rows * d * w if narrow else 0)
        if narrow:                     # a key block of k and v in fp32
            block += b * hk * cols * (d + dv) * w
    if not backward:
        out = b * h * s_q * dv * w if narrow else 0          # the running output, in fp32
        return pieces + block + 2 * b * h * s_q * w + out
    # (pieces, accumulators) held at a step's blocks: the step's own dk/dv buffer; from the
    # second piece on also the previous one in flight and the one arriving; the rank's own
    # piece comes last, with no k/v piece held
    if parts is None or parts >= 3:
        blocks_at = pieces + 3 * acc
    elif parts == 2:             # the one accumulator sent has arrived by the own piece
        blocks_at = max(piece + acc, 2 * acc)
    else:
        blocks_at = acc
    dq = b * h * s_q * d * w if narrow else 0    # in fp32 beside a narrow output
    return blocks_at + block + dq
