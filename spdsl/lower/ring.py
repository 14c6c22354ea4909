"""Per-rank ring and hybrid (Ulysses x ring) attention: the lowerings of an attention node
whose choice (``spdsl.propagate.attention_choice``) is ``ring`` or ``hybrid``.

The axis' ``P`` ranks are ``R`` groups of ``U`` consecutive ranks (``P = U x R``; ring: ``U =
1``). Rank ``r`` is member ``r % U`` of Ulysses group ``r // U`` and member ``r // U`` of ring
``r % U``. Hybrid first exchanges q, k, v inside its Ulysses group (the group's ``U`` pieces of
the sequence are consecutive: after the exchange each member holds ``H / U`` heads over the
group's contiguous stretch of ``S / R`` positions), then runs the ring over the ``R`` groups
(the op ``spdsl::ring_attn`` of ``spdsl.collectives.ring``, the steps of
``spdsl.kernels.ring_attn``), then exchanges the output back.

Masks: a mask program's leaves (``spdsl.propagate.masks``) and a dense mask given to SDPA are
replicated, global: the ring kernel cuts them at each step's global rows and columns (a dense
mask is the program that returns its one leaf); per-head ones are cut to the rank's heads
after the Ulysses exchange.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spdsl.collectives import all_to_all, all_to_all_rows, new_group
from spdsl.collectives.ring import ring_attn_program
from spdsl.kernels.masked_attn import register_mask_program
from spdsl.lower.ops import _HEADS, _SEQ, _to_heads


def _dense(mask: torch.Tensor) -> torch.Tensor:
    return mask


_DENSE = register_mask_program(_dense, "dense")


def ring_attention_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list,
                      program: str, is_causal: bool, scale: float | None, ulysses: int,
                      groups: tuple, compute_dtype: torch.dtype | None = None,
                      out_dtype: torch.dtype | None = None,
                      layout: str = "contiguous") -> torch.Tensor:
    """Local ``[B, H, S/P, D]`` q, k, v -> attention over the whole sequence, local
    ``[B, H, S/P, D]`` output. ``groups``: ``(ulysses group, rank in it, ring group, rank in
    it, ring size)`` (process group names)."""
    ugroup, urank, rgroup, rrank, ring = groups
    hq = q.shape[1]
    if ulysses > 1:
        q, k, v = _to_heads(q, k, v, ulysses, ugroup)
        n = hq // ulysses
        leaves = [t.narrow(1, urank * n, n) if t.shape[1] == hq and hq > 1 else t
                  for t in leaves]
    if layout != "contiguous":        # the ring's pieces as the layout has them
        q, k, v = relayout([q, k, v], "contiguous", layout, ring, rrank, rgroup)
    if compute_dtype is not None:
        q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o = ring_attn_program(q, k, v, list(leaves), program, bool(is_causal), scale, layout,
                          ring, rrank, rgroup)
    if out_dtype is not None:
        o = o.to(out_dtype)
    if layout != "contiguous":
        (o,) = relayout([o], layout, "contiguous", ring, rrank, rgroup)
    return all_to_all(o, _HEADS, _SEQ, ulysses, ugroup) if ulysses > 1 else o


def _chunks(layout: str, parts: int, rank: int) -> list[int]:
    """The chunks (of ``2P``) rank ``rank`` holds, in local order."""
    return [rank, 2 * parts - 1 - rank] if layout == "zigzag" else [2 * rank, 2 * rank + 1]


def _owner(layout: str, parts: int, c: int) -> int:
    if layout == "zigzag":
        return c if c < parts else 2 * parts - 1 - c
    return c // 2


def relayout(xs: list[torch.Tensor], src: str, dst: str, parts: int, rank: int,
             group: str) -> list[torch.Tensor]:
    """``[B, H, n, D]`` pieces of the sequence (dim 2) held as layout ``src`` -> as ``dst``
    (``spdsl.kernels.ring_attn.segments``): one all-to-all of rows, each rank sending its
    two half-pieces to their owners under ``dst``; several tensors go together."""
    n = xs[0].shape[2]
    h = n // 2
    widths = [x[:, :, :1].numel() for x in xs]
    rows = torch.cat([x.movedim(2, 0).reshape(n, -1) for x in xs], dim=1)     # [n, E]
    mine, want = _chunks(src, parts, rank), _chunks(dst, parts, rank)
    piece = dict(zip(mine, rows.split(h)))
    sent = sorted(mine, key=lambda c: (_owner(dst, parts, c), c))
    ins = [h * sum(_owner(dst, parts, c) == d for c in mine) for d in range(parts)]
    outs = [h * sum(_owner(src, parts, c) == s for c in want) for s in range(parts)]
    got = all_to_all_rows(torch.cat([piece[c] for c in sent]), outs, ins, group)
    came = sorted(want, key=lambda c: (_owner(src, parts, c), c))
    by = dict(zip(came, got.split(h)))
    rows = torch.cat([by[c] for c in want])
    out = []
    for x, part in zip(xs, rows.split(widths, dim=1)):
        shape = [n] + [x.shape[0], x.shape[1], x.shape[3]]
        out.append(part.reshape(shape).permute(1, 2, 0, 3))
    return out


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None, is_causal: bool, scale: float | None,
                   ulysses: int, groups: tuple, compute_dtype: torch.dtype | None = None,
                   out_dtype: torch.dtype | None = None,
                   layout: str = "contiguous") -> torch.Tensor:
    """``ring_attention_fn`` for SDPA's arguments: a dense mask (replicated, global) is the
    one leaf of the program that returns it. Every ring step runs the ring kernel, whatever
    a Ulysses rank would have run for the node's form (written-out ops, the flash kernel)."""
    leaves, program = [], ""
    if mask is not None:
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
        leaves, program = [mask], _DENSE
    return ring_attention_fn(q, k, v, leaves, program, is_causal, scale, ulysses, groups,
                             compute_dtype, out_dtype, layout)


def factor_ranks(ranks: torch.Tensor, u: int) -> tuple:
    """Rows of ``ranks`` (``[groups, P]``, global ranks: the sequence axis' groups) as Ulysses
    groups of ``u`` consecutive members and rings across them: this rank's (Ulysses group
    name, rank in it, ring group name, rank in it, ring size). Creating a group takes every
    rank of the job, so every rank creates all of them, in the same order."""
    parts = ranks.shape[-1]
    me = dist.get_rank()
    found = [None, None]
    for row in ranks.reshape(-1, parts // u, u):           # [ring, U]
        for kind, members in [(0, g) for g in row] + [(1, g) for g in row.t()]:
            members = members.tolist()
            pg = new_group(members)
            if me in members:
                found[kind] = (pg.group_name, members.index(me))
    (ug, ur), (rg, rr) = found
    return ug, ur, rg, rr, parts // u


def ring_axes(gm: torch.fx.GraphModule, axis: str) -> dict[str, str]:
    """Process group name -> what the plan calls it, for the groups of the ring and hybrid
    calls of ``gm``: ``sp/ulysses`` (a Ulysses group), ``sp/ring`` (a ring of a hybrid)."""
    out = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (ring_attention, ring_attention_fn):
            u = n.args[7 if n.target is ring_attention_fn else 6]
            ugroup, _, rgroup, _, _ = n.args[8 if n.target is ring_attention_fn else 7]
            if u > 1:
                out[ugroup], out[rgroup] = f"{axis}/ulysses", f"{axis}/ring"
    return out


def _describe(node, grad, mask_index: int | None) -> list:
    """The plan's entries for one ring/hybrid call (``spdsl.lower.calls``): the Ulysses
    exchanges inside the group (hybrid), and ``R - 1`` ring steps, each sending the k/v
    piece on (forward and backward) and, in backward, the fp32 dk/dv accumulator of a piece
    one rank behind it."""
    from spdsl.lower.calls import Call, nbytes
    from spdsl.propagate.heads import kv_repeat
    q, k, v = node.args[:3]
    u = node.args[7 if mask_index is None else 6]
    ugroup, _, rgroup, _, r = node.args[8 if mask_index is None else 7]
    back = any(grad(x) for x in (q, k, v))
    kq, kk = q.meta["val"], k.meta["val"]
    rep = kv_repeat(kq.shape[1], kk.shape[1], u) if u > 1 else 1
    calls = []
    if u > 1:
        qkv = nbytes(q) + (nbytes(k) + nbytes(v)) * rep
        calls.append(Call("all_to_all", ugroup, qkv, qkv if back else 0, "ulysses", (q, k, v)))
    cast = node.kwargs.get("compute_dtype")
    item = cast.itemsize if cast is not None else kk.element_size()
    elems = (kk.numel() + v.meta["val"].numel()) * rep
    piece, grads = elems * item, elems * max(4, item)
    relaid = node.kwargs.get("layout", "contiguous") != "contiguous"
    if relaid:       # q, k, v to the layout's pieces (exchanged to heads first in a hybrid)
        qkv = nbytes(q) + (nbytes(k) + nbytes(v)) * rep
        calls.append(Call("all_to_all", rgroup, qkv, qkv if back else 0, "zigzag", (q, k, v)))
    calls += [Call("send_recv", rgroup, piece, piece + grads if back else 0, "ring", (k, v))
              for _ in range(r - 1)]
    if relaid:
        o = nbytes(node)       # the output at the ring's heads and pieces: the same size
        calls.append(Call("all_to_all", rgroup, o, o if back else 0, "zigzag", (node,)))
    if u > 1:
        o = nbytes(node)
        calls.append(Call("all_to_all", ugroup, o, o if back else 0, "ulysses", (node,)))
    return calls


def _register_plan_entries() -> None:
    from spdsl.lower.calls import register
    register(ring_attention_fn)(lambda node, grad: _describe(node, grad, None))
    register(ring_attention)(lambda node, grad: _describe(node, grad, 3))


_register_plan_entries()
