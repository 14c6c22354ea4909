"""Autograd-aware collectives on local tensors, and the agreements of the ranks' hosts (end
of the file): every process-group call spdsl makes is here (``torch.distributed.checkpoint``,
which ``spdsl.checkpoint`` calls, makes its own).

Each is a functional collective (``torch.distributed._functional_collectives``) inside an
``autograd.Function`` whose backward is written out, because the gradient rule depends on what
the value means (spdsl's invariant: the gradient of a replicated value is the full gradient,
the same on every rank; of a split value, the local piece; of a partial sum, the full gradient):

=====================  ==========================  ===============================
redistribution         forward                     backward
=====================  ==========================  ===============================
Shard -> Shard         all-to-all                  all-to-all back
(one dim, refactored)  (``rechunk``: counts per rank)
Shard -> Replicate     all-gather                  local slice
Replicate -> Shard     local slice                 all-gather
Partial -> Replicate   all-reduce                  identity
Partial -> Shard       reduce-scatter              all-gather
Replicate, used split  identity                    all-reduce (partial grad)
slice of a split dim   halo exchange (all-to-all)  halo exchange back
=====================  ==========================  ===============================

All-to-alls are real ``all_to_all_single`` calls (DTensor's CPU path gathers instead). Each
collective waits where it is issued, except ``all_to_all_many_start``'s, which is waited
later (pipelined Ulysses overlaps it with another head group's attention). The
gradient all-reduces of parameters go in buckets (``grad_all_reduce_many``): one flat
all-reduce per bucket instead of one per parameter.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

import spdsl.env as env
import spdsl.watchdog as watchdog
from spdsl._torch import (
    all_gather_single,
    at_backward_end,
    backward_task_id,
    c10d_functional,
    engine_will_accumulate,
    reduce_scatter_single,
)
from spdsl._torch import functional_collectives as fc
from spdsl.propagate.placement import chunk_bounds, window_plan


def _pairs(x: torch.Tensor) -> torch.Tensor:
    """Complex tensors (rotary tables as ``torch.polar``, DeepSeek-V2's rotated q/k) travel as
    their real pairs: gloo and NCCL have no complex types, and the pairs (a trailing dim of 2)
    split along the same leading dims, so they pack beside real tensors too."""
    return torch.view_as_real(x) if x.is_complex() else x


def _unpairs(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.view_as_complex(y.contiguous()) if like.is_complex() else y


def _run(kind: str, x: torch.Tensor, group: str, issue, even: bool = True) -> torch.Tensor:
    """``issue(x)`` (a functional collective) numbered and waited under the watchdog;
    ``even``: every rank of the group sends as many bytes as this one."""
    nbytes = x.numel() * x.element_size()
    number = watchdog.issued(kind, nbytes, group, even)
    return watchdog.wait(issue(x), number, kind, nbytes, group)


def _a2a_raw(buf: torch.Tensor, group: str, out_splits=None, in_splits=None) -> torch.Tensor:
    got = _run("all_to_all", _pairs(buf).contiguous(), group,
               lambda b: fc.all_to_all_single(b, out_splits, in_splits, group),
               even=out_splits is None and in_splits is None)
    return _unpairs(got, buf)


def _all_reduce_raw(x: torch.Tensor, group: str) -> torch.Tensor:
    return _unpairs(_run("all_reduce", _pairs(x).contiguous(), group,
                         lambda b: fc.all_reduce(b, "sum", group)), x)


def _all_gather_raw(x: torch.Tensor, group: str) -> torch.Tensor:
    """[n, ...] on each rank -> [P*n, ...], rank order."""
    return _unpairs(_run("all_gather", _pairs(x).contiguous(), group,
                         lambda b: all_gather_single(b, 0, group)), x)


def _reduce_scatter_raw(buf: torch.Tensor, group: str) -> torch.Tensor:
    """[P*n] summed over the ranks, this rank's n."""
    return _run("reduce_scatter", buf, group, lambda b: reduce_scatter_single(b, "sum", 0, group))


# -- one order of collectives in backward, on every rank -------------------------------------
# The autograd engine runs whatever backward is ready, highest sequence number first: two
# ranks whose graphs differ beside a collective (a piece of the sequence that reads nothing
# of another rank's output, a mask only one rank's piece needs) can reach their backward
# collectives in different orders and wait for each other forever. So each collective of a
# step's forward takes the order token of the one before it and gives its own: an empty tensor
# whose gradient flows back along the chain, so that the backward of collective k runs only
# once the backward of collective k + 1 has run, on every rank (reverse forward order, whatever
# the rest of the graph is; a collective whose output a rank does not read still runs, on a
# zero gradient). The step's output takes the last token (``tie_order``), so the last
# collective's backward runs on every rank as well. Under ``torch.compile`` the compiled
# backward's order is the graph's.

class _Order:
    active = False          # inside a step's forward (``backward_order``)
    token: torch.Tensor | None = None


@contextlib.contextmanager
def backward_order():
    """Chain the collectives issued inside (one step's forward) into one backward order.
    Nested uses (a segment of a segmented call) continue the outer chain."""
    if _Order.active or not torch.is_grad_enabled():
        yield
        return
    _Order.active, _Order.token = True, None
    try:
        yield
    finally:
        _Order.active, _Order.token = False, None


@contextlib.contextmanager
def unordered():
    """Collectives issued inside join no chain (the memory planner's run of a program on
    tensors without data, with a backward of its own, while a step's forward is chaining:
    a segment planned between two segments that ran must not tie its backward to theirs)."""
    saved = _Order.active, _Order.token
    _Order.active, _Order.token = False, None
    try:
        yield
    finally:
        _Order.active, _Order.token = saved


def _ordered(fn, *args):
    """``fn.apply(token, *args)``, its outputs without the token; the token it gives becomes
    the chain's end when any tensor argument needs a gradient."""
    chained = _Order.active and not torch.compiler.is_compiling() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    *outs, token = fn.apply(_Order.token if chained else None, *args)
    if chained:
        _Order.token = token
        watchdog.tag(token)             # its backward's collective names this op too
    return outs[0] if len(outs) == 1 else tuple(outs)


class _Tie(torch.autograd.Function):
    """A step's output, tied to the order token of its last collective."""

    @staticmethod
    def forward(ctx, tok, x: torch.Tensor):
        ctx.tok = tok.device
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros(0, device=ctx.tok), grad


def tie_order(outs):
    """``outs`` (a step's outputs, inside ``backward_order``) with the first that needs a
    gradient tied to the chain's last token, so that the backward of the step's last
    collective runs on every rank too: where a rank reads nothing of its output, nothing
    else would reach it there, while the other ranks wait in it."""
    tok = _Order.token
    if tok is None:
        return outs
    outs = list(outs)
    for i, o in enumerate(outs):
        if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point():
            outs[i] = _Tie.apply(tok, o)
            break
    return outs


def _after(ctx, tok, *outs):
    """A collective's forward outputs and its order token."""
    ctx.tok = None if tok is None else tok.device
    return (*outs, torch.empty(0, device=outs[0].device))


def _before(ctx, _grad=None):
    """The gradient of the order token a collective took (None if it took none)."""
    return None if ctx.tok is None else torch.zeros(0, device=ctx.tok)


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


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tok, x: torch.Tensor, group: str):
        ctx.group = group
        return _after(ctx, tok, x.view_as(x))

    @staticmethod
    def backward(ctx, grad, _):
        return _before(ctx, grad), _all_reduce_raw(grad, ctx.group), None


# Gradient buckets reduced while backward goes on (``SPDSL_GRAD_OVERLAP``, default on): a
# bucket's all-reduce is started when its last gradient is known and waited for once, when
# backward ends, so the reduction runs under the rest of backward instead of stopping it.
GRAD_OVERLAP = env.on("SPDSL_GRAD_OVERLAP")


class _GradAllReduceMany(torch.autograd.Function):
    """Identity on several replicated values; backward all-reduces their gradients together,
    as one flat buffer, once all of them are known.

    Overlapped (``GRAD_OVERLAP``), when every value is a leaf whose gradient ``backward()``
    accumulates into ``.grad`` with no hook on it (plain replicated parameters; not under
    ``torch.compile``, ``torch.autograd.grad`` or a sharded state's views): the all-reduce
    starts here, the gradients go to nobody yet, and at the end of backward (an autograd
    engine callback) every started bucket is waited for and its pieces are accumulated into
    ``.grad`` as autograd would have (set when None, added otherwise). Nothing reads a
    gradient before its reduction is done; the sum is the same."""

    @staticmethod
    def forward(ctx, tok, group: str, *xs: torch.Tensor):
        ctx.group = group
        ctx.set_materialize_grads(False)    # a value no gradient reached keeps None
        ctx.leaves = xs if GRAD_OVERLAP and all(_plain_leaf(x) for x in xs) else None
        return _after(ctx, tok, *(x.view_as(x) for x in xs))

    @staticmethod
    def backward(ctx, *grads):
        grads = grads[:-1]                  # the last is the order token's
        tok = _before(ctx, next((g for g in grads if g is not None), None))
        # the same on every rank: which values get a gradient is decided by the graph
        got = [g for g in grads if g is not None]
        if not got:
            return (tok, None, *(None,) * len(grads))
        flat = torch.cat([g.reshape(-1) for g in got])
        if torch.compiler.is_compiling():
            flat = _all_reduce_raw(flat, ctx.group)     # Inductor plans the buffers itself
        elif ctx.leaves is not None and _accumulated(ctx.leaves):
            watchdog.issued("all_reduce", flat.numel() * flat.element_size(), ctx.group)
            flat = c10d_functional.all_reduce_(flat, "sum", ctx.group)
            _start_bucket(flat, [(x, g.shape) for x, g in zip(ctx.leaves, grads)
                                 if g is not None])
            return (tok, None, *(None,) * len(grads))
        else:   # the concatenation is ours: reduce it in place, one bucket-sized buffer fewer
            _run("all_reduce", flat, ctx.group,
                 lambda b: c10d_functional.all_reduce_(b, "sum", ctx.group))
        pieces = iter(torch.split(flat, [g.numel() for g in got]))
        return (tok, None, *(None if g is None else next(pieces).view(g.shape) for g in grads))


def _plain_leaf(x: torch.Tensor) -> bool:
    return (x.is_leaf and x.requires_grad and not x._backward_hooks
            and not getattr(x, "_post_accumulate_grad_hooks", None)
            and type(x) in (torch.Tensor, torch.nn.Parameter) and x.device.type != "meta")


def _accumulated(leaves) -> bool:
    """Whether this backward accumulates into each leaf's ``.grad`` (``loss.backward()``,
    not ``torch.autograd.grad``)."""
    try:
        return all(engine_will_accumulate(x) for x in leaves)
    except RuntimeError:        # not inside a backward the engine runs
        return False


_STARTED: list[tuple[torch.Tensor, list]] = []
_TASK = [None]          # the backward whose end finishes the started buckets


def _start_bucket(flat: torch.Tensor, into: list) -> None:
    task = backward_task_id()
    if _TASK[0] != task:
        # a backward that failed half-way never ran its callback: its reductions finish
        # (every rank started them), its gradients are dropped with it
        for stale, _ in _STARTED:
            watchdog.wait(stale, 0, "all_reduce", stale.numel() * stale.element_size(),
                          "(a gradient bucket of a failed backward)")
        _STARTED.clear()
        _TASK[0] = task
        at_backward_end(_finish_buckets)
    _STARTED.append((flat, into))


def _finish_buckets() -> None:
    """At the end of backward: wait for every started bucket, then accumulate its pieces."""
    started = list(_STARTED)
    _STARTED.clear()
    _TASK[0] = None
    with torch.profiler.record_function("spdsl.grad_bucket_wait"), torch.no_grad():
        for flat, into in started:
            flat = watchdog.wait(flat, 0, "all_reduce", flat.numel() * flat.element_size(),
                                 "(a gradient bucket)")
            offset = 0
            for x, shape in into:
                n = shape.numel()
                g = flat[offset:offset + n].view(shape)
                offset += n
                if x.grad is None:
                    x.grad = g
                else:
                    x.grad.add_(g)


def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Partial -> Replicate."""
    return _ordered(_AllReduce, x, group)


def grad_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """A replicated value used where the computation is split: its gradient is partial."""
    if not x.requires_grad:
        return x
    return _ordered(_GradAllReduce, x, group)


def grad_all_reduce_many(xs: list[torch.Tensor], group: str) -> list[torch.Tensor]:
    """``grad_all_reduce`` of several values (one dtype) as one bucket: a single all-reduce of
    their concatenated gradients in backward instead of one per value."""
    # one value twice (a tied embedding read by the embedding and the output projection):
    # pass it once, its gradient is the sum over both uses either way, and an
    # autograd.Function under torch.compile rejects a duplicated input
    idx, first = [], {}
    for i, x in enumerate(xs):
        if x.requires_grad and not any(x is xs[j] for j in idx):
            idx.append(i)
    if not idx:
        return list(xs)
    outs = list(xs)
    reduced = _ordered(_GradAllReduceMany, group, *(xs[i] for i in idx))
    for i, y in zip(idx, reduced if len(idx) > 1 else [reduced]):
        outs[i] = y
        first[i] = y
    for i, x in enumerate(xs):
        if i not in first and x.requires_grad:
            outs[i] = next(first[j] for j in idx if xs[j] is x)
    return outs


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
    packed = [_pack(x, d, parts) for x, d in zip(pairs, dsts)]
    sizes = [p.shape[1] for p in packed]
    buf = torch.cat(packed, dim=1) if len(packed) > 1 else packed[0]
    got = _ordered(_AllToAll, buf.contiguous(), group, None, None).reshape(parts, -1)
    pieces = torch.split(got, sizes, dim=1) if len(packed) > 1 else [got]
    return [_unpairs(_unpack(p, list(x.shape), s, d, parts), x0)
            for p, x, x0, s, d in zip(pieces, pairs, xs, srcs, dsts)]


# -- an all-to-all in flight: issued at one point, waited at a later one ----------------------
# Two autograd Functions around the functional op and its wait, so that whatever runs between
# the issue and the wait (another head group's attention) overlaps the transfer; on gloo the
# transfer runs on the backend's threads. Backward mirrors forward: the wait's backward issues
# the reverse all-to-all of the gradient, the issue's backward waits for it, and the autograd
# engine (highest sequence number first) runs the backward of what ran in between in between.

def _a2a_issue(buf: torch.Tensor, parts: int, group: str) -> torch.Tensor:
    buf = buf.contiguous()
    sizes = [buf.shape[0] // parts] * parts
    watchdog.issued("all_to_all", buf.numel() * buf.element_size(), group)
    return c10d_functional.all_to_all_single(buf, sizes, sizes, group)


def _a2a_wait(got: torch.Tensor, group: str) -> torch.Tensor:
    # numbered where it was issued; 0 here: the wait of an exchange in flight
    return watchdog.wait(got, 0, "all_to_all", got.numel() * got.element_size(), group)


class _AllToAllIssue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buf: torch.Tensor, parts: int, group: str):
        ctx.group = group
        return _a2a_issue(buf, parts, group)         # not filled until waited

    @staticmethod
    def backward(ctx, grad):
        return _a2a_wait(grad, ctx.group), None, None


class _AllToAllWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tok, got: torch.Tensor, parts: int, group: str):
        ctx.args = (parts, group)
        return _after(ctx, tok, _a2a_wait(got, group))

    @staticmethod
    def backward(ctx, grad, _):
        return _before(ctx, grad), _a2a_issue(grad, *ctx.args), None, None


class PendingAllToAll:
    """An ``all_to_all_many`` issued by :func:`all_to_all_many_start`; :meth:`wait` gives its
    results. Wait once, on every rank in the same order as the issues."""

    def __init__(self, got: torch.Tensor, xs: list[torch.Tensor], srcs, dsts, sizes: list[int],
                 parts: int, group: str) -> None:
        # shapes and dtypes only: holding the tensors would keep them alive until the wait
        self._got, self._shapes = got, [list(_pairs(x).shape) for x in xs]
        self._complex = [x.is_complex() for x in xs]
        self._srcs, self._dsts, self._sizes = list(srcs), list(dsts), sizes
        self._parts, self._group = parts, group

    def wait(self) -> list[torch.Tensor]:
        parts = self._parts
        got = _ordered(_AllToAllWait, self._got, parts, self._group).reshape(parts, -1)
        pieces = torch.split(got, self._sizes, dim=1) if len(self._sizes) > 1 else [got]
        out = [_unpack(p, shape, s, d, parts)
               for p, shape, s, d in zip(pieces, self._shapes, self._srcs, self._dsts)]
        return [torch.view_as_complex(y.contiguous()) if c else y
                for y, c in zip(out, self._complex)]


def all_to_all_many_start(xs: list[torch.Tensor], srcs, dsts, parts: int,
                          group: str) -> PendingAllToAll:
    """``all_to_all_many`` issued now and finished by ``.wait()``: the same buffer, the same
    results (bit for bit), but the work between the two calls runs while the exchange is in
    flight, and in backward the gradients' reverse exchange is in flight during the backward
    of that work. Under ``torch.compile`` the issue and the wait are the graph's
    ``all_to_all_single`` and ``wait_tensor`` nodes, in that order.

    Example::

        a = all_to_all_many_start([q0, k0, v0], [(2, 1)] * 3, [(1, 1)] * 3, 4, group)
        b = all_to_all_many_start([q1], [(2, 1)], [(1, 1)], 4, group)
        q0h, k0h, v0h = a.wait()          # b is in flight while group 0 attends
    """
    pairs = [_pairs(x) for x in xs]
    packed = [_pack(x, d, parts) for x, d in zip(pairs, dsts)]
    sizes = [p.shape[1] for p in packed]
    buf = torch.cat(packed, dim=1) if len(packed) > 1 else packed[0]
    got = _AllToAllIssue.apply(buf, parts, group)
    return PendingAllToAll(got, xs, srcs, dsts, sizes, parts, group)


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


# -- sharded parameters (spdsl.state): gathered before use, gradient reduce-scattered ---------
# Custom ops, so that the remat policy can tell a parameter gather (recomputed in backward:
# the whole parameter is never kept between forward and backward) from an activation's
# collective (kept), and so that compiled graphs carry them as single nodes.

def _rows_of(rows: int, world: int) -> int:
    return -(-rows // world)


@torch.library.custom_op("spdsl::gather_param", mutates_args=())
def gather_param(x: torch.Tensor, rows: int, world: int, rank: int, group: str,
                 reduce: bool) -> torch.Tensor:
    """This rank's rows of a parameter split along dim 0 over ``world`` ranks -> the whole
    parameter. Backward: ``reduce`` -- one reduce-scatter (sum) of the gradient, which is a
    partial sum on every rank; else the gradient is whole on every rank: take the rows."""
    chunk = _rows_of(rows, world)
    if x.shape[0] < chunk:    # uneven split (torch.chunk-style): every rank sends ``chunk`` rows
        x = torch.cat([x, x.new_zeros((chunk - x.shape[0], *x.shape[1:]))])
    full = _all_gather_raw(x, group)
    return full[:rows].clone() if full.shape[0] != rows else full


@gather_param.register_fake
def _(x, rows, world, rank, group, reduce):
    return x.new_empty((rows, *x.shape[1:]))


@torch.library.custom_op("spdsl::param_grad", mutates_args=())
def param_grad(g: torch.Tensor, local_rows: int, rows: int, world: int, rank: int, group: str,
               reduce: bool) -> torch.Tensor:
    """The backward of ``gather_param``: the gradient of this rank's rows."""
    chunk = _rows_of(rows, world)
    if not reduce:
        lo = min(rank * chunk, rows)
        return g[lo:lo + local_rows].clone()
    if g.shape[0] < chunk * world:
        g = torch.cat([g, g.new_zeros((chunk * world - g.shape[0], *g.shape[1:]))])
    mine = _reduce_scatter_raw(g.contiguous(), group)
    return mine[:local_rows].clone() if local_rows != chunk else mine


@param_grad.register_fake
def _(g, local_rows, rows, world, rank, group, reduce):
    return g.new_empty((local_rows, *g.shape[1:]))


def _gather_param_setup(ctx, inputs, output):
    x, rows, world, rank, group, reduce = inputs
    ctx.args = (x.shape[0], rows, world, rank, group, reduce)


def _gather_param_backward(ctx, grad):
    return (torch.ops.spdsl.param_grad(grad.contiguous(), *ctx.args), None, None, None, None,
            None)


gather_param.register_autograd(_gather_param_backward, setup_context=_gather_param_setup)


# -- sequence mixers' states (spdsl.lower.mixers) ---------------------------------------------
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
    every rank reads differently, as the states a sequence mixer passes."""
    return _ordered(_GatherPieces, x, group)


# -- agreements: what the ranks' hosts compare or share ------------------------------------
# Plain process-group calls outside any graph and any autograd (checks that the ranks agree,
# objects one rank decides, the ring groups made, barriers), here with the rest of what spdsl
# says to other ranks. ``group``: a process group, None for every rank of the job.

def gather_each(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``t`` (the same shape and dtype on each), in rank order."""
    every = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, t, group=group)
    return every


def reduce_(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """``t`` summed (``op="sum"``) or its largest (``"max"``) over the ranks, in place."""
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op],
                    group=group)
    return t


def broadcast_(t: torch.Tensor, group=None) -> torch.Tensor:
    """The group's first rank's ``t`` on every rank, in place."""
    dist.broadcast(t, group=group, group_src=0)
    return t


def share(obj, group=None):
    """The group's first rank's ``obj`` (anything picklable) on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def barrier(group=None) -> None:
    dist.barrier(group=group)


def new_group(members: list[int]):
    """A process group of ``members`` (global ranks); every rank of the job must call it, for
    every group, in the same order."""
    return dist.new_group(members)
