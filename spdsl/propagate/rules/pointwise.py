"""Elementwise ops: the output keeps a split that one input carries; other inputs follow it
(sliced locally when replicated, untouched where they broadcast). Sums stay partial through
linear ops only."""

from __future__ import annotations

from spdsl.propagate.placement import PARTIAL, REPLICATE, Partial, Shard
from spdsl.propagate.rules import RuleCtx, Strategy, aten, rule

# ops linear in every tensor input (a partial sum may pass through); adding a number is not
# linear (each rank's share would get it), so add/sub need two tensor operands
_LINEAR_ALL = {aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.clone.default,
               aten._to_copy.default, aten.alias.default, aten.detach.default,
               aten.mul.Scalar, aten.div.Scalar}
_TWO_TENSORS = {aten.add.Tensor, aten.sub.Tensor}
# ops linear in their first input when the others are replicated
_LINEAR_FIRST = {aten.mul.Tensor, aten.div.Tensor}


def _follow(ctx: RuleCtx, out_shard: Shard) -> tuple | None:
    out_shape = ctx.out.shape
    req = []
    for i in range(len(ctx.inputs)):
        shape = ctx.meta(i).shape
        d = out_shard.dim - (len(out_shape) - len(shape))
        if d < 0 or shape[d] == 1 != out_shape[out_shard.dim]:
            req.append(REPLICATE)           # broadcast along the split dim: used whole
        elif shape[d] == out_shape[out_shard.dim]:
            req.append(Shard(d, out_shard.outer, out_shard.size))
        else:
            return None
    return tuple(req)


def pointwise(ctx: RuleCtx) -> list[Strategy]:
    op = ctx.node.target
    out = []
    seen = set()
    rank_out = len(ctx.out.shape)
    for i, p in enumerate(ctx.placements):
        if isinstance(p, Shard):
            s = Shard(p.dim + rank_out - len(ctx.meta(i).shape), p.outer, p.size)
            if s in seen:
                continue
            seen.add(s)
            req = _follow(ctx, s)
            if req is not None:
                out.append(Strategy(req, s, None, "pointwise"))
    partial = [isinstance(p, Partial) for p in ctx.placements]
    if any(partial):
        if op in _LINEAR_ALL and all(partial) and (op not in _TWO_TENSORS or
                                                   len(ctx.inputs) == 2):
            out.append(Strategy(tuple(PARTIAL for _ in partial), PARTIAL, None, "pointwise.linear"))
        elif op in _LINEAR_FIRST and partial[0]:
            req = (PARTIAL,) + tuple(REPLICATE for _ in partial[1:])
            out.append(Strategy(req, PARTIAL, None, "pointwise.linear"))
    out.append(Strategy(tuple(REPLICATE for _ in ctx.inputs), REPLICATE, None, "pointwise"))
    return out


rule(aten.clone, aten._to_copy, aten.alias, aten.detach, aten.zeros_like, aten.ones_like,
     aten.full_like, aten.empty_like, aten.masked_fill, aten.where, aten.fill, aten.rand_like,
     aten.contiguous, aten.type_as, aten.copy, aten.lerp, aten.clamp,
     name="pointwise")(pointwise)
