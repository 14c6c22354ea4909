"""Lowering: the global graph and its decisions -> one rank's graph over local tensors.

This is the one place where global shapes become local ones: shape arguments of views are
rewritten to the rank's local shape, redistributions become calls into ``spdsl.collectives``,
and nodes with a named lowering become calls into ``spdsl.lower.ops``. Backward is autograd's
job: every inserted call carries its own gradient rule.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch.utils._pytree import tree_map

from spdsl import collectives as C
from spdsl.lower import ops
from spdsl.lower.factories import VAL as REPLICATED_VAL
from spdsl.lower.factories import split_factories
from spdsl.propagate.engine import Propagator, tensor_inputs
from spdsl.propagate.placement import (
    Partial,
    Placement,
    Replicate,
    Shard,
    chunk_bounds,
    local_shape,
)

aten = torch.ops.aten


class Lowering:
    def __init__(self, prop: Propagator, rank: int, group: str) -> None:
        self.prop, self.parts, self.rank, self.group = prop, prop.parts, rank, group
        self.graph = torch.fx.Graph()
        self.env: dict[torch.fx.Node, torch.fx.Node] = {}
        self.marked: dict[torch.fx.Node, torch.fx.Node] = {}

    def call(self, fn, *args) -> torch.fx.Node:
        return self.graph.call_function(fn, tuple(args))

    def redistribute(self, x: torch.fx.Node, src: Placement, dst: Placement,
                     meta: torch.Tensor) -> torch.fx.Node:
        if src == dst or self.parts == 1:
            return x
        P, r, g = self.parts, self.rank, self.group
        shape = tuple(meta.shape)
        if isinstance(src, Partial):
            x = self.call(C.all_reduce, x, g)
            src = Replicate()
            if src == dst:
                return x
        if isinstance(src, Replicate) and isinstance(dst, Shard):
            return self.call(C.take, x, (dst.dim, dst.outer, dst.size, dst.inner(shape)), P, r, g)
        if isinstance(src, Shard) and isinstance(dst, Replicate):
            return self.call(C.gather, x, (src.dim, src.outer, src.size, src.inner(shape)), P, r, g)
        if isinstance(src, Shard) and isinstance(dst, Shard):
            return self.call(C.all_to_all, x, (src.dim, src.outer), (dst.dim, dst.outer), P, g)
        raise AssertionError(f"no redistribution {src} -> {dst}")

    def _inputs(self, node: torch.fx.Node) -> dict[int, torch.fx.Node]:
        d = self.prop.decisions[node]
        out = {}
        ins = tensor_inputs(node)
        fused = self._fused_all_to_all(d, ins)
        for i, a in enumerate(ins):
            x = self.env[a]
            if i in fused:
                x = fused[i]
            elif i in d.redistribute:
                src, dst = d.redistribute[i]
                x = self.redistribute(x, src, dst, a.meta["val"])
                if i in d.grad_reduce and self.parts > 1:
                    x = self.call(C.grad_all_reduce, x, self.group)
            elif i in d.grad_reduce and self.parts > 1:
                if a not in self.marked:      # one gradient all-reduce per replicated value
                    self.marked[a] = self.call(C.grad_all_reduce, self.env[a], self.group)
                x = self.marked[a]
            out[i] = x
        return out

    def _fused_all_to_all(self, d, ins) -> dict[int, torch.fx.Node]:
        """Several operands of one op changing split dims (q and k of a score) share one
        all-to-all."""
        moves = {i: sd for i, sd in d.redistribute.items()
                 if isinstance(sd[0], Shard) and isinstance(sd[1], Shard) and sd[0] != sd[1]}
        if len(moves) < 2 or self.parts == 1:
            return {}
        idx = sorted(moves)
        xs = [self.env[ins[i]] for i in idx]
        srcs = [(moves[i][0].dim, moves[i][0].outer) for i in idx]
        dsts = [(moves[i][1].dim, moves[i][1].outer) for i in idx]
        many = self.call(C.all_to_all_many, xs, srcs, dsts, self.parts, self.group)
        return {i: self.call(operator.getitem, many, k) for k, i in enumerate(idx)}

    def _args(self, node: torch.fx.Node, local: dict[int, torch.fx.Node]):
        counter = iter(range(10 ** 9))

        def sub(a: Any) -> Any:
            if isinstance(a, torch.fx.Node):
                if isinstance(a.meta.get("val"), torch.Tensor):
                    return local[next(counter)]
                return self.env[a]
            return a
        return tree_map(sub, node.args), tree_map(sub, node.kwargs)

    def lower(self, out_placements: list[Placement]) -> torch.fx.GraphModule:
        for node in self.prop.gm.graph.nodes:
            if node.op == "placeholder":
                self.env[node] = self.graph.placeholder(node.name)
                val = node.meta.get("val")
                if isinstance(val, torch.Tensor):   # what this rank is passed
                    shape = local_shape(val.shape, self.prop.placement(node), self.parts,
                                        self.rank)
                    self.env[node].meta["spdsl_local"] = (tuple(shape), val.dtype)
                self.env[node].meta["spdsl_requires_grad"] = node.meta.get("spdsl_requires_grad")
                self._note_replicated(node)
            elif node.op == "get_attr":
                self.env[node] = self.graph.get_attr(node.target)
            elif node.op == "call_function":
                start = len(self.graph.nodes)
                self.env[node] = self._node(node)
                self._note_replicated(node)
                for i, new in enumerate(self.graph.nodes):
                    if i >= start:   # module path and source travel to the local nodes
                        new.meta.setdefault("spdsl_module", node.meta.get("spdsl_module", ""))
                        new.meta.setdefault("stack_trace", node.meta.get("stack_trace"))
                        new.meta.setdefault("spdsl_origin", node.name)
            elif node.op == "output":
                outs = []
                for o, want in zip(node.args[0], out_placements):
                    x = self.env[o]
                    if isinstance(o.meta.get("val"), torch.Tensor):
                        x = self.redistribute(x, self.prop.placement(o), want, o.meta["val"])
                    outs.append(x)
                self.graph.output(outs)
        if self.parts > 1:
            split_factories(self.graph, self.parts, self.rank)
        bucket_gradient_reduces(self.graph)
        gm = torch.fx.GraphModule(self.prop.gm, self.graph)
        return gm

    def _note_replicated(self, node: torch.fx.Node) -> None:
        """A replicated tensor's local value is its global one: kept for later passes."""
        val, d = node.meta.get("val"), self.prop.decisions.get(node)
        if isinstance(val, torch.Tensor) and d is not None and isinstance(d.output, Replicate):
            self.env[node].meta[REPLICATED_VAL] = val

    def _node(self, node: torch.fx.Node) -> torch.fx.Node:
        if node.target is operator.getitem:
            return self.call(operator.getitem, self.env[node.args[0]], node.args[1])
        d = self.prop.decisions.get(node)
        if d is None:
            args, kwargs = tree_map(lambda a: self.env[a] if isinstance(a, torch.fx.Node) else a,
                                    (node.args, node.kwargs))
            return self.graph.call_function(node.target, args, kwargs)
        local = self._inputs(node)
        args, kwargs = self._args(node, local)
        low = d.strategy.lowering
        if self.parts == 1 and low not in ("view", "constraint", "ulysses"):
            low = None
        meta = node.meta["val"]
        P, r, g = self.parts, self.rank, self.group
        if low == "view":
            shape = local_shape(meta.shape, d.output, P, r)
            # local pieces need not be contiguous where the global value was: reshape
            target = aten.expand.default if node.target is aten.expand.default else \
                aten.reshape.default
            return self.graph.call_function(target, (args[0], shape) + tuple(args[2:]), kwargs)
        if low == "constraint" or node.target is torch.ops.spdsl.constraint.default:
            return args[0]
        if low == "ulysses":
            a = list(args) + [None] * (8 - len(args))
            q, k, v, mask, dropout_p, is_causal, scale, gqa = a[:8]
            return self.call(ops.ulysses_attention, q, k, v, mask, dropout_p or 0.0,
                             bool(is_causal), scale, bool(gqa), P, r, g)
        if low == "nll_mean":
            two_d = node.target.overloadpacket is aten.nll_loss2d_forward
            return self.call(ops.nll_mean, args[0], args[1], args[2], args[4], g, two_d)
        if low == "mean_partial":
            src = node.args[0].meta["val"]
            dims = node.args[1] if len(node.args) > 1 else None
            dims = list(range(src.dim())) if not dims else [x % src.dim() for x in dims]
            keep = node.args[2] if len(node.args) > 2 else False
            count = math.prod(src.shape[x] for x in dims)
            return self.call(ops.mean_partial, args[0], dims, keep, count,
                             node.kwargs.get("dtype"))
        if low == "loss_mean":
            count = node.args[0].meta["val"].numel()
            return self.call(ops.loss_mean, node.target, tuple(args), count)
        if low == "slice_window":
            src = node.args[0].meta["val"]
            dim = node.args[1] % src.dim()
            start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
            start = max(0, start + src.shape[dim]) if start < 0 else min(start, src.shape[dim])
            return self.call(C.window, args[0], dim, src.shape[dim], start, meta.shape[dim], P, r,
                             g)
        if low == "select_owner":
            src = node.args[0].meta["val"]
            dim = node.args[1] % src.dim()
            index = node.args[2] % src.shape[dim]
            lo, hi = chunk_bounds(src.shape[dim], P, r)
            return self.call(ops.select_owner, args[0], dim, index, lo, hi)
        if node.target is torch.ops.spdsl.attention.default:    # replicated attention
            return self.graph.call_function(ops.local_attention, args, kwargs)
        return self.graph.call_function(node.target, args, kwargs)


GRAD_BUCKET_BYTES = 32 * 2 ** 20


def bucket_gradient_reduces(graph: torch.fx.Graph, cap: int = GRAD_BUCKET_BYTES) -> int:
    """Fold the gradient all-reduces of graph inputs (parameters) into buckets of up to
    ``cap`` bytes, one ``grad_all_reduce_many`` each; returns the number of buckets.

    A marker on a value computed from one parameter alone (``t(w)``) moves to the parameter
    when nothing else uses that chain: the gradient map of replicated inputs is the same on
    every rank, so summing before or after it is the same sum. A parameter's gradient is
    complete once backward has passed its first use, so buckets are
    filled in reverse order of first use (the last layer's weights first) and grouped by dtype;
    a bucket reduces when its last gradient is known. The calls sit after the placeholders,
    outside every layer (checkpointed regions never re-run them). A parameter read only
    through ``detach()`` gets no marker: it keeps no gradient, eager or compiled.
    """
    nodes = [m for m in (_marker_on_input(graph, n) for n in list(graph.nodes)
                         if n.target is C.grad_all_reduce) if m is not None]
    live = _reaching_output(graph)
    for n in [n for n in nodes if n not in live]:    # read only through detach()
        n.replace_all_uses_with(n.args[0])
        graph.erase_node(n)
        nodes.remove(n)
    if not nodes:
        return 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    nodes.sort(key=lambda n: min(order[u] for u in n.users), reverse=True)
    buckets: list[list[torch.fx.Node]] = []
    filling: dict[torch.dtype | None, tuple[list[torch.fx.Node], int]] = {}   # per dtype
    for n in nodes:
        shape, dtype = n.args[0].meta.get("spdsl_local", ((), None))
        size = math.prod(shape) * (dtype.itemsize if dtype is not None else 0)
        bucket, used = filling.get(dtype, (None, 0))
        if bucket is None or used + size > cap:
            bucket, used = [], 0
            buckets.append(bucket)
        bucket.append(n)
        filling[dtype] = (bucket, used + size)
    anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for bucket in buckets:
        group = bucket[0].args[1]
        with graph.inserting_after(anchor):
            many = graph.call_function(C.grad_all_reduce_many,
                                       ([n.args[0] for n in bucket], group))
        anchor = many
        for k, n in enumerate(bucket):
            with graph.inserting_after(anchor):
                item = graph.call_function(operator.getitem, (many, k))
            item.meta.update(n.meta)
            item.meta["spdsl_module"] = ""
            anchor = item
            n.replace_all_uses_with(item)
            graph.erase_node(n)
        many.meta.update(spdsl_module="", spdsl_origin="gradient bucket",
                         stack_trace=None)
    return len(buckets)


def _reaching_output(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes a gradient can flow back into: some path of uses reaches the output without
    passing a ``detach``. One pass, in reverse order."""
    live: set[torch.fx.Node] = set()
    for n in reversed(graph.nodes):
        if n.op == "output" or any(u in live and u.target is not aten.detach.default
                                   for u in n.users):
            live.add(n)
    return live


def _marker_on_input(graph: torch.fx.Graph, n: torch.fx.Node) -> torch.fx.Node | None:
    """The gradient marker ``n`` moved onto the graph input it derives from (see above), or
    None where it derives from data or its chain has other users."""
    chain, a = [], n.args[0]
    while a.op == "call_function" and len(a.users) == 1 and len(a.all_input_nodes) == 1:
        chain.append(a)
        a = a.all_input_nodes[0]
    if a.op != "placeholder" or not n.users:
        return None
    if not chain:
        return n
    with graph.inserting_after(a):
        moved = graph.call_function(C.grad_all_reduce, (a, n.args[1]))
    moved.meta.update(n.meta)
    chain[-1].replace_input_with(a, moved)
    n.replace_all_uses_with(n.args[0])
    graph.erase_node(n)
    return moved


def lower(prop: Propagator, rank: int, group: str,
          out_placements: list[Placement]) -> torch.fx.GraphModule:
    """The local graph of ``rank`` (``group``: the axis' process group name)."""
    return Lowering(prop, rank, group).lower(out_placements)
