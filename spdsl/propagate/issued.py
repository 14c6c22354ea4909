"""Collectives a named lowering issues itself, recorded beside the redistributions (``Move``s)
in each ``Decision``: Ulysses' two all-to-alls, the global-mean loss's one all-reduce, the halo
exchange of a slice of the split sequence. Propagation writes them once; the plan reads them,
and the lowering runs the same sizes (its kv repeat from ``heads.kv_repeat``, its halo from
``slice_window``).

Example (the GQA block of ``docs/engine.md``, bf16, 2 x 1024 tokens over 2 ranks)::

    d = prop.decisions[attention_node]
    [(c.kind, c.bytes, c.purpose) for c in d.issued]
    # [('all_to_all', 262144, 'ulysses'), ('all_to_all', 131072, 'ulysses')]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spdsl.propagate.heads import kv_repeat
from spdsl.propagate.lowerings import Lowering as L
from spdsl.propagate.placement import Partial, halo_rows, typed_shape


@dataclass(frozen=True)
class Issued:
    """One collective per rank per step: ``bytes`` forward, ``bytes_bwd`` backward where the
    node's value needs a gradient; ``values``: what it carries, as typed shapes."""

    kind: str
    bytes: int
    bytes_bwd: int
    purpose: str
    values: tuple[str, ...]

    def collectives(self, grad: bool) -> list[tuple[str, int, int]]:
        """``(kind, bytes forward, bytes backward)``, as ``Move.collectives``."""
        return [(self.kind, self.bytes, self.bytes_bwd if grad else 0)]


def slice_window(node: torch.fx.Node) -> tuple[int, int, int]:
    """(dim, start, rows kept) of ``aten.slice`` on a split dim, ``start`` made non-negative
    and clamped as ``x[start:]`` does."""
    src = node.args[0].meta["val"]
    dim = node.args[1] % src.dim() if len(node.args) > 1 else 0
    start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
    size = src.shape[dim]
    start = max(0, start + size) if start < 0 else min(start, size)
    return dim, start, node.meta["val"].shape[dim]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def issued(prop, node: torch.fx.Node, lowering: str | None,
           ins: list[torch.fx.Node]) -> tuple[Issued, ...]:
    """What ``lowering`` of ``node`` issues over ``prop``'s axis (``prop``: the propagator,
    with ``node`` and its inputs decided)."""
    P = prop.parts
    if P == 1:
        return ()
    if lowering in (L.ULYSSES, L.ULYSSES_FLEX):
        q, k, v = (ins[j].meta["val"] for j in range(3))
        rep = kv_repeat(q.shape[1], k.shape[1], P)
        qkv = (_nbytes(q) + (_nbytes(k) + _nbytes(v)) * rep) // P
        kv_note = f" repeated x{rep}" if rep > 1 else ""     # kv heads fewer than P
        out = node.meta["val"]
        out = out[0] if isinstance(out, (tuple, list)) else out    # flex: (out, lse, max)
        o = _nbytes(out) // P
        return (Issued("all_to_all", qkv, qkv, "ulysses",
                       (prop.typed(ins[0]),) + tuple(prop.typed(ins[j]) + kv_note
                                                     for j in (1, 2))),
                Issued("all_to_all", o, o, "ulysses", (prop.typed(node, 0),)))
    if lowering in (L.RING, L.HYBRID):
        return _ring(prop, node, ins)
    if lowering == L.NLL_MEAN:
        x = ins[0].meta["val"]
        return (Issued("all_reduce", 2 * x.element_size(), 0, "loss",
                       (typed_shape((2,), x.dtype, Partial(), prop.axis),)),)
    if lowering == L.SLICE_WINDOW:
        a = ins[0].meta["val"]
        dim, start, n = slice_window(node)
        sent = halo_rows(a.shape[dim], start, n, P) * (_nbytes(a) // max(1, a.shape[dim]))
        return (Issued("halo_exchange", sent, sent, "halo", (prop.typed(ins[0]),)),) \
            if sent else ()
    if lowering == L.MIXER_STATE:
        return _mixer_state(prop, node, ins)
    return ()


def _mixer_state(prop, node: torch.fx.Node, ins: list[torch.fx.Node]) -> tuple[Issued, ...]:
    """State passing of a sequence mixer (``spdsl.lower.mixers``): each rank's state to every
    rank (an all-gather; its gradient summed back by a reduce-scatter), or a short conv's
    ``kernel - 1`` tokens to the next rank (a halo)."""
    from spdsl.propagate.mixer_form import SITES
    site = SITES[node.args[1]]
    form, P = site.form, prop.parts
    state = form.state_bytes(site.bound([i.meta["val"] for i in ins]), P)
    what = (f"{form.name} state", )
    if form.exchange == "halo":
        return (Issued("halo_exchange", state, state, "halo", (prop.typed(ins[0]),)),)
    return (Issued("all_gather", state, 0, "mixer state", what),
            Issued("reduce_scatter", 0, state * P, "mixer state", what))


def _ring(prop, node: torch.fx.Node, ins: list[torch.fx.Node]) -> tuple[Issued, ...]:
    """Ring (and hybrid) attention (``spdsl.lower.ring``): Ulysses' two all-to-alls inside
    groups of ``U`` ranks (hybrid), then ``R - 1`` ring steps, each a send of the k/v piece
    to the next rank and a receive from the previous one (forward and backward, where the
    fp32 dk/dv accumulator of a piece follows it in ``R - 1`` hops to its owner)."""
    from spdsl.propagate.rules.attention import CHOICE
    choice = node.meta[CHOICE]
    u, r, P = choice.ulysses, choice.ring, prop.parts
    q, k, v = (ins[j].meta["val"] for j in range(3))
    out: list[Issued] = []
    kv_note = ""
    rep = 1
    if u > 1:
        rep = kv_repeat(q.shape[1], k.shape[1], u)
        qkv = (_nbytes(q) + (_nbytes(k) + _nbytes(v)) * rep) // P
        kv_note = f" repeated x{rep}" if rep > 1 else ""
        o = _nbytes(node.meta["val"]) // P
        out.append(Issued("all_to_all", qkv, qkv, "ulysses",
                          (prop.typed(ins[0]),) + tuple(prop.typed(ins[j]) + kv_note
                                                        for j in (1, 2))))
    # a ring member holds k, v for H_kv / U heads (repeated to 1 where fewer) over S / R
    piece = (_nbytes(k) + _nbytes(v)) * rep // P
    grad_piece = (k.numel() + v.numel()) * rep // P * max(4, k.element_size())
    what = tuple(prop.typed(ins[j]) + kv_note for j in (1, 2))
    if choice.layout != "contiguous":    # q, k, v to the layout's pieces, the output back
        qkv = (_nbytes(q) + (_nbytes(k) + _nbytes(v)) * rep) // P
        out.append(Issued("all_to_all", qkv, qkv, "zigzag", (prop.typed(ins[0]),) + what))
    out += [Issued("send_recv", piece, piece + grad_piece, "ring", what)
            for _ in range(r - 1)]
    if choice.layout != "contiguous":
        o = _nbytes(node.meta["val"]) // P
        out.append(Issued("all_to_all", o, o, "zigzag", (prop.typed(node, 0),)))
    if u > 1:
        out.append(Issued("all_to_all", o, o, "ulysses", (prop.typed(node, 0),)))
    return tuple(out)
