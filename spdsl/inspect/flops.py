"""FLOPs of one step's ops on one rank, for ``spdsl.inspect.timing``: matmuls (2 x the output's
elements x the reduced dim) and attention (4 x B x H x S_q x S_k x D over the rank's share,
half the scores when causal or decided by a mask program); other ops through PyTorch's
``torch.utils.flop_counter`` registry (convolutions), elementwise work not at all.
``tests/inspect/test_timing.py`` checks the matmul count against ``FlopCounterMode`` on the
unsharded model.
"""

from __future__ import annotations

from typing import Any

import torch

from spdsl.inspect.program import Event
from spdsl.propagate.attention_choice import Links

# backward FLOPs per forward FLOP: a matmul's two gradients; attention's recomputed scores,
# dP, dS and the three gradients (flash attention's backward against its forward)
MATMUL_BWD, ATTENTION_BWD = 2.0, 2.5


def _attention_args() -> dict[Any, tuple]:
    """Attention call targets -> (index of ``is_causal``, of the Ulysses degree, of the ring
    groups (their last entry the ring's size), whether a mask program decides the scores):
    None where the call has none."""
    from spdsl.lower import ops, ring
    aten = torch.ops.aten
    return {ops.ulysses_attention: (5, 8, None, False),
            ops.ulysses_attention_fn: (5, 7, None, True),
            ops.ulysses_flex: (None, 9, None, True),
            ring.ring_attention: (4, 6, 7, False),
            ring.ring_attention_fn: (5, 7, 8, True),
            ops.local_attention: (5, None, None, False),
            aten.scaled_dot_product_attention.default: (5, None, None, False)}


_ATT: dict = {}
_MATMULS = {torch.ops.aten.mm.default: 0, torch.ops.aten.bmm.default: 0,
            torch.ops.aten.addmm.default: 1, torch.ops.aten.baddbmm.default: 1}


def is_attention(node: torch.fx.Node) -> bool:
    """Whether ``node`` is an attention call this module counts."""
    if not _ATT:
        _ATT.update(_attention_args())
    return node.op == "call_function" and node.target in _ATT


def ring_slowdown(node: torch.fx.Node, links: Links) -> float:
    """A ring step's kernel against the fused one, per flop (``Links``)."""
    masked = _ATT[node.target][3]
    return links.ring_slowdown if masked else links.ring_slowdown_fused


def _arg(n: torch.fx.Node, i: int | None, name: str, default: Any) -> Any:
    if i is not None and i < len(n.args):
        return n.args[i]
    return n.kwargs.get(name, default)


def flops_of(e: Event) -> float:
    """Forward FLOPs of one event's node on this rank (matmuls and attention)."""
    n = e.node
    if n.op == "call_module":
        region = getattr(e.module, "region", None)       # a tiled MLP: its whole rows
        if isinstance(region, torch.fx.GraphModule):
            return sum(flops_of(Event(m, None, False, None, e.top, True))
                       for m in region.graph.nodes if m.op == "call_function")
        return 0.0
    if n.op != "call_function":
        return 0.0
    if is_attention(n):
        return attention_flops(n) + projection_flops(n)
    out = n.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return 0.0
    first = _MATMULS.get(n.target)
    if first is not None:      # 2 * output elements * the reduced dim (the left operand's last)
        a = n.args[first].meta.get("val") if isinstance(n.args[first], torch.fx.Node) else None
        return 2.0 * out.numel() * a.shape[-1] if isinstance(a, torch.Tensor) else 0.0
    from torch.utils.flop_counter import flop_registry
    fn = flop_registry.get(getattr(n.target, "overloadpacket", None))
    args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta.get("val"))
    if fn is None or any(a is None for a in args):
        return 0.0
    return float(fn(*args, out_val=out, **kwargs))      # convolutions: shapes of fake values


def attention_flops(n: torch.fx.Node) -> float:
    """Forward FLOPs of an attention call's scores on this rank (not the output projection
    fused into it: :func:`projection_flops`)."""
    causal_at, degree_at, groups_at, program = _ATT[n.target]
    q, k = (a.meta.get("val") for a in n.args[:2])
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return 0.0
    b, h, s, d = q.shape
    parts = _arg(n, degree_at, "parts", 1) or 1
    groups = _arg(n, groups_at, "groups", None) if groups_at is not None else None
    if groups:
        parts *= groups[-1]          # Ulysses degree x ring size: every rank
    causal = bool(_arg(n, causal_at, "is_causal", False)) if causal_at is not None \
        else False
    frac = 0.5 if causal or program else 1.0
    # a rank's share of [B, H, S, S] scores: its S/P queries of every head against
    # every key (Ulysses: H/P heads over the whole sequence, the same count)
    return 4.0 * b * h * s * k.shape[-2] * parts * d * frac


def projection_flops(n: torch.fx.Node) -> float:
    """Forward FLOPs of the output projection fused into a Ulysses attention call
    (``spdsl.lower.project``): 0 where none is."""
    project = n.kwargs.get("project")
    out = n.meta.get("val")
    if not project or not isinstance(out, torch.Tensor):
        return 0.0
    wt = project[0].meta.get("val")
    return 2.0 * out.numel() * wt.shape[0] if isinstance(wt, torch.Tensor) else 0.0
