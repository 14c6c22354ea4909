"""Gradient all-reduces of parameters folded into buckets, each issued in backward as soon as
its parameters' gradients are complete (``bucket_gradient_reduces``); a gradient marker on a
value computed from one parameter alone moved onto the parameter (``move_markers_to_inputs``).
Both run on a rank's lowered graph (``spdsl.lower.graph``). A segment's program (a forward that
reads values) has its buckets merged with the other segments' in backward
(``merge_buckets``, applied by the pipeline)."""

from __future__ import annotations

import math
import operator

import torch

import spdsl.collectives as C
from spdsl.lower.layers import layer_of
from spdsl.propagate.engine import gradient_reaches

GRAD_BUCKET_BYTES = 32 * 2 ** 20
MERGED = "merged gradient bucket"       # a merged bucket's origin, as the plan lists it


def bucket_gradient_reduces(graph: torch.fx.Graph, cap: int | None = None) -> int:
    """Fold the gradient all-reduces of graph inputs (parameters) into buckets of up to
    ``cap`` bytes (default :data:`GRAD_BUCKET_BYTES`, read when called), one
    ``grad_all_reduce_many`` each; returns the number of buckets.

    A marker on a value computed from one parameter alone (``t(w)``) moves to the parameter
    when nothing else uses that chain: the gradient map of replicated inputs is the same on
    every rank, so summing before or after it is the same sum. A parameter's gradient is
    complete once backward has passed its first use, so buckets are
    filled in reverse order of first use (the last layer's weights first) and grouped by dtype;
    a bucket reduces when its last gradient is known. Each bucket's call sits just before the
    first use of its parameters, in that use's layer: collectives are issued in backward in the
    reverse of their forward order (``collectives.backward_order``), so a bucket placed there
    is issued as soon as backward has passed those uses, while earlier layers' backward still
    runs (placed at the start, every bucket would wait for the backward of the step's first
    collective). Its forward is an identity: a checkpointed layer that recomputes it issues
    nothing. A parameter read only through ``detach()`` gets no marker: it keeps no gradient,
    eager or compiled.
    """
    cap = GRAD_BUCKET_BYTES if cap is None else cap
    nodes = [m for m in (_marker_on_input(graph, n) for n in list(graph.nodes)
                         if n.target is C.grad_all_reduce) if m is not None]
    nodes = [n for n in nodes if n.args[0].op == "placeholder"]
    live = gradient_reaches(graph)
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
        kind = (dtype, n.args[1])          # one dtype and one group per bucket
        bucket, used = filling.get(kind, (None, 0))
        if bucket is None or used + size > cap:
            bucket, used = [], 0
            buckets.append(bucket)
        bucket.append(n)
        filling[kind] = (bucket, used + size)
    for bucket in buckets:
        group = bucket[0].args[1]
        first = min((u for n in bucket for u in n.users), key=order.__getitem__)
        layer = layer_of(first.meta.get("spdsl_module", "")) or ""
        with graph.inserting_before(first):
            many = graph.call_function(C.grad_all_reduce_many,
                                       ([n.args[0] for n in bucket], group))
        anchor = many
        for k, n in enumerate(bucket):
            with graph.inserting_after(anchor):
                item = graph.call_function(operator.getitem, (many, k))
            item.meta.update(n.meta)
            item.meta["spdsl_module"] = layer
            anchor = item
            n.replace_all_uses_with(item)
            graph.erase_node(n)
        many.meta.update(spdsl_module=layer, spdsl_origin="gradient bucket",
                         stack_trace=None)
    return len(buckets)


def merge_buckets(gm: torch.fx.GraphModule, cap: int | None = None) -> int:
    """Mark every gradient bucket of ``gm`` (a segment's program) merged: in backward it is
    held and reduced with the merged buckets of the segments after it, one all-reduce of up to
    ``cap`` bytes (default :data:`GRAD_BUCKET_BYTES`, read when called) instead of one per
    segment (``spdsl.collectives.grads``); returns the number marked. Under ``torch.compile``
    the compiled backward reduces each bucket where it is: not to be marked there.

    Example::

        lowered = lower(...)              # a segment's rank program
        merge_buckets(lowered)            # its buckets reduced with the next segments'
    """
    cap = GRAD_BUCKET_BYTES if cap is None else cap
    marked = 0
    for n in gm.graph.nodes:
        if n.target is C.grad_all_reduce_many:
            n.args = (*n.args[:2], cap)
            n.meta["spdsl_origin"] = MERGED
            marked += 1
    if marked:
        gm.recompile()
    return marked


def move_markers_to_inputs(graph: torch.fx.Graph) -> None:
    """Move each gradient marker on a chain computed from one parameter alone onto the
    parameter (see ``bucket_gradient_reduces``)."""
    for n in list(graph.nodes):
        if n.target is C.grad_all_reduce:
            _marker_on_input(graph, n)


def _marker_on_input(graph: torch.fx.Graph, n: torch.fx.Node) -> torch.fx.Node | None:
    """The gradient marker ``n`` moved onto the graph input it derives from (see above), or
    None where it derives from data or its chain has other users."""
    chain, a = [], n.args[0]
    # a collective's backward differs by rank (a gather's slices the rank's rows): the sum
    # must be taken after it, where autograd meets it first
    while a.op == "call_function" and len(a.users) == 1 and len(a.all_input_nodes) == 1 \
            and a.target is not torch.ops.spdsl.gather_param.default \
            and getattr(a.target, "__module__", None) != C.__name__:
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
