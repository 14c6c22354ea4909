"""Ring attention on local tensors: ``torch.ops.spdsl.ring_attn`` (+ ``ring_attn_backward``).

Each of the ``parts`` ranks of a ring holds its piece of the sequence of q, k and v
(``[B, H, S/P, D]``; kv heads unrepeated). In ``P`` steps the k/v pieces pass once around the
ring (rank ``r`` sends to ``r + 1`` and receives from ``r - 1``); at each step a rank attends
its queries to the keys it holds, with the block recurrence of
:mod:`spdsl.kernels.masked_attn` (fp32 running row max, sum and output), so the pieces merge
exactly as the flash recurrence merges key blocks: the result is the softmax over the whole
sequence, within fp32 rounding of the single-device computation. The exchange of step
``t + 1`` is posted before step ``t`` computes (``batch_isend_irecv``) and waited on after:
transfer overlaps compute, on gloo as on NCCL.

Backward (ring-flash-attn's): the k/v pieces go around again; each rank adds its queries'
contribution to the gradient of the piece it holds into an fp32 accumulator that travels with
the piece, one rank behind it, and arrives at the piece's owner after ``P`` steps. The
probabilities are recomputed from the saved row max and sum.

Masks: ``causal`` and mask programs of per-token leaves (``spdsl.propagate.masks``) work as in
the block kernel, with global positions: the leaves are the global ones (replicated), cut at
the global rows and columns of each step; a causal step whose keys all follow the queries is
skipped (its transfer still passes), as is every block a program keeps nothing of.

``layout`` says which global positions a rank's piece holds: ``"contiguous"`` (rank ``r``:
the ``r``-th of ``P`` chunks) or ``"zigzag"`` (chunks ``r`` and ``2P - 1 - r`` of ``2P``, which
balances causal work over the ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function

from spdsl._torch import process_group
from spdsl.kernels.masked_attn import (
    _Blocks,
    _grouped,
    _up,
    attend_rows,
    block_sizes,
    grad_rows,
    mask_program,
    typed_leaves,
)

LAYOUTS = ("contiguous", "zigzag")
COMPUTE = "spdsl.ring_attn.compute"   # profiler range: a step's attention, no transfer or wait
_KV_TAG, _DKV_TAG = 7, 8
# mask-free pieces on PyTorch's fused CPU flash attention ([False]: always the block recurrence)
FUSED = [True]


def segments(layout: str, n: int, parts: int, rank: int) -> list[tuple[int, int, int]]:
    """``(local start, global start, length)`` of the pieces of the sequence ``rank`` holds,
    ``n`` positions in all."""
    if layout == "zigzag":
        c = n // 2
        return [(0, rank * c, c), (c, (2 * parts - 1 - rank) * c, c)]
    return [(0, rank * n, n)]


class _Pending:
    def __init__(self, works, buf: torch.Tensor) -> None:
        self.works, self.buf = works, buf

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        self.works = ()     # the works hold the sent tensor: it goes now, not at the next shift
        return self.buf


class _Ring:
    """The neighbours of ``rank`` in the ring over the process group named ``group``."""

    def __init__(self, group: str, parts: int, rank: int) -> None:
        self.pg = process_group(group)
        self.next = dist.get_global_rank(self.pg, (rank + 1) % parts)
        self.prev = dist.get_global_rank(self.pg, (rank - 1) % parts)

    def shift(self, x: torch.Tensor, tag: int) -> _Pending:
        """Send ``x`` to the next rank, receive the previous rank's into a new buffer."""
        x = x.contiguous()
        buf = torch.empty_like(x)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, x, self.next, self.pg, tag),
            dist.P2POp(dist.irecv, buf, self.prev, self.pg, tag)])
        return _Pending(works, buf)


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
    """One pair on the fused kernel, merged into the running max, sum and output."""
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_rows, ks, vs, 0.0, how == "causal", scale=scale)
    lse = lse.unsqueeze(-1)
    m_new = torch.maximum(m, lse)
    keep = torch.isfinite(m_new)
    alpha = torch.where(torch.isfinite(m), torch.exp(m - m_new), torch.zeros_like(m))
    beta = torch.where(keep & torch.isfinite(lse), torch.exp(lse - m_new), torch.zeros_like(m))
    return m_new, den * alpha + beta, acc * alpha + o * beta


def _forward(q, k, v, leaves, program_key, causal, scale, layout, parts, rank, group):
    program = mask_program(program_key) if program_key else None
    leaves = typed_leaves(program_key, leaves)
    b, h, s_q, _ = q.shape
    s_k, dv = k.shape[2], v.shape[3]
    (qf,) = _up(q)
    m = qf.new_full((b, h, s_q, 1), float("-inf"))
    den = qf.new_zeros(b, h, s_q, 1)
    acc = qf.new_zeros(b, h, s_q, dv)
    rows, cols = block_sizes(b, h, s_q, s_k)
    ring = _Ring(group, parts, rank) if parts > 1 else None
    kv = _pack(k, v)
    for t in range(parts):
        src = (rank - t) % parts
        nxt = ring.shift(kv, _KV_TAG) if t < parts - 1 else None
        kt, vt = _unpack(kv, k.shape, v.shape)
        kf, vf = _up(_grouped(kt, h), _grouped(vt, h))
        for lq, gq, nq, lk, gk, nk in _pairs(layout, s_q, s_k, parts, rank, src, causal):
            ks, vs = kf[:, :, lk:lk + nk], vf[:, :, lk:lk + nk]
            fused = _fused(program, causal, q, gq, nq, gk, nk)
            if fused is not None:
                r = slice(lq, lq + nq)
                m[:, :, r], den[:, :, r], acc[:, :, r] = _attend_fused(
                    qf[:, :, r], ks, vs, fused, scale, m[:, :, r], den[:, :, r], acc[:, :, r])
                continue
            blocks = _Blocks(program, leaves, causal, nk, cols, q.device, gq, gk)
            for i0 in range(0, nq, rows):
                i1 = min(nq, i0 + rows)
                r = slice(lq + i0, lq + i1)
                m[:, :, r], den[:, :, r], acc[:, :, r] = attend_rows(
                    qf[:, :, r], ks, vs, blocks.spans(i0, i1), scale, m[:, :, r],
                    den[:, :, r], acc[:, :, r])
        kt = vt = kf = vf = ks = vs = None   # views of the piece: it goes once sent
        if nxt is not None:
            kv = nxt.wait()
    out = acc.div_(torch.where(den > 0, den, torch.ones_like(den)))
    return out.to(q.dtype), torch.cat([m, den], dim=-1)


def _backward(dout, q, k, v, out, stats, leaves, program_key, causal, scale, layout, parts,
              rank, group):
    program = mask_program(program_key) if program_key else None
    leaves = typed_leaves(program_key, leaves)
    b, h, s_q, _ = q.shape
    hk, s_k, d, dv = k.shape[1], k.shape[2], k.shape[3], v.shape[3]
    (qf,) = _up(q)
    do, of = _up(dout, out)
    delta = (do * of).sum(-1, keepdim=True)
    m, den = stats[..., 0:1], stats[..., 1:2]
    lse = None                          # the rows' log-sum-exp, for fused pieces
    dq = qf.new_zeros(qf.shape)         # contiguous, as the fake kernel says (q may be a view)
    rows, cols = block_sizes(b, h, s_q, s_k)
    ring = _Ring(group, parts, rank) if parts > 1 else None
    kv, grads = _pack(k, v), None
    for t in range(parts):
        src = (rank - t) % parts
        nxt = ring.shift(kv, _KV_TAG) if t < parts - 1 else None
        kt, vt = _unpack(kv, k.shape, v.shape)
        kf, vf = _up(_grouped(kt, h), _grouped(vt, h))
        dk, dvv = torch.zeros_like(kf), torch.zeros_like(vf)
        for lq, gq, nq, lk, gk, nk in _pairs(layout, s_q, s_k, parts, rank, src, causal):
            ks, vs = kf[:, :, lk:lk + nk], vf[:, :, lk:lk + nk]
            fused = _fused(program, causal, q, gq, nq, gk, nk)
            if fused is not None:
                if lse is None:
                    lse = (m + den.log()).squeeze(-1)        # den 0: -inf, no key kept
                r = slice(lq, lq + nq)
                gq_, gk_, gv_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    do[:, :, r], qf[:, :, r], ks, vs, of[:, :, r], lse[:, :, r], 0.0,
                    fused == "causal", scale=scale)
                dq[:, :, r] += gq_
                dk[:, :, lk:lk + nk] += gk_
                dvv[:, :, lk:lk + nk] += gv_
                del gq_, gk_, gv_
                continue
            blocks = _Blocks(program, leaves, causal, nk, cols, q.device, gq, gk)
            for i0 in range(0, nq, rows):
                i1 = min(nq, i0 + rows)
                r = slice(lq + i0, lq + i1)
                grad_rows(qf[:, :, r], do[:, :, r], delta[:, :, r], m[:, :, r], den[:, :, r],
                          ks, vs, blocks.spans(i0, i1), scale, dq[:, :, r],
                          dk[:, :, lk:lk + nk], dvv[:, :, lk:lk + nk])
        kt = vt = kf = vf = ks = vs = None   # views of the piece: it goes once sent
        if hk != h:
            dk = dk.view(b, hk, h // hk, s_k, d).sum(2)
            dvv = dvv.view(b, hk, h // hk, s_k, dv).sum(2)
        mine = _pack(dk, dvv)
        del dk, dvv                      # packed: not held beside the next step's blocks
        if t == 0:
            own = mine                   # the rank's own piece: added when the rest arrives
        else:
            if grads is not None:        # the piece's gradient from the ranks before
                mine += grads.wait()
                grads = None             # the received buffer goes before the next is made
            # one rank behind its piece: after the last step it reaches the piece's owner
            grads = ring.shift(mine, _DKV_TAG)
        if nxt is not None:
            kv = nxt.wait()
    if grads is not None:
        own += grads.wait()
    dk, dvv = _unpack(own, (b, hk, s_k, d), (b, hk, s_k, dv))
    # dk and dv are views of one received buffer: copies, so the op's outputs do not alias
    return dq.to(q.dtype), dk.to(k.dtype, copy=True), dvv.to(v.dtype, copy=True)


@torch.library.custom_op("spdsl::ring_attn", mutates_args=())
def _ring_attn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  leaves: list[torch.Tensor], program: str, causal: bool, scale: float,
                  layout: str, parts: int, rank: int, group: str,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, leaves, program, causal, scale, layout, parts, rank, group)


@_ring_attn_op.register_fake
def _(q, k, v, leaves, program, causal, scale, layout, parts, rank, group):
    b, h, s_q, _ = q.shape
    return (q.new_empty((b, h, s_q, v.shape[-1])),
            q.new_empty((b, h, s_q, 2), dtype=torch.promote_types(q.dtype, torch.float32)))


@torch.library.custom_op("spdsl::ring_attn_backward", mutates_args=())
def _ring_attn_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, out: torch.Tensor, stats: torch.Tensor,
                           leaves: list[torch.Tensor], program: str, causal: bool, scale: float,
                           layout: str, parts: int, rank: int, group: str,
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dout, q, k, v, out, stats, leaves, program, causal, scale, layout, parts,
                     rank, group)


@_ring_attn_backward_op.register_fake
def _(dout, q, k, v, out, stats, leaves, program, causal, scale, layout, parts, rank, group):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, leaves, program, causal, scale, layout, parts, rank, group = inputs
    out, stats = output
    ctx.save_for_backward(q, k, v, out, stats, *leaves)
    ctx.args = (program, causal, scale, layout, parts, rank, group)


def _backward_rule(ctx, dout, dstats):
    q, k, v, out, stats, *leaves = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _ring_attn_backward_op(dout, q, k, v, out, stats, leaves, *ctx.args)
    return (dq, dk, dv, [None] * len(leaves)) + (None,) * 7


_ring_attn_op.register_autograd(_backward_rule, setup_context=_setup_context)


def ring_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: str, parts: int,
              rank: int, mask_fn=None, leaves: list[torch.Tensor] = (), causal: bool = False,
              scale: float | None = None, layout: str = "contiguous") -> torch.Tensor:
    """Attention over the whole sequence for this rank's piece of the queries, its keys and
    values passing around the ring of ``parts`` ranks of the process group named ``group``
    (see the module docstring). ``mask_fn(*leaves)`` as in
    :func:`spdsl.kernels.masked_attn.masked_attn`, with global leaves.

    Example (4 ranks, each holding a quarter of a causal sequence)::

        pg = dist.group.WORLD
        o = ring_attn(q_piece, k_piece, v_piece, group=pg.group_name, parts=4,
                      rank=dist.get_rank(), causal=True)
    """
    from spdsl.kernels.masked_attn import register_mask_program
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    key = mask_fn if isinstance(mask_fn, str) or mask_fn is None else \
        register_mask_program(mask_fn, getattr(mask_fn, "__name__", "mask"))
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out, _ = torch.ops.spdsl.ring_attn(q, k, v, list(leaves), key or "", bool(causal), scale,
                                       layout, parts, rank, group)
    return out


def workspace_bytes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list = (),
                    program: str = "", causal: bool = False, backward: bool = False,
                    parts: int | None = None, layout: str = "contiguous") -> int:
    """The op's peak scratch beyond its inputs and outputs, for the memory planner (checked
    against the allocator in tests/memory/test_ring_workspace.py), on a ring of ``parts``
    ranks (``None``: the most any ring needs, that of four ranks or more).

    Forward: the k/v piece attended and the one arriving (packed, k's dtype), their fp32
    copies at the query heads (GQA or a narrow dtype), the running row max and sum, a
    narrow dtype's fp32 queries and output, and a block's scratch as in
    :func:`spdsl.kernels.masked_attn.workspace_bytes` plus the running output of the block's
    previous key block and its update (four ``[rows, Dv]`` fp32 at once). Backward, at the
    block phase of its fullest step: the pieces and their fp32 copies as forward, the step's
    fp32 dk/dv at the query heads, gradient accumulators (fp32, kv heads, packed: the
    owner's share from step 1; from step 2 also the one in flight to the next rank and the
    one arriving), a narrow dtype's fp32 q, dout, output and dq, and the block's scratch
    (``delta`` included); or, when larger (few heads, long pieces), the moment a step packs
    its dk/dv (two more accumulators, no block).

    Without a mask program on the CPU, pieces run on the fused flash kernel instead of blocks:
    per pair (``layout``: zigzag pairs are half a piece) forward its output and log-sum-exp
    and then either its own tiles (``spdsl.kernels.cpu_flash``) or the merge's three
    ``[rows, Dv]`` fp32 temporaries and the masks of finite rows; backward its tiles, its
    dq, dk, dv, the rows' log-sum-exp and ``delta``.

    Example::

        q = torch.empty(1, 4, 65536, 128, dtype=torch.bfloat16, device="meta")
        k = torch.empty(1, 1, 65536, 128, dtype=torch.bfloat16, device="meta")
        workspace_bytes(q, k, k, causal=True, backward=True, parts=8)
    """
    from spdsl.kernels.masked_attn import workspace_bytes as block_bytes
    b, h, s_q, d = q.shape
    hk, s_k, dv = k.shape[1], k.shape[2], v.shape[3]
    f32 = torch.promote_types(q.dtype, torch.float32)
    w = torch.empty((), dtype=f32).element_size()
    narrow = q.dtype != f32
    piece = b * hk * s_k * (d + dv) * k.element_size()         # one packed k/v piece
    pieces = piece * (2 if parts is None or parts > 1 else 1)  # attended, arriving
    up = b * h * s_k * (d + dv) * w if (hk != h or narrow) else 0          # kf, vf
    with torch.device("meta"):         # the block's own scratch: fp32, heads as the queries
        qm = torch.empty((b, h, s_q, d), dtype=f32)
        km, vm = torch.empty((b, h, s_k, d), dtype=f32), torch.empty((b, h, s_k, dv), dtype=f32)
        block = block_bytes(qm, km, vm, list(leaves), program, causal, backward)
    rows, _ = block_sizes(b, h, s_q, s_k)
    qf = b * h * s_q * d * w if narrow else 0
    of = b * h * s_q * dv * w if narrow else 0
    if not program and q.device.type in ("cpu", "meta") and FUSED[0]:
        from spdsl.kernels.cpu_flash import flash_cpu_backward, flash_cpu_forward
        nq, nk = (s_q // 2, s_k // 2) if layout == "zigzag" else (s_q, s_k)
        with torch.device("meta"):
            qp = torch.empty((b, h, nq, d), dtype=f32)
            kp = torch.empty((b, h, nk, d), dtype=f32)
        if backward:
            block = flash_cpu_backward((qp, qp, kp), {}) + b * h * (nq * d + nk * (d + dv)) * w \
                + 2 * b * h * s_q * w                                    # lse, delta
        else:
            # the kernel's tiles while it runs, then the merge's temporaries: never both
            block = b * h * nq * (dv + 1) * w + max(flash_cpu_forward((qp, kp), {}),
                                                    b * h * nq * ((3 * dv + 2) * w + 2))
            rows = 0
    if not backward:
        running = 2 * b * h * rows * dv * w      # beyond the block count's two [rows, Dv]
        return pieces + up + block + running + 2 * b * h * s_q * w + qf + of
    acc = b * hk * s_k * (d + dv) * w            # one packed fp32 gradient accumulator
    # (pieces, accumulators) held at a step's blocks and when it packs its dk/dv (then also
    # dk/dv summed to the kv heads and the packed copy: two more); step 0 holds none, step 1
    # the owner's share, later steps also the one in flight and the one arriving
    if parts is None or parts >= 4:
        blocks_at, packing = pieces + 3 * acc, pieces + 5 * acc
    elif parts == 3:                             # step 1: two pieces; step 2: the last one
        blocks_at = max(pieces + acc, piece + 3 * acc)
        packing = max(pieces + 3 * acc, piece + 5 * acc)
    elif parts == 2:
        blocks_at, packing = max(pieces, piece + acc), piece + 3 * acc
    else:
        blocks_at, packing = piece, piece + 2 * acc
    dkv = b * h * s_k * (d + dv) * w             # the step's dk, dv at the query heads
    return max(blocks_at + up + dkv + block, packing) + 2 * qf + 2 * of  # q, dq; dout, out
