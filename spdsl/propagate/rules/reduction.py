"""Reductions and normalisations. Reducing other dims keeps the split; summing or averaging
over the split dim leaves a partial sum (averages divide by the global count, so the sum is
exact); other reductions over it (max, softmax, norms) need the dim whole."""

from __future__ import annotations

from spdsl.propagate.placement import PARTIAL, REPLICATE, Partial, Shard
from spdsl.propagate.rules import RuleCtx, Strategy, aten, rule

_LINEAR = {aten.sum, aten.mean}


def _dims(ctx: RuleCtx, arg: int) -> tuple[list[int], bool]:
    nd = len(ctx.meta(0).shape)
    args = ctx.node.args
    dims = args[arg] if len(args) > arg else ctx.node.kwargs.get("dim")
    if dims is None or dims == []:
        dims = list(range(nd))
    elif isinstance(dims, int):
        dims = [dims]
    keep = args[arg + 1] if len(args) > arg + 1 and isinstance(args[arg + 1], bool) else \
        ctx.node.kwargs.get("keepdim", False)
    return sorted(d % max(nd, 1) for d in dims), bool(keep)


def _reduce(ctx: RuleCtx, dims: list[int], keep: bool, name: str, n_out: int = 1):
    p = ctx.placements[0]
    packet = ctx.node.target.overloadpacket
    def wrap(o):
        return o if n_out == 1 else tuple(o for _ in range(n_out))
    if isinstance(p, Shard):
        if p.dim not in dims:
            d = p.dim if keep else p.dim - sum(1 for r in dims if r < p.dim)
            return [Strategy((p,), wrap(Shard(d, p.outer, p.size)), None, name)]
        if packet in _LINEAR and n_out == 1:
            low = "mean_partial" if packet is aten.mean else None
            return [Strategy((p,), PARTIAL, low, name + ".partial"),
                    Strategy((REPLICATE,), REPLICATE, None, name)]
    if isinstance(p, Partial) and packet is aten.sum:
        return [Strategy((PARTIAL,), PARTIAL, None, name)]
    return [Strategy((REPLICATE,), wrap(REPLICATE), None, name)]


@rule(aten.sum, aten.mean, aten.amax, aten.amin, aten.any, aten.all, aten.prod,
      aten.argmax, aten.argmin, aten.logsumexp, aten.norm, aten.linalg_vector_norm,
      aten.max.default, aten.min.default, name="reduce")
def reduce(ctx: RuleCtx) -> list[Strategy]:
    op = ctx.node.target
    if op in (aten.sum.default, aten.mean.default, aten.prod.default, aten.any.default,
              aten.all.default, aten.max.default, aten.min.default):
        return _reduce(ctx, list(range(len(ctx.meta(0).shape))), False, "reduce")
    if ctx.node.target.overloadpacket in (aten.norm, aten.linalg_vector_norm):
        dims, keep = _dims(ctx, 2)
    else:
        dims, keep = _dims(ctx, 1)
    return _reduce(ctx, dims, keep, "reduce")


@rule(aten.max.dim, aten.min.dim, aten.var_mean.correction, name="reduce")
def reduce_pair(ctx: RuleCtx) -> list[Strategy]:
    dims, keep = _dims(ctx, 1)
    return _reduce(ctx, dims, keep, "reduce", n_out=2)


@rule(aten.var, aten.std, name="reduce")
def var(ctx: RuleCtx) -> list[Strategy]:
    dims, _ = _dims(ctx, 1)
    return _reduce(ctx, dims, bool(ctx.node.kwargs.get("keepdim", False)), "reduce")


@rule(aten._softmax, aten._log_softmax, aten.cumsum, aten.cumprod, aten.sort, aten.topk,
      name="along_dim")
def along_dim(ctx: RuleCtx) -> list[Strategy]:
    p = ctx.placements[0]
    dim = ctx.node.args[1] if len(ctx.node.args) > 1 else -1
    if ctx.node.target.overloadpacket is aten.topk:
        dim = ctx.node.args[2] if len(ctx.node.args) > 2 else -1
    dim %= len(ctx.meta(0).shape)
    multi = isinstance(ctx.out, (tuple, list))
    reqs = tuple([p if isinstance(p, Shard) and p.dim != dim else REPLICATE] +
                 [REPLICATE] * (len(ctx.inputs) - 1))
    o = reqs[0]
    return [Strategy(reqs, tuple(o for _ in ctx.out) if multi else o, None, "along_dim")]


@rule(aten.native_layer_norm, name="layer_norm")
def layer_norm(ctx: RuleCtx) -> list[Strategy]:
    p = ctx.placements[0]
    k = len(ctx.node.args[1])
    nd = len(ctx.meta(0).shape)
    ok = isinstance(p, Shard) and p.dim < nd - k
    x = p if ok else REPLICATE
    reqs = (x,) + tuple(REPLICATE for _ in ctx.inputs[1:])
    return [Strategy(reqs, (x, x, x), None, "layer_norm")]
