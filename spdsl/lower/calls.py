"""What each collective-issuing call of a local program runs: one registry, read by the plan.

The lowering writes calls into ``spdsl.collectives`` and ``spdsl.lower.ops``; remat and
compile keep them. :func:`describe` maps one such call node (its arguments' ``meta["val"]``
filled by ``spdsl.lower.shapes.fill_shapes``) to the collectives it runs on this rank: kind,
process group, bytes of the buffer handed to the process group in forward and in backward,
and what it is for. ``spdsl.inspect.program`` walks a whole program with it, so the plan lists
exactly the calls that run, one entry each:

=========================  =====================  ==================================
call                       forward                backward (where a gradient flows)
=========================  =====================  ==================================
``all_to_all(_many)``      all-to-all (inputs)    all-to-all of the same size
``rechunk``                all-to-all             all-to-all
``window``                 halo all-to-all        halo all-to-all back (rows received)
``all_reduce``             all-reduce             --
``reduce_scatter``         reduce-scatter         all-gather (the local chunk)
``gather`` / ``take``      all-gather / --        -- / all-gather
``grad_all_reduce``        --                     all-reduce
``grad_all_reduce_many``   --                     one all-reduce: the bucket
``gather_param``           all-gather (rows)      reduce-scatter when it reduces
Ulysses attention ops      2 per head group       2 per head group
``nll_mean``               all-reduce (2 elems)   --
=========================  =====================  ==================================

A new op that issues collectives registers a describer beside its definition::

    from spdsl.lower.calls import Call, nbytes, register

    @register(ring_attention)               # the function the lowering calls
    def _(node, grad):                      # grad(x): does x need a gradient
        q, k, v = (a.meta["val"] for a in node.args[:3])
        group, parts = node.args[6], node.args[4]
        kv = nbytes(k) + nbytes(v)
        return [Call("send_recv", group, kv, kv if grad(node) else 0, "ring", node.args[1:3])
                for _ in range(parts - 1)]

``values`` are the argument nodes carried (the plan prints their typed shapes), ``(node,
note)`` pairs (the note printed after the shape), or strings printed as they are (``{axis}``
replaced by the group's axis). A call whose describer returns
``[]`` runs nothing on this rank (one rank, or nothing to exchange).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import spdsl.collectives as C
from spdsl.lower import loss as L
from spdsl.lower import ops
from spdsl.propagate.heads import kv_repeat
from spdsl.propagate.placement import dtype_name, window_plan


@dataclass(frozen=True)
class Call:
    """One collective of a local call node: ``bytes`` of the buffer given to the process group
    in forward, ``bytes_bwd`` in backward (0: none there); ``values``: the argument nodes it
    carries (or names, for a gradient bucket's parameters)."""

    kind: str
    group: str
    bytes: int
    bytes_bwd: int
    purpose: str
    values: tuple[Any, ...] = ()


Describer = Callable[[torch.fx.Node, Callable[[Any], bool]], Sequence[Call]]
_REGISTRY: dict[Any, Describer] = {}


def register(*targets: Any) -> Callable[[Describer], Describer]:
    """Register ``describer(node, grad) -> [Call, ...]`` for call nodes of ``targets``."""
    def wrap(fn: Describer) -> Describer:
        for t in targets:
            _REGISTRY[t] = fn
        return fn
    return wrap


def issues_collectives(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in _REGISTRY


def describe(node: torch.fx.Node, grad: Callable[[Any], bool]) -> list[Call]:
    """The collectives call ``node`` runs (see the module's table); ``grad(x)``: whether
    ``x`` (a node) needs a gradient."""
    fn = _REGISTRY.get(node.target) if node.op == "call_function" else None
    return [c for c in fn(node, grad) if c.bytes or c.bytes_bwd] if fn is not None else []


def nbytes(x: Any) -> int:
    """Bytes of a node's (or a tensor's) value; 0 where it holds no tensor."""
    v = x.meta.get("val") if isinstance(x, torch.fx.Node) else x
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _back(grad, *xs) -> bool:
    return any(grad(x) for x in xs)


@register(C.all_to_all)
def _all_to_all(node, grad):
    x, group = node.args[0], node.args[4]
    b = nbytes(x)
    return [Call("all_to_all", group, b, b if grad(x) else 0, "ulysses", (x,))]


@register(C.all_to_all_many)
def _all_to_all_many(node, grad):
    xs, group = list(node.args[0]), node.args[4]
    b = sum(nbytes(x) for x in xs)
    return [Call("all_to_all", group, b, b if _back(grad, *xs) else 0, "ulysses", tuple(xs))]


@register(C.rechunk)
def _rechunk(node, grad):
    x, group = node.args[0], node.args[6]
    b = nbytes(x)
    return [Call("all_to_all", group, b, b if grad(x) else 0, "ulysses", (x,))]


@register(C.all_reduce)
def _all_reduce(node, grad):
    x, group = node.args
    return [Call("all_reduce", group, nbytes(x), 0, "reshard", (x,))]


def _chunk_bytes(x, split: tuple, parts: int) -> int:
    """Bytes of one rank's chunk of ``split = (dim, outer, size, inner)``, padded to the
    largest (what every rank hands over), whether ``x`` holds the whole dim or a chunk."""
    dim, outer, size, inner = split
    v = x.meta["val"]
    # bytes of one row of ``size`` from the shape: a rank may hold none (a dim shorter than
    # the ranks), and still hands over a padded chunk
    row = v.element_size() * outer * inner * math.prod(v.shape[:dim] + v.shape[dim + 1:])
    return -(-size // parts) * row


@register(C.reduce_scatter)
def _reduce_scatter(node, grad):
    x, split, parts, _rank, group = node.args
    chunk = _chunk_bytes(x, split, parts)
    return [Call("reduce_scatter", group, chunk * parts, 0, "reshard", (x,)),
            Call("all_gather", group, 0, chunk if grad(x) else 0, "reshard", (x,))]


@register(C.gather)
def _gather(node, grad):
    x, split, parts, _rank, group = node.args
    return [Call("all_gather", group, _chunk_bytes(x, split, parts), 0, "reshard", (x,))]


@register(C.take)
def _take(node, grad):
    x, split, parts, _rank, group = node.args
    return [Call("all_gather", group, 0, _chunk_bytes(x, split, parts) if grad(x) else 0,
                 "reshard", (x,))]


@register(C.grad_all_reduce)
def _grad_all_reduce(node, grad):
    x, group = node.args
    return [Call("all_reduce", group, 0, nbytes(x) if grad(x) else 0, "gradient", (x,))]


@register(C.grad_all_reduce_many)
def _bucket(node, grad):
    xs, group = list(node.args[0]), node.args[1]
    seen = []
    for x in xs:                              # a value passed twice is reduced once
        if grad(x) and x not in seen:
            seen.append(x)
    return [Call("all_reduce", group, 0, sum(nbytes(x) for x in seen), "gradient",
                 tuple(seen))]


@register(C.window)
def _window(node, grad):
    x, dim, size_in, start, n_out, parts, rank, group = node.args
    plan = window_plan(size_in, start, n_out, parts)
    if plan is None:
        return []
    _own, sends = plan
    v = x.meta["val"]
    row = nbytes(x) // max(1, v.shape[dim])
    sent = sum(max(0, b - a) for a, b in sends[rank])            # this rank's buffer, itself too
    got = sum(max(0, b - a) for a, b in (sends[q][rank] for q in range(parts)))
    return [Call("halo_exchange", group, sent * row, got * row if grad(x) else 0, "halo",
                 (x,))]


@register(torch.ops.spdsl.gather_param.default)
def _gather_param(node, grad):
    x, rows, world, _rank, group, reduce = node.args
    v = x.meta["val"]
    row = nbytes(x) // max(1, v.shape[0]) if v.shape[0] else 0
    chunk = -(-rows // world) * row
    calls = [Call("all_gather", group, chunk, 0, "state", (x,))]
    if reduce and grad(x):
        calls.append(Call("reduce_scatter", group, 0, chunk * world, "state", (x,)))
    return calls


def _ulysses(node, grad, q, k, v, out, parts: int, group: str,
             pipelined: bool = True) -> list[Call]:
    if parts == 1:
        return []
    hq, hk = q.meta["val"].shape[1], k.meta["val"].shape[1]
    rep = kv_repeat(hq, hk, parts)
    back = _back(grad, q, k, v)
    groups = ops.head_groups(hq, hk, parts) if pipelined else [None]
    # the attention's own output: with the output projection fused in (spdsl.lower.project)
    # the node's value is the projection's
    fused = isinstance(out, torch.fx.Node) and "attention_val" in out.meta
    att = nbytes(out.meta["attention_val"]) if fused else nbytes(out)
    if len(groups) == 1:
        qkv = nbytes(q) + (nbytes(k) + nbytes(v)) * rep
        o = att
        kv = ((k, f" repeated x{rep}"), (v, f" repeated x{rep}")) if rep > 1 else (k, v)
        return [Call("all_to_all", group, qkv, qkv if back else 0, "ulysses", (q, *kv)),
                Call("all_to_all", group, o, o if back else 0, "ulysses", (node,))]
    # one exchange of each head group's q (and the kv heads it brings) in, one of its output
    # back: the q bytes of nq of the H_q heads, the kv bytes of P * nk of the kv heads moved
    ins, outs = [], []
    n = hq // parts
    for i, g in enumerate(groups):
        tag = f" {_heads(g.q, g.nq)} of each rank's {n}"
        b = nbytes(q) * g.nq // n
        values = [(q, tag)]
        if g.nk:
            kvb = (nbytes(k) + nbytes(v)) * parts * g.nk // hk
            b += kvb
            rk = f" repeated x{rep}" if rep > 1 else ""
            kvtag = f"{rk} kv {_heads(g.k, g.nk)}"
            values += [(k, kvtag), (v, kvtag)]
        ins.append(Call("all_to_all", group, b, b if back else 0, "ulysses", tuple(values)))
        o = att * g.nq // n
        outs.append(Call("all_to_all", group, o, o if back else 0, "ulysses",
                         ((node, f" group {i + 1} of {len(groups)}"),)))
    # in the order they are issued: group 0's input, then each group's output after the
    # next group's input
    return [ins[0]] + [c for i, o in enumerate(outs) for c in (ins[i + 1:i + 2] + [o])]


def _heads(first: int, count: int) -> str:
    return f"head {first}" if count == 1 else f"heads {first}-{first + count - 1}"


@register(ops.ulysses_attention)
def _ulysses_attention(node, grad):
    q, k, v = node.args[:3]
    return _ulysses(node, grad, q, k, v, node, node.args[8], node.args[10])


@register(ops.ulysses_attention_fn)
def _ulysses_attention_fn(node, grad):
    q, k, v = node.args[:3]
    return _ulysses(node, grad, q, k, v, node, node.args[7], node.args[9])


@register(ops.ulysses_flex)
def _ulysses_flex(node, grad):
    q, k, v = node.args[:3]
    out = node.meta.get("val")
    out = out[0] if isinstance(out, (tuple, list)) else out
    return _ulysses(node, grad, q, k, v, out, node.args[9], node.args[11], pipelined=False)


def _loss_pair(node, group) -> list[Call]:
    count = node.meta["val"][1]                 # (mean, global count): the pair's dtype
    pair = dtype_name(count.dtype) + "[2]{{sum@{axis}}}"      # (sum, count), one all-reduce
    return [Call("all_reduce", group, 2 * count.element_size(), 0, "loss", (pair,))]


@register(ops.nll_mean)
def _nll_mean(node, grad):
    return _loss_pair(node, node.args[4])


@register(L.tiled_nll_mean)
def _tiled_nll_mean(node, grad):
    return _loss_pair(node, node.args[-1])
