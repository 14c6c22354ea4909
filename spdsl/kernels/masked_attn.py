"""Attention with its mask given as a function of per-token values, never as an ``[S, S]``
tensor: ``torch.ops.spdsl.masked_attn`` (+ ``masked_attn_backward``) and ``masked_attn``.

The mask is ``fn(*leaves)``: ``leaves`` are 4-D tensors that broadcast to the scores
``[B, H, S_q, S_k]`` and are full-sized on at most one of the two sequence dims (a query
position ``[1, 1, S, 1]``, a padding flag ``[B, 1, 1, S]``, a per-head slope ``[1, H, 1, 1]``);
``fn`` is a pointwise program over them returning a boolean keep-mask or an additive float
bias (Hugging Face's ``finfo.min`` masks, ALiBi). Masks such a program expresses: causal,
padding, packed documents, sliding windows, position biases, and any pointwise combination.

How it runs on CPU for a causal triangle times a boolean function of key-side values
(Hugging Face's padded SDPA masks, a causal flag alone): ATen's fused flash attention, the
key-side part as one broadcast ``[B, 1, 1, S_k]`` row (``spdsl.kernels.masked_attn_keys``).
Every other mask (and every mask where ``SPDSL_MASK_FUSED=0``), CPU and GPU alike in plain
PyTorch: flash attention's recurrence in blocks of queries and keys. For each block the mask program runs on the block's slice of the leaves
(``[.., rows, cols]``); a block that keeps nothing is skipped (causal: every key after the
query block; a window or a document: all but its extent), the others update a running max,
sum and output per row. The backward recomputes each block's probabilities from the saved
per-row max and sum. ``BLOCK_ELEMENTS`` bounds a block (``B * H * rows * cols``), so the
working memory is a few blocks (1 MiB of fp32 scores each) beside q, k, v and the output:
linear in the sequence, never ``S_q x S_k``.

Exactness: fp32 scores and sums: equal to SDPA and to the written-out
``softmax(q k^T * scale + mask) v`` within fp32 rounding. Skipped blocks and entries at or
below ``finfo.min`` contribute ``exp(-huge) = 0`` exactly whenever the row keeps any key. A
row that keeps no key (left padding's first rows) gets what the dense computation gives:
zeros for a boolean mask (SDPA's convention); for an additive one the softmax of the whole
row, every entry ``finfo.min``: a uniform average over every key, as Hugging Face's eager
attention computes it (no block of its query block is skipped then; the last padding row's
output predicts the first real label, so this matters).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable

import torch

BLOCK_ELEMENTS = 1 << 18        # scores per block (B * H * rows * cols): 1 MiB in fp32
KEY_BLOCK = 512                 # key columns per block
_PROGRAMS: dict[str, Callable] = {}
_IDS = itertools.count()


def register_mask_program(fn: Callable | None, name: str = "mask",
                          leaf_dtypes: tuple | None = None,
                          softcap: float | None = None) -> str:
    """Store ``fn(*leaves) -> keep (bool) or bias (float)``; returns the key the op takes.
    ``leaf_dtypes``: what the program was written for; the kernel casts its leaves to them
    (an Inductor-compiled program has been seen to hand a boolean value over as int64, on
    which ``&`` would compute as integers). A program with source code (an FX graph's
    ``code``) is keyed by it: the same mask traced twice gets the same key (equal graphs, one
    compiled program). ``softcap``: scores capped as ``c * tanh(s / c)`` before the mask
    (Gemma 2's attention logits); ``fn`` may then be None (no mask)."""
    code = getattr(fn, "code", None)
    if isinstance(code, str):
        digest = hashlib.sha1((code + repr(leaf_dtypes) + repr(softcap)).encode()).hexdigest()
        key = f"{name}@{digest[:16]}"
    else:
        key = f"{name}#{next(_IDS)}"
    _PROGRAMS[key] = (fn, leaf_dtypes, softcap)
    return key


def mask_program(key: str) -> Callable | None:
    return _PROGRAMS[key][0]


def softcap_of(key: str) -> float | None:
    """The cap ``c`` of scores ``c * tanh(s / c)`` the program ``key`` was registered with."""
    return _PROGRAMS[key][2] if key else None


def typed_leaves(key: str, leaves: list) -> list:
    """``leaves`` cast to the dtypes the program ``key`` was registered with."""
    dtypes = _PROGRAMS[key][1] if key else None
    if dtypes is None:
        return list(leaves)
    return [t if dt is None or t.dtype == dt else t.to(dt) for t, dt in zip(leaves, dtypes)]


def block_sizes(b: int, h: int, s_q: int, s_k: int) -> tuple[int, int]:
    """(query rows, key columns) of a block: ``B * H * rows * cols <= BLOCK_ELEMENTS``."""
    cols = min(s_k, KEY_BLOCK)
    rows = max(16, min(1024, BLOCK_ELEMENTS // max(1, b * h * cols)))
    return min(rows, s_q), cols


def workspace_bytes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list = (),
                    program: str = "", causal: bool = False, backward: bool = False) -> int:
    """The op's peak scratch beyond its inputs and outputs, for the memory planner (checked
    against the allocator in tests/kernels/test_masked_attn.py), on the route it takes: the
    fused CPU kernel's (``masked_attn_keys_workspace.workspace_bytes``, decided by the program
    and the shapes) or the block kernel's (:func:`block_workspace_bytes`); where the values decide
    between the two, the larger: a window whose width is a value (narrow ones stay on the
    blocks), an fp16 additive mask (its rows that keep no key run fused only while no score
    moves fp16's min)."""
    from spdsl.kernels import masked_attn_keys as keys
    from spdsl.kernels.masked_attn_keys_workspace import workspace_bytes as fused_bytes
    fused = keys.split(q, k, v, leaves, program, causal, values=False)
    blocks = block_workspace_bytes(q, k, v, leaves, program, causal, backward)
    if fused is None:
        return blocks
    if (fused.additive and q.dtype == torch.float16) or fused.window == 0:
        return max(blocks, fused_bytes(q, k, v, fused, backward))
    return fused_bytes(q, k, v, fused, backward)


def block_workspace_bytes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list = (),
                          program: str = "", causal: bool = False,
                          backward: bool = False) -> int:
    """The block kernel's scratch, whatever route the op would take (ring attention runs its
    pieces' blocks with it): fp32 score blocks (one forward, two backward: the probabilities
    and their gradient, both made in place), the block's mask (a boolean and its negation; an
    additive program's fp32 bias and its comparisons), per-row running values, k and v
    repeated to the query heads (GQA), fp32 copies of narrow inputs, and in backward the row
    sums and fp32 gradient accumulators."""
    b, h, s_q, d = q.shape
    s_k, dv = k.shape[2], v.shape[3]
    f32 = torch.promote_types(q.dtype, torch.float32)
    w = torch.empty((), dtype=f32).element_size()
    rows, cols = block_sizes(b, h, s_q, s_k)
    mb, mh = (max([t.shape[i] for t in leaves] + [1]) for i in (0, 1))
    mask = mb * mh * rows * cols                    # elements of one block's mask
    # forward's peak is in the masking: keep and ~keep (a float program: its bias, its
    # comparisons); backward's in the gradient, the mask still held by the block generator
    cap = softcap_of(program)
    program = program if program and mask_program(program) is not None else ""   # a cap alone
    boolean = not program or _program_dtype(program, leaves) == torch.bool
    if program:
        mask *= (1 if backward else 2) if boolean else (4 if backward else 6)
    elif causal:
        mask = (1 if backward else 2) * rows * cols
    else:
        mask = 0
    blocks = 2 if backward else 1
    if cap is not None and backward:
        blocks += 1                 # the capped scores' tanh, kept for 1 - t^2
    out = blocks * b * h * rows * cols * w + mask
    gqa = k.shape[1] != h
    narrow = q.dtype != f32
    kv = b * h * s_k * (d + dv) * w
    if gqa or narrow:
        out += kv                                   # kf, vf
    if narrow:
        out += b * h * s_q * d * w                  # qf
    if not backward:
        out += b * h * rows * (2 * dv + 4) * w      # acc, its update, the row max and sum
        return out + (b * h * s_q * dv * w if narrow else 0)       # the fp32 output
    out += b * h * s_q * w                          # delta
    out += b * h * (rows + cols) * d * w            # the matmuls' results before +=
    if narrow:
        out += 2 * b * h * s_q * dv * w + b * h * s_q * d * w      # do, out, dq in fp32
    if gqa or narrow:
        out += kv                                   # dk, dv at the query heads / in fp32
    return out


def _program_dtype(key: str, leaves: list) -> torch.dtype:
    """What the program returns, from one element of each leaf on the meta device."""
    with torch.device("meta"):
        cut = [torch.empty((1, 1, 1, 1), dtype=t.dtype) for t in typed_leaves(key, leaves)]
        return mask_program(key)(*cut).dtype


def _cut(leaves, i0: int, i1: int, j0: int, j1: int) -> list:
    out = []
    for t in leaves:
        if t.shape[2] > 1:
            t = t.narrow(2, i0, i1 - i0)
        if t.shape[3] > 1:
            t = t.narrow(3, j0, j1 - j0)
        out.append(t)
    return out


class _Blocks:
    """The mask of one query block, a key block at a time: keep (bool) or bias (float), and
    which key blocks can be skipped (nothing kept; an additive mask's block is never skipped
    for a block holding a row that keeps no key, whose softmax spans every key).
    ``q_off``/``k_off``: the global positions of the first query and key (a ring step
    attends a rank's queries to another rank's keys); leaves are global."""

    def __init__(self, program, leaves, causal: bool, s_k: int, cols: int, device,
                 q_off: int = 0, k_off: int = 0) -> None:
        self.program, self.leaves, self.causal = program, leaves, causal
        self.s_k, self.cols, self.device = s_k, cols, device
        self.q_off, self.k_off = q_off, k_off

    def mask(self, i0: int, i1: int, j0: int, j1: int):
        keep = bias = None
        qo, ko = self.q_off, self.k_off
        if self.program is not None:
            m = self.program(*_cut(self.leaves, i0 + qo, i1 + qo, j0 + ko, j1 + ko))
            if m.dtype == torch.bool:
                keep = m
            else:
                bias = m
        if self.causal:
            tri = torch.arange(i0 + qo, i1 + qo, device=self.device)[:, None] >= \
                torch.arange(j0 + ko, j1 + ko, device=self.device)
            keep = tri if keep is None else keep & tri
        return keep, bias

    def spans(self, i0: int, i1: int):
        """``(j0, j1, keep, bias)`` of every key block to compute for queries ``i0:i1``, a
        block at a time (masks are evaluated as they are used, never all at once)."""
        last = i1 - 1 + self.q_off - self.k_off          # the last key a causal row sees
        blocks = [(j0, min(self.s_k, j0 + self.cols)) for j0 in range(0, self.s_k, self.cols)
                  if not (self.causal and j0 > last)]   # causal: no key after the block
        needed = self._additive_blocks(i0, i1, blocks)
        for n, (j0, j1) in enumerate(blocks):
            if needed is not None and not needed[n]:
                continue
            keep, bias = self.mask(i0, i1, j0, j1)
            if needed is None and keep is not None and not bool(keep.any()):
                continue
            yield j0, j1, keep, bias

    def _additive_blocks(self, i0: int, i1: int, blocks: list) -> list[bool] | None:
        """For an additive mask (a float program, not causal): which key blocks hold any
        entry above ``finfo.min``, or all of them when some row of the block keeps none."""
        if self.program is None or self.causal:
            return None
        kept_any, dead = [], None
        for j0, j1 in blocks:
            _, bias = self.mask(i0, i1, j0, j1)
            if bias is None:
                return None                          # a boolean mask: skipped as it goes
            kept = bias > torch.finfo(bias.dtype).min
            kept_any.append(bool(kept.any()))
            alive = kept.any(-1)
            dead = ~alive if dead is None else dead & ~alive
        if dead is not None and bool(dead.any()):
            return [True] * len(blocks)
        return kept_any


def _scores(q_blk, k_blk, keep, bias, scale, softcap=None, capped=None):
    """One block of scores, masked; in place after the matmul: one block of fp32 live.
    ``softcap``: ``c * tanh(s / c)`` before the mask; ``capped`` (a list) gets the tanh,
    whose ``1 - t^2`` the backward needs."""
    s = torch.matmul(q_blk, k_blk.transpose(-2, -1)).mul_(scale)
    if softcap is not None:
        t = s.div_(softcap).tanh_()
        if capped is not None:
            capped.append(t)
            s = t * softcap
        else:
            s = t.mul_(softcap)
    if bias is not None:
        s.add_(bias)
    if keep is not None:
        s.masked_fill_(keep.logical_not(), float("-inf"))
    return s


def _up(*ts: torch.Tensor) -> list[torch.Tensor]:
    """fp32 (or wider) copies: scores and sums accumulate in fp32, as SDPA's do."""
    dt = torch.promote_types(ts[0].dtype, torch.float32)
    return [t.to(dt) for t in ts]


def _grouped(k: torch.Tensor, h: int) -> torch.Tensor:
    return k if k.shape[1] == h else k.repeat_interleave(h // k.shape[1], dim=1)


def _finite(m: torch.Tensor) -> torch.Tensor:
    # a row with nothing kept so far has max -inf: subtract 0 instead (exp(-inf) = 0, no NaN)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def attend_rows(q_blk, kf, vf, spans, scale, m, den, acc, softcap=None):
    """One block of query rows against the key blocks ``spans`` yields: the flash
    recurrence's running row max ``m``, sum ``den`` and unnormalised output ``acc``
    (``[B, H, rows, 1 | Dv]``, fp32) updated; returns them. Keys are the next-to-last dim:
    ``[B, H_kv, 1, S_k, D]`` against queries ``[B, H_kv, G, rows, D]`` broadcasts over the
    group (grouped query heads without repeating k and v). k and v may be narrower than the
    queries: each key block is cast as it is used (a block of the cast, ``rows`` times less
    than the block's matmul). ``m`` None: a fresh row block (made here: an argument would be
    held by the caller through the whole call)."""
    if m is None:
        rows = q_blk.shape[:-1] + (1,)
        m, den = q_blk.new_full(rows, float("-inf")), q_blk.new_zeros(rows)
        acc = q_blk.new_zeros(q_blk.shape[:-1] + (vf.shape[-1],))
    for j0, j1, keep, bias in spans:
        s = _scores(q_blk, kf[..., j0:j1, :].to(q_blk.dtype), keep, bias, scale, softcap)
        del keep, bias
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        alpha = torch.where(torch.isfinite(m), torch.exp(m - _finite(m_new)),
                            torch.zeros_like(m))        # nothing kept before: nothing to scale
        p = s.sub_(_finite(m_new)).exp_()               # the probabilities, in place
        den = den * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, vf[..., j0:j1, :].to(p.dtype))
        m = m_new
        del s, p
    return m, den, acc


def grad_rows(q_blk, do_blk, d_blk, m, den, kf, vf, spans, scale, dq_blk, dk, dv,
              softcap=None) -> None:
    """The gradients of one block of query rows against the key blocks ``spans`` yields,
    from the rows' final max ``m`` and sum ``den`` and ``d_blk = sum(dout * out)``:
    added into ``dq_blk``, ``dk``, ``dv`` (fp32; keys the next-to-last dim; grouped query
    heads as in :func:`attend_rows`, dk and dv summed over the group)."""
    inv = torch.where(den > 0, 1.0 / den, torch.zeros_like(den))
    for j0, j1, keep, bias in spans:
        k_blk, v_blk = kf[..., j0:j1, :].to(q_blk.dtype), vf[..., j0:j1, :].to(q_blk.dtype)
        capped = [] if softcap is not None else None
        s = _scores(q_blk, k_blk, keep, bias, scale, softcap, capped)
        del keep, bias
        p = s.sub_(_finite(m)).exp_().mul_(inv)        # in place: two fp32 blocks live
        _add(dv[..., j0:j1, :], torch.matmul(p.transpose(-2, -1), do_blk))
        ds = torch.matmul(do_blk, v_blk.transpose(-2, -1))
        ds.sub_(d_blk).mul_(p)
        if capped:                                     # through c * tanh(s / c): 1 - t^2
            t = capped.pop()
            ds.mul_(t.mul_(t).neg_().add_(1))
            del t
        ds.mul_(scale)
        dq_blk += torch.matmul(ds, k_blk)
        _add(dk[..., j0:j1, :], torch.matmul(ds.transpose(-2, -1), q_blk))
        del s, p, ds


def _add(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst += src``, summed over a query-head group ``dst`` holds once."""
    if src.dim() == 5 and dst.shape[2] != src.shape[2]:
        src = src.sum(2, keepdim=True)
    dst += src


def _forward(q, k, v, leaves, program_key, causal, scale):
    """Online softmax over key blocks (the flash recurrence); returns the output and the
    row statistics ``[B, H, S_q, 2]``: max and sum of ``exp(s - max)``, kept apart (a row of
    ``finfo.min`` entries would absorb ``log(sum)`` into a log-sum-exp)."""
    from spdsl.kernels import masked_attn_keys as keys
    from spdsl.kernels import masked_attn_keys_cpu as fused_cpu
    fused = keys.split(q, k, v, leaves, program_key, causal, scale=scale)
    if fused is not None:        # causal x a key-side row: ATen's fused kernel takes it whole
        return fused_cpu.forward(q, k, v, fused, scale)
    program = mask_program(program_key) if program_key else None
    cap = softcap_of(program_key)
    leaves = typed_leaves(program_key, leaves)
    b, h, s_q, _ = q.shape
    s_k = k.shape[2]
    qf, kf, vf = _up(q, _grouped(k, h), _grouped(v, h))
    out = qf.new_zeros(b, h, s_q, v.shape[-1])
    stats = qf.new_zeros(b, h, s_q, 2)
    stats[..., 0] = float("-inf")
    rows, cols = block_sizes(b, h, s_q, s_k)
    blocks = _Blocks(program, leaves, causal, s_k, cols, q.device)
    for i0 in range(0, s_q, rows):
        i1 = min(s_q, i0 + rows)
        m, den, acc = attend_rows(qf[:, :, i0:i1], kf, vf, blocks.spans(i0, i1), scale,
                                  None, None, None, cap)
        out[:, :, i0:i1] = acc / torch.where(den > 0, den, torch.ones_like(den))
        stats[:, :, i0:i1, 0:1], stats[:, :, i0:i1, 1:2] = m, den
        del m, den, acc                 # not held through the next row block's call
    return out.to(q.dtype), stats


def _backward(dout, q, k, v, out, stats, leaves, program_key, causal, scale):
    from spdsl.kernels import masked_attn_keys as keys
    from spdsl.kernels import masked_attn_keys_cpu as fused_cpu
    fused = keys.split(q, k, v, leaves, program_key, causal, scale=scale)
    if fused is not None:
        return fused_cpu.backward(dout, q, k, v, out, stats, fused, scale)
    program = mask_program(program_key) if program_key else None
    cap = softcap_of(program_key)
    leaves = typed_leaves(program_key, leaves)
    b, h, s_q, _ = q.shape
    hk, s_k = k.shape[1], k.shape[2]
    qf, kf, vf = _up(q, _grouped(k, h), _grouped(v, h))
    do, of = _up(dout, out)
    delta = (do * of).sum(-1, keepdim=True)              # [B, H, S_q, 1]
    dq = torch.zeros_like(qf)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
    rows, cols = block_sizes(b, h, s_q, s_k)
    blocks = _Blocks(program, leaves, causal, s_k, cols, q.device)
    for i0 in range(0, s_q, rows):
        i1 = min(s_q, i0 + rows)
        grad_rows(qf[:, :, i0:i1], do[:, :, i0:i1], delta[:, :, i0:i1],
                  stats[:, :, i0:i1, 0:1], stats[:, :, i0:i1, 1:2], kf, vf,
                  blocks.spans(i0, i1), scale, dq[:, :, i0:i1], dk, dv, cap)
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
            q.new_empty((b, h, s_q, 2), dtype=torch.promote_types(q.dtype, torch.float32)))


@torch.library.custom_op("spdsl::masked_attn_backward", mutates_args=())
def _masked_attn_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, out: torch.Tensor, stats: torch.Tensor,
                             leaves: list[torch.Tensor], program: str, causal: bool,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dout, q, k, v, out, stats, leaves, program, causal, scale)


@_masked_attn_backward_op.register_fake
def _(dout, q, k, v, out, stats, leaves, program, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, leaves, program, causal, scale = inputs
    out, stats = output
    ctx.save_for_backward(q, k, v, out, stats, *leaves)
    ctx.program, ctx.causal, ctx.scale = program, causal, scale


def _backward_rule(ctx, dout, dstats):
    q, k, v, out, stats, *leaves = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _masked_attn_backward_op(dout, q, k, v, out, stats, leaves, ctx.program,
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
    # on CUDA: FlexAttention (spdsl.kernels.masked_attn_flex); backend.masked_attn_backend
    from spdsl.kernels.masked_attn_flex import masked_attn_auto
    return masked_attn_auto(q, k, v, list(leaves), key or "", bool(causal), scale)
