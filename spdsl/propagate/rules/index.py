"""Indexing and gathering: ``x[idx]`` (``aten.index.Tensor``), ``torch.gather``,
``take_along_dim``.

Hugging Face builds its 4-D attention mask by indexing the 2-D padding mask,
``mask[batch_idx[:, None, None, None], kv_idx[None, None, None, :]]``, and GPT-J looks rotary
tables up by ``table[position_ids]``. The factors, as data:

- ``x`` split on a dim that no index tensor indexes: the split carries to the output (to the
  dim that dim lands on once the index dims are replaced by the broadcast index shape);
- an index tensor split on a dim of the broadcast index shape (``table[position_ids]`` with
  position ids split on the sequence): the output is split there too, ``x`` is used whole;
- otherwise ``x`` is gathered: an indexed dim needs every row. A padding mask is ``[B, S]``
  integers: ``B * S * 8 / P`` bytes per rank, once per forward.

``gather(x, dim, idx)``: ``x`` and ``idx`` split on the same dim other than ``dim`` keep it;
``idx`` split on ``dim`` itself with ``x`` whole gives an output split there.
"""

from __future__ import annotations

from spdsl.propagate.placement import PARTIAL, REPLICATE, Shard
from spdsl.propagate.rules import RuleCtx, Strategy, aten, rule


def _index_layout(ctx: RuleCtx) -> tuple[list[int], int, bool]:
    """The dims of ``x`` that carry an index tensor, the rank of the broadcast index shape,
    and whether the index dims are adjacent (then the broadcast dims replace them in place;
    otherwise they go first, as in NumPy)."""
    spec = ctx.node.args[1]
    indexed = [d for d, i in enumerate(spec) if i is not None]
    bnd = max((len(ctx.meta(k).shape) for k in range(1, len(ctx.inputs))), default=0)
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1)) if indexed else True
    return indexed, bnd, adjacent


def _out_dim_of_x(d: int, indexed: list[int], bnd: int, adjacent: bool) -> int:
    before = sum(1 for e in range(d) if e not in indexed)
    if adjacent and indexed and d > indexed[0]:
        return bnd + before
    if adjacent:
        return before
    return bnd + before


@rule(aten.index.Tensor, name="index")
def index(ctx: RuleCtx) -> list[Strategy]:
    n = len(ctx.inputs)
    out_nd = len(ctx.out.shape)
    indexed, bnd, adjacent = _index_layout(ctx)
    first = indexed[0] if adjacent and indexed else 0
    cands: list[Strategy] = []
    p = ctx.placements[0]
    if isinstance(p, Shard) and p.dim not in indexed:
        o = _out_dim_of_x(p.dim, indexed, bnd, adjacent)
        cands.append(Strategy((p,) + (REPLICATE,) * (n - 1), Shard(o, p.outer, p.size), None,
                              "index.carry"))
    for k in range(1, n):
        q = ctx.placements[k]
        if not isinstance(q, Shard):
            continue
        shape_k = ctx.meta(k).shape
        b = q.dim + bnd - len(shape_k)              # dim of the broadcast index shape
        reqs: list = [REPLICATE]
        ok = True
        for j in range(1, n):
            sj = ctx.meta(j).shape
            dj = b - (bnd - len(sj))
            if dj < 0 or sj[dj] == 1:
                reqs.append(REPLICATE)
            elif sj[dj] == shape_k[q.dim]:
                reqs.append(Shard(dj, q.outer, q.size))
            else:
                ok = False
        if ok:
            o = first + b
            if o < out_nd:
                cands.append(Strategy(tuple(reqs), Shard(o, q.outer, q.size), None,
                                      "index.follow_index"))
    cands.append(Strategy((REPLICATE,) * n, REPLICATE, None, "index"))
    return cands


@rule(aten.gather, name="gather")
def gather(ctx: RuleCtx) -> list[Strategy]:
    nd = len(ctx.meta(0).shape)
    dim = ctx.node.args[1] % max(nd, 1)
    px, pi = ctx.placements[0], ctx.placements[1]
    cands = []
    for s in (px, pi):
        if isinstance(s, Shard) and s.dim != dim and \
                ctx.meta(0).shape[s.dim] == ctx.meta(1).shape[s.dim]:
            cands.append(Strategy((s, s), s, None, "gather.carry"))
    if isinstance(pi, Shard) and pi.dim == dim:
        cands.append(Strategy((REPLICATE, pi), pi, None, "gather.follow_index"))
    cands.append(Strategy((REPLICATE, REPLICATE), REPLICATE, None, "gather"))
    return cands




_ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}


@rule(aten.scatter, aten.scatter_, aten.scatter_add, aten.scatter_add_, name="scatter")
def scatter(ctx: RuleCtx) -> list[Strategy]:
    """``x.scatter(dim, idx, src)`` (and ``scatter_add``, in place too): ``x``, ``idx`` and
    ``src`` split on the same dim other than ``dim`` keep it, each row scattered within itself
    (a router's group mask, ``zeros.scatter_(1, top_groups, 1)``). Counts added into zeros by
    an index split along ``dim`` itself (a load-balancing loss,
    ``zeros(E).scatter_add_(0, experts, weights)``) are each rank's partial sums."""
    n = len(ctx.inputs)
    nd = ctx.meta(0).dim()
    dim = ctx.node.args[1] % max(nd, 1)
    cands = []
    for s in ctx.placements:
        if isinstance(s, Shard) and s.dim != dim and s.dim < nd and all(
                ctx.meta(i).dim() == nd and ctx.meta(i).shape[s.dim] == ctx.meta(0).shape[s.dim]
                for i in range(n)):
            cands.append(Strategy((s,) * n, s, None, "scatter.carry"))
            break
    pi = ctx.placements[1]
    adds = ctx.node.target.overloadpacket in (aten.scatter_add, aten.scatter_add_)
    if adds and n == 3 and isinstance(pi, Shard) and pi.dim == dim and \
            ctx.meta(1).shape == ctx.meta(2).shape and ctx.inputs[0].target in _ZEROS:
        cands.append(Strategy((REPLICATE, pi, pi), PARTIAL, None, "scatter.partial_sum"))
    cands.append(Strategy((REPLICATE,) * n, REPLICATE, None, "scatter"))
    return cands
