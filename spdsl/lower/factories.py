"""Build replicated constants already split: ``take(f(arange(S)))`` -> ``f(arange(lo, hi))``.

A value made from nothing (positions, RoPE tables, masks) is replicated: the propagation gives
every rank the global tensor and slices it where it meets the split sequence (``take``, free in
bytes). In memory it is not free: Llama's ``cos``/``sin`` tables are f32 ``[S, head_dim]``, 512
MiB each at a million tokens, on every rank, kept until backward by the views taken of them.
This pass moves the slice up the chain to the factory, so each rank computes its own rows only.

It applies where every step is row-wise along the sliced dim: pointwise ops (broadcast operands
that do not vary along it stay whole), casts, ``unsqueeze``, ``reshape``/``view``/``expand``
that keep the dim, ``permute``/``transpose``, ``cat`` and ``slice`` along other dims, down to an
integer ``arange``. The chain must need no gradient (no input that requires grad) and the slice
must be a plain contiguous range (``outer == inner == 1``); anything else keeps the global
tensor. Values are identical: each row is computed by the same ops from the same position.
"""

from __future__ import annotations

import math
import operator

import torch

import spdsl.collectives as C
from spdsl._torch import OpOverload
from spdsl.propagate.placement import chunk_bounds

aten = torch.ops.aten
VAL = "spdsl_replicated_val"     # set by the lowering on local nodes of replicated values
_ARANGE = (aten.arange.default, aten.arange.start, aten.arange.start_step)
_SAME_ROWS = (aten._to_copy.default, aten.alias.default, aten.clone.default)


def split_factories(graph: torch.fx.Graph, parts: int, rank: int) -> int:
    """Rewrite every eligible ``take`` of ``graph``; returns how many were rewritten."""
    done, memo = 0, {}
    takes = [n for n in graph.nodes if n.target is C.take]
    const = _constant_nodes(graph) if takes else set()
    for t in takes:
        x, (dim, outer, size, inner) = t.args[0], t.args[1]
        if outer != 1 or inner != 1 or x not in const:
            continue
        lo, hi = chunk_bounds(size, t.args[2], t.args[3])    # the take's own axis and rank
        local = _Rows(graph, lo, hi, size, memo.setdefault((lo, hi, size), {})).push(x, dim)
        if local is None:
            continue
        t.replace_all_uses_with(local)
        graph.erase_node(t)
        done += 1
    if done:
        _drop_dead(graph)
    return done


def _constant_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes no gradient flows through: every graph input they derive from needs none."""
    const: set[torch.fx.Node] = set()
    for n in graph.nodes:     # topological order: inputs are decided before their users
        if n.op == "placeholder":
            if n.meta.get("spdsl_requires_grad") is False:
                const.add(n)
        elif n.op == "call_function" and all(a in const for a in n.all_input_nodes):
            const.add(n)
    return const


class _Rows:
    """Rows ``[lo, hi)`` along one dim of a value, computed from its sources' rows."""

    def __init__(self, graph: torch.fx.Graph, lo: int, hi: int, size: int, memo: dict) -> None:
        self.graph, self.lo, self.hi, self.size, self.memo = graph, lo, hi, size, memo

    def push(self, n: torch.fx.Node, d: int) -> torch.fx.Node | None:
        key = (n, d, self.lo, self.hi, self.size)
        if key not in self.memo:
            self.memo[key] = self._push(n, d)
        return self.memo[key]

    def _call(self, target, args, kwargs, like: torch.fx.Node) -> torch.fx.Node:
        """The rows version of ``like``, right after it (so before the layers that use it)."""
        with self.graph.inserting_after(like):
            node = self.graph.call_function(target, tuple(args), dict(kwargs or {}))
        node.meta.update({k: v for k, v in like.meta.items() if k != VAL})
        return node

    def _push(self, n: torch.fx.Node, d: int) -> torch.fx.Node | None:
        val = n.meta.get(VAL)
        if n.op != "call_function" or not isinstance(val, torch.Tensor):
            return None
        d %= max(val.dim(), 1)
        if val.dim() == 0 or val.shape[d] != self.size:
            return None
        op, args, kw = n.target, list(n.args), dict(n.kwargs)
        if op in _ARANGE:
            return self._arange(n, op, args, kw) if d == 0 else None
        if _seeded(op):
            return None           # random rows: a slice of the global draw is not a new draw
        if op in _SAME_ROWS or (isinstance(op, OpOverload)
                                and torch.Tag.pointwise in op.tags):
            return self._pointwise(n, d, val)
        if op is aten.unsqueeze.default:
            k = args[1] % val.dim()
            if k == d:
                return None
            src = self.push(args[0], d if d < k else d - 1)
            return src and self._call(op, [src, args[1]], kw, n)
        if op in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
            return self._reshape(n, d, val, args, kw)
        if op is aten.expand.default:
            src_val = args[0].meta.get(VAL)
            if not isinstance(src_val, torch.Tensor):
                return None
            k = d - (val.dim() - src_val.dim())
            shape = list(args[1])
            shape[d] = self.hi - self.lo
            if k < 0 or src_val.shape[k] == 1:
                return self._call(op, [args[0], shape] + args[2:], kw, n)
            src = self.push(args[0], k)
            return src and self._call(op, [src, shape] + args[2:], kw, n)
        if op is aten.permute.default:
            src = self.push(args[0], args[1][d] % val.dim())
            return src and self._call(op, [src] + args[1:], kw, n)
        if op in (aten.transpose.int, aten.t.default):
            a, b = (0, 1) if op is aten.t.default else (args[1] % val.dim(), args[2] % val.dim())
            src = self.push(args[0], b if d == a else a if d == b else d)
            return src and self._call(op, [src] + args[1:], kw, n)
        if op is aten.cat.default:
            cdim = (args[1] if len(args) > 1 else kw.get("dim", 0)) % val.dim()
            if cdim == d:
                return None
            srcs = [self.push(t, d) for t in args[0]]
            return None if any(s is None for s in srcs) else \
                self._call(op, [srcs] + args[1:], kw, n)
        if op is aten.slice.Tensor:
            if args[1] % val.dim() == d:
                return None
            src = self.push(args[0], d)
            return src and self._call(op, [src] + args[1:], kw, n)
        return None

    def _arange(self, n, op, args, kw) -> torch.fx.Node | None:
        if op is aten.arange.default:
            start, end, step = 0, args[0], 1
        elif op is aten.arange.start:
            start, end, step = args[0], args[1], 1
        else:
            start, end, step = args
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end, step)):
            return None           # float bounds: rows of arange(lo, hi) could round apart
        return self._call(aten.arange.start_step,
                          [start + self.lo * step, start + self.hi * step, step], kw, n)

    def _pointwise(self, n, d: int, val: torch.Tensor) -> torch.fx.Node | None:
        new_args = []
        for a in n.args:
            a_val = a.meta.get(VAL) if isinstance(a, torch.fx.Node) else None
            if isinstance(a, torch.fx.Node) and not isinstance(a_val, torch.Tensor):
                return None                        # not known to be replicated
            if not isinstance(a_val, torch.Tensor):
                if isinstance(a, (list, tuple)) and any(isinstance(x, torch.fx.Node) for x in a):
                    return None
                new_args.append(a)
                continue
            k = d - (val.dim() - a_val.dim())      # broadcasting aligns dims on the right
            if k < 0 or a_val.shape[k] == 1:
                new_args.append(a)                 # the same for every row
                continue
            src = self.push(a, k)
            if src is None:
                return None
            new_args.append(src)
        if any(isinstance(v, torch.fx.Node) for v in n.kwargs.values()):
            return None
        return self._call(n.target, new_args, n.kwargs, n)

    def _reshape(self, n, d: int, val, args, kw) -> torch.fx.Node | None:
        src_val = args[0].meta.get(VAL)
        if not isinstance(src_val, torch.Tensor):
            return None
        before = math.prod(val.shape[:d])
        for k in range(src_val.dim()):
            if math.prod(src_val.shape[:k]) == before and src_val.shape[k] == self.size:
                src = self.push(args[0], k)
                if src is None:
                    return None
                shape = list(val.shape)
                shape[d] = self.hi - self.lo
                return self._call(n.target, [src, shape] + args[2:], kw, n)
        return None


def _drop_dead(graph: torch.fx.Graph) -> None:
    """Erase the global chains nothing uses any more (pure ops only)."""
    changed = True
    while changed:
        changed = False
        for n in reversed(list(graph.nodes)):
            if n.op == "call_function" and not n.users and _pure(n):
                graph.erase_node(n)
                changed = True


def _pure(n: torch.fx.Node) -> bool:
    t = n.target
    if t is operator.getitem:
        return True
    return isinstance(t, OpOverload) and not t._schema.is_mutable and \
        "_c10d_functional" not in t.name() and not _seeded(t)   # a draw moves the RNG


def _seeded(op) -> bool:
    return isinstance(op, OpOverload) and \
        torch.Tag.nondeterministic_seeded in op.tags
