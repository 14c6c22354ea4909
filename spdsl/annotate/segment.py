"""The pieces a segment is made of (``spdsl.annotate.breaks``): the segment as a graph module of
its own, its structural key, the collectives that make a value whole, and the thread a segment
runs on while the function's trace is open."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as DShard

from spdsl._torch import outside_fx_trace
from spdsl.annotate.spec import P


def graph(seg: list, outs: list, root: torch.nn.Module):
    """The segment as its own graph module, its external inputs (graph nodes read from
    outside, in order) and its structural key."""
    g = torch.fx.Graph()
    m: dict = {}
    mod = torch.nn.Module()
    ext: list = []
    in_seg = set(seg)
    # inputs first: the lowering's passes read the graph's inputs before its ops
    for a in dict.fromkeys(a for n in seg for a in n.all_input_nodes if a not in in_seg):
        if a.op == "get_attr" and not isinstance(getattr(root, a.target), torch.Tensor):
            setattr(mod, a.target, getattr(root, a.target))
            m[a] = g.get_attr(a.target)
        else:
            m[a] = g.placeholder(f"in{len(ext)}")
            ext.append(a)
        m[a].meta = dict(a.meta)
    for n in seg:
        m[n] = g.node_copy(n, m.__getitem__)
    g.output([m[o] for o in outs])
    index = {n: i for i, n in enumerate(g.nodes)}
    key = tuple((n.op, str(n.target), repr(torch.fx.node.map_arg(
        (n.args, n.kwargs), lambda a: f"%{index[a]}"))) for n in g.nodes)
    return torch.fx.GraphModule(mod, g), ext, key


def made_whole(entry, node: torch.fx.Node) -> list[tuple[str, int]]:
    """The collectives of a segment's program that make ``node`` whole for Python to read:
    those at ``node`` and at the replicated ops between it and the split values it reads."""
    from spdsl.propagate.placement import Replicate
    cone, stack = {node.name}, [node]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a.op == "call_function" and a.name not in cone and \
                    isinstance(entry.prop.decisions[a].output, Replicate):
                cone.add(a.name)
                stack.append(a)
    return [(c.kind, c.bytes) for c in entry.plan.collectives
            if c.node in cone and c.purpose != "gradient"]


def seeded(n: torch.fx.Node) -> bool:
    """A random op: it runs once per call, in order, even when its value is unused."""
    t = n.target
    return torch.Tag.nondeterministic_seeded in getattr(t, "tags", ())


def spec_of(x: DTensor, axis: str) -> P | None:
    names = x.device_mesh.mesh_dim_names or ()
    p = x.placements[names.index(axis) if axis in names else 0]
    return P(*[axis if d == p.dim else None for d in range(x.dim())]) \
        if isinstance(p, DShard) else None


def spec_key(x, s) -> Any:
    if isinstance(x, DTensor):
        return ("dtensor", tuple(repr(p) for p in x.placements))
    return repr(s)


def outside(fn, grad: bool):
    """``fn()`` on a thread of its own: a value read happens inside the trace's dispatch,
    where autograd is off and fake tensors are made; the thread has neither (dispatch keys and
    modes are thread-local; the autograd graph and the random generators are shared)."""
    box: list = []

    def run() -> None:
        try:
            with torch.set_grad_enabled(grad), outside_fx_trace():
                box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - raised again on the calling thread
            box.append((False, e))

    t = threading.Thread(target=run, name="spdsl-segment")
    t.start()
    t.join()
    ok, out = box[0]
    if not ok:
        raise out
    return out


@contextlib.contextmanager
def no_trace_hooks():
    """A segment runs (or is built) while the function's trace is open: nothing it does
    belongs to that trace."""
    import spdsl.propagate.trace as T
    was = T._TRACING[0]
    T._TRACING[0] = False
    try:
        yield
    finally:
        T._TRACING[0] = was
