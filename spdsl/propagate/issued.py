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
    if lowering in ("ulysses", "ulysses_flex"):
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
    if lowering == "nll_mean":
        x = ins[0].meta["val"]
        return (Issued("all_reduce", 2 * x.element_size(), 0, "loss",
                       (typed_shape((2,), x.dtype, Partial(), prop.axis),)),)
    if lowering == "slice_window":
        a = ins[0].meta["val"]
        dim, start, n = slice_window(node)
        sent = halo_rows(a.shape[dim], start, n, P) * (_nbytes(a) // max(1, a.shape[dim]))
        return (Issued("halo_exchange", sent, sent, "halo", (prop.typed(ins[0]),)),) \
            if sent else ()
    return ()
