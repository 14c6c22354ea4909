"""Views and data movement: the split follows its factor through view/reshape/permute/
transpose/(un)squeeze/expand/cat/split; slicing the split dim re-chunks it (a halo exchange of
the few rows that cross a chunk boundary); selecting one index of it is a partial sum (the
owner contributes, the others add zeros)."""

from __future__ import annotations

from spdsl.propagate.issued import slice_window
from spdsl.propagate.placement import PARTIAL, REPLICATE, Partial, Shard, halo_rows
from spdsl.propagate.rules import RuleCtx, Strategy, aten, rule
from spdsl.propagate.viewmap import map_shard


def _replicated(ctx: RuleCtx, name: str, out=None) -> Strategy:
    out = REPLICATE if out is None else out
    return Strategy(tuple(REPLICATE for _ in ctx.inputs), out, None, name)


@rule(aten.view, aten._unsafe_view, aten.reshape, name="view")
def view(ctx: RuleCtx) -> list[Strategy]:
    p = ctx.placements[0]
    out = []
    if isinstance(p, Shard):
        s = map_shard(ctx.meta(0).shape, p, ctx.out.shape, ctx.parts)
        if s is not None:
            out.append(Strategy((p,), s, "view", "view"))
    if isinstance(p, Partial):
        out.append(Strategy((PARTIAL,), PARTIAL, "view", "view"))
    out.append(Strategy((REPLICATE,), REPLICATE, "view", "view"))
    return out


@rule(aten.expand, name="expand")
def expand(ctx: RuleCtx) -> list[Strategy]:
    p = ctx.placements[0]
    out = []
    added = len(ctx.out.shape) - len(ctx.meta(0).shape)
    if isinstance(p, Shard):
        out.append(Strategy((p,), Shard(p.dim + added, p.outer, p.size), "view", "expand"))
    if isinstance(p, Partial):
        out.append(Strategy((PARTIAL,), PARTIAL, "view", "expand"))
    out.append(Strategy((REPLICATE,), REPLICATE, "view", "expand"))
    return out


def _dim_map(ctx: RuleCtx, new_dim_of) -> list[Strategy]:
    p = ctx.placements[0]
    if isinstance(p, Shard):
        return [Strategy((p,), Shard(new_dim_of(p.dim), p.outer, p.size), None, "permute")]
    return [Strategy((p,), p, None, "permute")]


@rule(aten.permute, name="permute")
def permute(ctx: RuleCtx) -> list[Strategy]:
    perm = [d % len(ctx.out.shape) for d in ctx.node.args[1]]
    return _dim_map(ctx, perm.index)


@rule(aten.transpose, name="transpose")
def transpose(ctx: RuleCtx) -> list[Strategy]:
    n = len(ctx.out.shape)
    a, b = ctx.node.args[1] % n, ctx.node.args[2] % n
    return _dim_map(ctx, lambda d: b if d == a else a if d == b else d)


@rule(aten.t, name="transpose")
def t(ctx: RuleCtx) -> list[Strategy]:
    return _dim_map(ctx, lambda d: 1 - d if len(ctx.out.shape) == 2 else d)


@rule(aten.unsqueeze, name="unsqueeze")
def unsqueeze(ctx: RuleCtx) -> list[Strategy]:
    k = ctx.node.args[1] % len(ctx.out.shape)
    return _dim_map(ctx, lambda d: d + 1 if d >= k else d)


@rule(aten.squeeze, name="squeeze")
def squeeze(ctx: RuleCtx) -> list[Strategy]:
    in_shape = ctx.meta(0).shape
    if len(ctx.node.args) > 1:
        dims = ctx.node.args[1]
        dims = [dims] if isinstance(dims, int) else list(dims)
        gone = {d % len(in_shape) for d in dims if in_shape[d] == 1}
    else:
        gone = {d for d, n in enumerate(in_shape) if n == 1}
    return _dim_map(ctx, lambda d: d - sum(1 for g in gone if g < d))


@rule(aten.slice, name="slice")
def slice_(ctx: RuleCtx) -> list[Strategy]:
    p = ctx.placements[0]
    shape = ctx.meta(0).shape
    dim = ctx.node.args[1] % len(shape) if len(ctx.node.args) > 1 else 0
    if not isinstance(p, Shard) or p.dim != dim:
        if isinstance(p, Partial):
            return [Strategy((PARTIAL,), PARTIAL, None, "slice")]
        return [Strategy((p,), p, None, "slice")]
    step = ctx.node.args[4] if len(ctx.node.args) > 4 else 1
    n = ctx.out.shape[dim]
    if step == 1 and p.outer == 1 and p.inner(shape) == 1:
        _, start, _ = slice_window(ctx.node)
        row = ctx.meta(0).numel() // max(1, shape[dim]) * ctx.meta(0).element_size()
        halo = float(halo_rows(shape[dim], start, n, ctx.parts) * row)   # what the plan lists
        return [Strategy((p,), Shard(dim, 1, n), "slice_window", "slice.window",
                         extra_cost=halo),
                _replicated(ctx, "slice")]
    return [_replicated(ctx, "slice")]


@rule(aten.select, name="select")
def select(ctx: RuleCtx) -> list[Strategy]:
    p = ctx.placements[0]
    dim = ctx.node.args[1] % len(ctx.meta(0).shape)
    if isinstance(p, Shard):
        if p.dim == dim:
            if p.outer == 1 and p.inner(ctx.meta(0).shape) == 1:
                return [Strategy((p,), PARTIAL, "select_owner", "select.owner")]
            return [_replicated(ctx, "select")]
        return _dim_map(ctx, lambda d: d - 1 if d > dim else d)
    return [Strategy((p,), p, None, "select")]


@rule(aten.cat, name="cat")
def cat(ctx: RuleCtx) -> list[Strategy]:
    dim = ctx.node.args[1] if len(ctx.node.args) > 1 else 0
    n = len(ctx.out.shape)
    dim %= n
    shards = {p for p in ctx.placements if isinstance(p, Shard)}
    out = []
    # torch.cat skips 1-d empty operands (a Hugging Face key/value cache before its first
    # update): they stay whole, the others keep the split
    empty = [tuple(ctx.meta(i).shape) == (0,) for i in range(len(ctx.inputs))]
    for s in shards:
        if s.dim != dim and all(e or len(ctx.meta(i).shape) == n for i, e in enumerate(empty)):
            out.append(Strategy(tuple(REPLICATE if e else s for e in empty), s, None, "cat"))
    if empty.count(False) == 1:      # cat(empty, x) is x, whatever the dim
        p = ctx.placements[empty.index(False)]
        out.append(Strategy(tuple(REPLICATE if e else p for e in empty), p, None, "cat"))
    if all(isinstance(p, Partial) for p in ctx.placements):
        out.append(Strategy(tuple(PARTIAL for _ in ctx.inputs), PARTIAL, None, "cat"))
    out.append(_replicated(ctx, "cat"))
    return out


@rule(aten.stack, name="stack")
def stack(ctx: RuleCtx) -> list[Strategy]:
    dim = (ctx.node.args[1] if len(ctx.node.args) > 1 else 0) % len(ctx.out.shape)
    out = []
    for s in {p for p in ctx.placements if isinstance(p, Shard)}:
        o = Shard(s.dim + (1 if s.dim >= dim else 0), s.outer, s.size)
        out.append(Strategy(tuple(s for _ in ctx.inputs), o, None, "stack"))
    out.append(_replicated(ctx, "stack"))
    return out


@rule(aten.split, aten.split_with_sizes, aten.unbind, aten.chunk, name="split")
def split(ctx: RuleCtx) -> list[Strategy]:
    p = ctx.placements[0]
    nd = len(ctx.meta(0).shape)
    default_dim = 0
    dim = ctx.node.args[2] if len(ctx.node.args) > 2 else ctx.node.kwargs.get("dim", default_dim)
    if ctx.node.target.overloadpacket is aten.unbind:
        dim = ctx.node.args[1] if len(ctx.node.args) > 1 else 0
    dim %= nd
    k = len(ctx.out)
    unbind = ctx.node.target.overloadpacket is aten.unbind
    if isinstance(p, Shard) and p.dim != dim:
        o = Shard(p.dim - (1 if unbind and p.dim > dim else 0), p.outer, p.size)
        return [Strategy((p,), tuple(o for _ in range(k)), None, "split")]
    if isinstance(p, Partial):
        return [Strategy((p,), tuple(PARTIAL for _ in range(k)), None, "split")]
    return [Strategy((REPLICATE,), tuple(REPLICATE for _ in range(k)), None, "split")]


@rule(aten.tril, aten.triu, name="triangle")
def triangle(ctx: RuleCtx) -> list[Strategy]:
    p = ctx.placements[0]
    n = len(ctx.out.shape)
    if isinstance(p, Shard) and p.dim < n - 2:
        return [Strategy((p,), p, None, "triangle")]
    return [Strategy((REPLICATE,), REPLICATE, None, "triangle")]


@rule(aten.native_dropout, name="dropout")
def dropout(ctx: RuleCtx) -> list[Strategy]:
    p = ctx.placements[0]
    p = REPLICATE if isinstance(p, Partial) else p
    return [Strategy((p,), (p, p), None, "dropout")]


@rule(aten.embedding, name="embedding")
def embedding(ctx: RuleCtx) -> list[Strategy]:
    p = ctx.placements[1]
    if isinstance(p, Shard):
        return [Strategy((REPLICATE, p), p, None, "embedding")]
    return [Strategy((REPLICATE, REPLICATE), REPLICATE, None, "embedding")]


@rule(aten.index_select, name="index_select")
def index_select(ctx: RuleCtx) -> list[Strategy]:
    p = ctx.placements[0]
    dim = ctx.node.args[1] % len(ctx.meta(0).shape)
    if isinstance(p, Shard) and p.dim != dim:
        return [Strategy((p, REPLICATE), p, None, "index_select")]
    q = ctx.placements[1]
    if isinstance(q, Shard) and not isinstance(p, Shard) and len(ctx.meta(1).shape) == 1:
        return [Strategy((REPLICATE, q), Shard(dim, 1, ctx.out.shape[dim]), None, "index_select")]
    return [Strategy((REPLICATE, REPLICATE), REPLICATE, None, "index_select")]

