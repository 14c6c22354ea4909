"""Losses over split tokens. A mean over valid labels is ``sum / count`` of global sums: the
lowering computes the local sum and count, all-reduces both, and divides — exact however
unevenly the valid labels (``ignore_index``) fall across ranks (a mean of local means is not).
"""

from __future__ import annotations

import torch

import spdsl.propagate.trace  # noqa: F401  (defines torch.ops.spdsl.*)
from spdsl.propagate.placement import PARTIAL, REPLICATE, Shard
from spdsl.propagate.rules import RuleCtx, Strategy, aten, rule

_MEAN, _SUM = 1, 2


@rule(aten.nll_loss_forward, aten.nll_loss2d_forward, name="loss.nll")
def nll(ctx: RuleCtx) -> list[Strategy]:
    p, t = ctx.placements[0], ctx.placements[1]
    reduction = ctx.node.args[3]
    nd = len(ctx.meta(0).shape)
    two_d = ctx.node.target.overloadpacket is aten.nll_loss2d_forward
    split = p if isinstance(p, Shard) else t if isinstance(t, Shard) else None
    if split is None or nd < 2:
        return [Strategy(tuple(REPLICATE for _ in ctx.inputs), (REPLICATE, REPLICATE), None,
                         "loss.nll")]
    if isinstance(p, Shard):
        tgt = Shard(p.dim - 1 if two_d and p.dim > 1 else p.dim, p.outer, p.size) \
            if not two_d or p.dim != 1 else None
        inp = p
    else:
        tgt = t
        inp = Shard(t.dim + 1 if two_d and t.dim >= 1 else t.dim, t.outer, t.size)
    if tgt is None:
        return [Strategy(tuple(REPLICATE for _ in ctx.inputs), (REPLICATE, REPLICATE), None,
                         "loss.nll")]
    reqs = [inp, tgt] + [REPLICATE] * (len(ctx.inputs) - 2)
    if reduction == _MEAN:
        out, low = (REPLICATE, REPLICATE), "nll_mean"
    elif reduction == _SUM:
        out, low = (PARTIAL, PARTIAL), None
    else:
        out, low = (tgt, PARTIAL), None
    # whole inputs as the fallback: logits and labels split by different factorings of one
    # dim (a reshape of [S, S] logits against [S, S] labels) cannot meet on a split
    return [Strategy(tuple(reqs), out, low, "loss.nll.global_mean" if low else "loss.nll"),
            Strategy(tuple(REPLICATE for _ in ctx.inputs), (REPLICATE, REPLICATE), None,
                     "loss.nll")]


def reduction_index(op) -> int:
    return [a.name for a in op._schema.arguments].index("reduction")


def reduction_of(node: torch.fx.Node) -> int:
    i = reduction_index(node.target)
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get("reduction", _MEAN)


@rule(aten.mse_loss, aten.l1_loss, aten.smooth_l1_loss, aten.huber_loss,
      aten.binary_cross_entropy, name="loss.elementwise")
def elementwise_loss(ctx: RuleCtx) -> list[Strategy]:
    p = next((q for q in ctx.placements if isinstance(q, Shard)), None)
    reduction = reduction_of(ctx.node)
    if p is None:
        return [Strategy(tuple(REPLICATE for _ in ctx.inputs), REPLICATE, None, "loss")]
    reqs = tuple(p if ctx.meta(i).shape == ctx.meta(0).shape else REPLICATE
                 for i in range(len(ctx.inputs)))
    whole = Strategy(tuple(REPLICATE for _ in ctx.inputs), REPLICATE, None, "loss")
    if reduction == _MEAN:
        return [Strategy(reqs, PARTIAL, "loss_mean", "loss.global_mean"), whole]
    if reduction == _SUM:
        return [Strategy(reqs, PARTIAL, None, "loss.sum"), whole]
    return [Strategy(reqs, p, None, "loss"), whole]


@rule(torch.ops.spdsl.constraint, name="constraint")
def constraint(ctx: RuleCtx) -> list[Strategy]:
    target = ctx.constraint
    if target is None:               # a constraint that does not name this axis
        target = ctx.placements[0]
    return [Strategy((target,), target, "constraint", "constraint")]
