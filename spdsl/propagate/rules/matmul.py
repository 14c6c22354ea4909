"""Matrix products, as factor mappings: ``a[b,m,k] @ b[b,k,n] -> [b,m,n]``.

A split batch, ``m`` or ``n`` factor carries to the output; a split ``k`` on both sides leaves
a partial sum. When both operands carry the sequence on their free dims (``q @ k^T``, an
attention score), the batch factor (heads) takes the split on both: this is the Ulysses
sequence -> heads all-to-all, which moves ``1/P`` of what gathering either side would.
"""

from __future__ import annotations

from spdsl.propagate.placement import PARTIAL, REPLICATE, Partial, Shard
from spdsl.propagate.rules import RuleCtx, Strategy, aten, rule
from spdsl.propagate.viewmap import innermost_split


def _split_on(ctx: RuleCtx, i: int, dim: int) -> Shard | None:
    p = ctx.placements[i]
    if isinstance(p, Shard) and p.dim == dim:
        return p
    shape = ctx.meta(i).shape
    return innermost_split(shape[dim], ctx.atoms(i)[dim], dim, ctx.parts)


def _partial_penalty(ctx: RuleCtx) -> float:
    nbytes = ctx.out.numel() * ctx.out.element_size()
    return 2.0 * nbytes * (ctx.parts - 1) / ctx.parts


def _matmul(ctx: RuleCtx, a: int, b: int, batched: bool, bias: int | None) -> list[Strategy]:
    off = 1 if batched else 0
    m_dim, k_dim_a, k_dim_b, n_dim = off, off + 1, off, off + 1
    n_in = len(ctx.inputs)

    def req(pa, pb, pbias=REPLICATE):
        r = [REPLICATE] * n_in
        r[a], r[b] = pa, pb
        if bias is not None:
            r[bias] = pbias
        return tuple(r)

    out = []
    pa, pb = ctx.placements[a], ctx.placements[b]
    both_free = (isinstance(pa, Shard) and pa.dim == m_dim and isinstance(pb, Shard)
                 and pb.dim == n_dim)
    if batched:
        sa = pa if isinstance(pa, Shard) and pa.dim == 0 else None
        sb = pb if isinstance(pb, Shard) and pb.dim == 0 else None
        s = sa or sb or _split_on(ctx, a, 0)
        if s is not None and ctx.meta(b).shape[0] == ctx.meta(a).shape[0]:
            out.append(Strategy(req(s, s), s, None, "matmul.batch"))
    sm = _split_on(ctx, a, m_dim)
    if sm is not None and not both_free:
        out.append(Strategy(req(sm, REPLICATE), Shard(m_dim, sm.outer, sm.size), None,
                            "matmul.rows"))
    if bias is None:
        for i in (a, b):
            if isinstance(ctx.placements[i], Partial):   # linear in each operand
                r = [REPLICATE] * n_in
                r[i] = PARTIAL
                out.append(Strategy(tuple(r), PARTIAL, None, "matmul.partial"))
    replicated = Strategy(req(REPLICATE, REPLICATE), REPLICATE, None, "matmul")
    out.append(replicated)
    sn = _split_on(ctx, b, n_dim)
    if sn is not None and not both_free:
        o = Shard(n_dim, sn.outer, sn.size)
        bias_req = Shard(0, sn.outer, sn.size) if bias is not None else REPLICATE
        out.append(Strategy(req(REPLICATE, sn, bias_req), o, None, "matmul.cols"))
    if bias is None:
        ka = _split_on(ctx, a, k_dim_a)
        if ka is not None:
            kb = Shard(k_dim_b, ka.outer, ka.size)
            out.append(Strategy(req(ka, kb), PARTIAL, None, "matmul.contract",
                                extra_cost=_partial_penalty(ctx)))
    return out


@rule(aten.mm, name="matmul")
def mm(ctx: RuleCtx) -> list[Strategy]:
    return _matmul(ctx, 0, 1, False, None)


@rule(aten.bmm, name="matmul")
def bmm(ctx: RuleCtx) -> list[Strategy]:
    return _matmul(ctx, 0, 1, True, None)


@rule(aten.addmm, name="matmul")
def addmm(ctx: RuleCtx) -> list[Strategy]:
    return _matmul(ctx, 1, 2, False, 0)
