"""The redistributions of activations: all-to-alls (even, by rows, several tensors in one,
re-chunked), all-reduce, gather, take, reduce-scatter, the halo exchange of a slice and the
gather of a mixer's states, each an autograd Function in the order chain."""

from __future__ import annotations

import functools

import torch

from spdsl.collectives.order import _after, _before, _ordered
from spdsl.collectives.raw import (
    _a2a_raw,
    _all_gather_raw,
    _all_reduce_raw,
    _pairs,
    _reduce_scatter_raw,
    _unpairs,
)
from spdsl.propagate.placement import chunk_bounds, window_plan


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tok, buf: torch.Tensor, group: str, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return _after(ctx, tok, _a2a_raw(buf, group, out_splits, in_splits))

    @staticmethod
    def backward(ctx, grad, _):
        return (_before(ctx, grad), _a2a_raw(grad, ctx.group, ctx.in_splits, ctx.out_splits),
                None, None, None)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tok, x: torch.Tensor, group: str):
        return _after(ctx, tok, _all_reduce_raw(x, group))

    @staticmethod
    def backward(ctx, grad, _):
        return _before(ctx, grad), grad, None


def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Partial -> Replicate."""
    return _ordered(_AllReduce, x, group)


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    group: str) -> torch.Tensor:
    """Rows of ``x`` to the ranks ``in_splits`` says (that many rows to each, in rank order),
    rows from each rank as ``out_splits`` says; backward sends the gradients back the same
    way. Uneven and empty splits allowed (a relayout of the sequence pieces)."""
    return _ordered(_AllToAll, x, group, out_splits, in_splits)


def _split_dim(x: torch.Tensor, dim: int, outer: int) -> tuple[torch.Tensor, int]:
    """View ``dim`` as ``(outer, rest)``; returns the view and the index of ``rest``."""
    shape = list(x.shape)
    return x.reshape(shape[:dim] + [outer, shape[dim] // outer] + shape[dim + 1:]), dim + 1


def all_to_all(x: torch.Tensor, src: tuple[int, int], dst: tuple[int, int], parts: int,
               group: str) -> torch.Tensor:
    """Move the split of ``x`` from ``src = (dim, outer)`` to ``dst = (dim, outer)``."""
    return all_to_all_many([x], [src], [dst], parts, group)[0]


def _pack(x: torch.Tensor, dst: tuple[int, int], parts: int) -> torch.Tensor:
    """[.., n_dst, ..] -> [P, rest]: the chunk each destination rank gets, flattened."""
    dd, od = dst
    shape = list(x.shape)
    y = x.reshape(shape[:dd] + [od, parts, shape[dd] // (od * parts)] + shape[dd + 1:])
    return y.movedim(dd + 1, 0).reshape(parts, -1)


def _packed(pairs: list[torch.Tensor], dsts, parts: int) -> tuple[torch.Tensor, list[int]]:
    """Several tensors' chunks in one ``[P, rest]`` buffer, and each one's width in it."""
    packed = [_pack(x, d, parts) for x, d in zip(pairs, dsts)]
    sizes = [p.shape[1] for p in packed]
    return (torch.cat(packed, dim=1) if len(packed) > 1 else packed[0]), sizes


def _unpack(buf: torch.Tensor, like_shape: list[int], src: tuple[int, int],
            dst: tuple[int, int], parts: int) -> torch.Tensor:
    """[P, rest] received (row = source rank) -> local tensor split on ``dst``."""
    ds, os_ = src
    dd, od = dst
    shape = list(like_shape)
    shape[dd] //= parts
    # the packed layout of one source chunk: x's shape with dd as (od, n/(od*P))
    chunk = shape[:dd] + [od, shape[dd] // od] + shape[dd + 1:]
    y = buf.reshape([parts] + chunk)
    # merge dd back, then insert the source-rank axis inside ds, after its outer factor
    y = y.reshape([parts] + shape)
    s = list(y.shape[1:])
    y = y.reshape([parts] + s[:ds] + [os_, s[ds] // os_] + s[ds + 1:])
    y = y.movedim(0, ds + 1)
    out = list(s)
    out[ds] *= parts
    return y.reshape(out)


def all_to_all_many(xs: list[torch.Tensor], srcs, dsts, parts: int,
                    group: str) -> list[torch.Tensor]:
    """One all-to-all for several tensors (q, k and v of an attention)."""
    pairs = [_pairs(x) for x in xs]
    buf, sizes = _packed(pairs, dsts, parts)
    got = _ordered(_AllToAll, buf.contiguous(), group, None, None).reshape(parts, -1)
    pieces = torch.split(got, sizes, dim=1) if len(sizes) > 1 else [got]
    return [_unpairs(_unpack(p, list(x.shape), s, d, parts), x0)
            for p, x, x0, s, d in zip(pieces, pairs, xs, srcs, dsts)]


def _positions(split: tuple[int, int, int], parts: int, rank: int) -> list[int]:
    """Global indices, along the dim, of what ``rank`` holds under ``split = (outer, size,
    inner)``, in local order."""
    outer, size, inner = split
    lo, hi = chunk_bounds(size, parts, rank)
    return [(o * size + j) * inner + k for o in range(outer) for j in range(lo, hi)
            for k in range(inner)]


@functools.lru_cache(maxsize=256)
def _rechunk_plan(src: tuple, dst: tuple, parts: int, rank: int):
    # plain Python: the lowering's shape pass runs this under fake tensors, and the cache
    # must hold values, not tensors of one mode
    _, size, inner = dst
    chunk = -(-size // parts)

    def owner(p: int) -> int:
        return p // inner % size // chunk
    mine = _positions(src, parts, rank)
    to = [owner(p) for p in mine]
    order = sorted(range(len(mine)), key=lambda i: to[i])
    send = [to.count(r) for r in range(parts)]
    got = [[p for p in _positions(src, parts, s) if owner(p) == rank] for s in range(parts)]
    flat = [p for g in got for p in g]
    back = sorted(range(len(flat)), key=flat.__getitem__)
    return order, send, [len(g) for g in got], back


def rechunk(x: torch.Tensor, dim: int, src: tuple[int, int, int], dst: tuple[int, int, int],
            parts: int, rank: int, group: str) -> torch.Tensor:
    """Shard -> Shard on one dim factored two ways (``src``/``dst`` = ``(outer, size,
    inner)``): the sequence inside ``[heads*seq]`` re-split as the whole dim, say. One
    all-to-all with per-rank counts; each rank sends every element to the rank that holds its
    global position under ``dst``, and puts what it gets in global order."""
    order, send, recv, back = _rechunk_plan(tuple(src), tuple(dst), parts, rank)
    y = x.movedim(dim, 0)
    rest = list(y.shape[1:])
    buf = y.index_select(0, torch.tensor(order, dtype=torch.long, device=x.device)).reshape(y.shape[0], -1)
    got = _ordered(_AllToAll, buf.contiguous(), group, recv, send)
    back_t = torch.tensor(back, dtype=torch.long, device=x.device)
    return got.index_select(0, back_t).reshape([-1] + rest).movedim(0, dim)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tok, x: torch.Tensor, split: tuple, parts: int, rank: int, group: str):
        ctx.args = (split, parts, rank)
        return _after(ctx, tok, _gather(x, split, parts, group))

    @staticmethod
    def backward(ctx, grad, _):
        split, parts, rank = ctx.args
        return _before(ctx, grad), _take(grad, split, parts, rank), None, None, None, None


class _Take(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tok, x: torch.Tensor, split: tuple, parts: int, rank: int, group: str):
        ctx.args = (split, parts, group)
        return _after(ctx, tok, _take(x, split, parts, rank))

    @staticmethod
    def backward(ctx, grad, _):
        split, parts, group = ctx.args
        return _before(ctx, grad), _gather(grad, split, parts, group), None, None, None, None


def _take(x: torch.Tensor, split: tuple, parts: int, rank: int) -> torch.Tensor:
    dim, outer, size, inner = split
    lo, hi = chunk_bounds(size, parts, rank)
    y, d = _split_dim(x, dim, outer)
    y = y.narrow(d, lo * inner, (hi - lo) * inner)
    shape = list(x.shape)
    shape[dim] = outer * (hi - lo) * inner
    return y.reshape(shape)


def _gather(x: torch.Tensor, split: tuple, parts: int, group: str) -> torch.Tensor:
    dim, outer, size, inner = split
    full = -(-size // parts) * inner
    y, d = _split_dim(x, dim, outer)
    if y.shape[d] < full:   # uneven chunks: pad so that every rank sends the same size
        pad = list(y.shape)
        pad[d] = full - y.shape[d]
        y = torch.cat([y, y.new_zeros(pad)], dim=d)
    g = _all_gather_raw(y.movedim(d, 0), group)
    g = g.reshape([parts, full] + list(g.shape[1:]))
    keep = [(hi - lo) * inner for lo, hi in (chunk_bounds(size, parts, r) for r in range(parts))]
    g = torch.cat([g[r, :k] for r, k in enumerate(keep)], dim=0).movedim(0, d)
    shape = list(x.shape)
    shape[dim] = outer * size * inner
    return g.reshape(shape)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tok, x: torch.Tensor, split: tuple, parts: int, rank: int, group: str):
        ctx.args = (split, parts, group)
        return _after(ctx, tok, _reduce_scatter(x, split, parts, rank, group))

    @staticmethod
    def backward(ctx, grad, _):
        # the gradient of a partial sum is the whole gradient, the same on every rank
        split, parts, group = ctx.args
        return _before(ctx, grad), _gather(grad, split, parts, group), None, None, None, None


def _reduce_scatter(x: torch.Tensor, split: tuple, parts: int, rank: int,
                    group: str) -> torch.Tensor:
    """Sum the partial ``x`` over the ranks, keeping this rank's chunk of ``split``. Uneven
    chunks are padded so that every rank receives the same size."""
    dim, outer, size, inner = split
    full = -(-size // parts) * inner
    y, d = _split_dim(x, dim, outer)
    chunks = []
    for r in range(parts):
        lo, hi = chunk_bounds(size, parts, r)
        c = y.narrow(d, lo * inner, (hi - lo) * inner)
        if c.shape[d] < full:
            pad = list(c.shape)
            pad[d] = full - c.shape[d]
            c = torch.cat([c, c.new_zeros(pad)], dim=d)
        chunks.append(c)
    buf = torch.stack(chunks).reshape(parts * chunks[0].numel())
    got = _unpairs(_reduce_scatter_raw(_pairs(buf).contiguous(), group), buf)
    got = got.reshape(chunks[0].shape)
    lo, hi = chunk_bounds(size, parts, rank)
    got = got.narrow(d, 0, (hi - lo) * inner)
    shape = list(x.shape)
    shape[dim] = outer * (hi - lo) * inner
    return got.reshape(shape)


def reduce_scatter(x: torch.Tensor, split: tuple, parts: int, rank: int,
                   group: str) -> torch.Tensor:
    """Partial -> Shard: the sum's chunk of this rank, in one reduce-scatter."""
    return _ordered(_ReduceScatter, x, split, parts, rank, group)


def gather(x: torch.Tensor, split: tuple, parts: int, rank: int, group: str) -> torch.Tensor:
    """Shard -> Replicate; ``split = (dim, outer, size, inner)``."""
    return _ordered(_Gather, x, split, parts, rank, group)


def take(x: torch.Tensor, split: tuple, parts: int, rank: int, group: str) -> torch.Tensor:
    """Replicate -> Shard: this rank's chunk, for free."""
    return _ordered(_Take, x, split, parts, rank, group)


class _Window(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tok, x: torch.Tensor, dim: int, plan, parts: int, rank: int, group: str):
        own, sends = plan
        lo = own[rank][0]
        idx, out_splits, in_splits = [], [], []
        for q in range(parts):
            a, b = sends[rank][q]
            n = max(0, b - a)
            in_splits.append(n)
            idx.extend(range(a - lo, a - lo + n))
            a2, b2 = sends[q][rank]
            out_splits.append(max(0, b2 - a2))
        x0 = x.movedim(dim, 0)
        index = torch.tensor(idx, dtype=torch.long, device=x.device)
        buf = x0.index_select(0, index)
        out = _a2a_raw(buf, group, out_splits, in_splits)
        ctx.save_for_backward(index)
        ctx.args = (dim, list(x0.shape), out_splits, in_splits, group)
        return _after(ctx, tok, out.movedim(0, dim))

    @staticmethod
    def backward(ctx, grad, _):
        tok = _before(ctx, grad)
        (index,) = ctx.saved_tensors
        dim, shape0, out_splits, in_splits, group = ctx.args
        back = _a2a_raw(grad.movedim(dim, 0).contiguous(), group, in_splits, out_splits)
        gx = back.new_zeros(shape0).index_add_(0, index, back)
        return tok, gx.movedim(0, dim), None, None, None, None, None


def window(x: torch.Tensor, dim: int, size_in: int, start: int, n_out: int, parts: int,
           rank: int, group: str) -> torch.Tensor:
    """This rank's ``torch.chunk`` piece of ``X[start:start+n_out]`` along ``dim``, where ``x``
    is its piece of ``X``: a halo exchange of the rows that cross a chunk boundary."""
    plan = window_plan(size_in, start, n_out, parts)
    if plan is None:
        lo = chunk_bounds(size_in, parts, rank)[0]
        a, b = chunk_bounds(n_out, parts, rank)
        if a == b:      # this rank holds none of the slice (``x[:, :1]`` beyond rank 0)
            return x.narrow(dim, 0, 0)
        return x.narrow(dim, start + a - lo, b - a)
    return _ordered(_Window, x, dim, plan, parts, rank, group)


class _GatherPieces(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tok, x: torch.Tensor, group: str):
        ctx.group = group
        got = _all_gather_raw(x.unsqueeze(0), group)
        return _after(ctx, tok, got.reshape((-1,) + tuple(x.shape)))

    @staticmethod
    def backward(ctx, grad, _):
        # every rank's copy has its own gradient (later pieces read earlier states): the
        # gradient of this rank's piece is their sum
        buf = grad.contiguous().reshape(-1)
        got = _reduce_scatter_raw(buf, ctx.group)
        return _before(ctx, grad), got.reshape(grad.shape[1:]), None


def all_gather_pieces(x: torch.Tensor, group: str) -> torch.Tensor:
    """Each rank's ``x`` to every rank, stacked in rank order (``[P, *x.shape]``); backward
    sums the ranks' gradients of each piece into its owner's (a reduce-scatter). For values
    every rank reads differently, as the states a sequence mixer passes
    (``spdsl.lower.mixers``)."""
    return _ordered(_GatherPieces, x, group)


