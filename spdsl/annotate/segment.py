"""The pieces a segment is made of (``spdsl.annotate.breaks``): the segment as a graph module of
its own, its structural key, the collectives that make a value whole, the thread a segment
runs on while the function's trace is open, and the recorded paths a later call replays (its
segments, its reads and their guards, and what makes a call trace every time)."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as DShard

from spdsl._torch import outside_fx_trace, tree_flatten, tree_unflatten
from spdsl.pipeline.run import out_forms, split_output, wrap_output
from spdsl.pipeline.spec import P
from spdsl.propagate.trace_state import reachable_modules


def graph(seg: list, outs: list, root: torch.nn.Module, first=frozenset()):
    """The segment as its own graph module, its external inputs (graph nodes read from
    outside, in order: those in ``first`` before the others) and its structural key."""
    g = torch.fx.Graph()
    m: dict = {}
    mod = torch.nn.Module()
    ext: list = []
    in_seg = set(seg)
    read = list(dict.fromkeys(a for n in seg for a in n.all_input_nodes if a not in in_seg))
    # inputs first: the lowering's passes read the graph's inputs before its ops
    for a in [a for a in read if a in first] + [a for a in read if a not in first]:
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


def made_whole(plan, entry, node: torch.fx.Node) -> list[tuple[str, int]]:
    """The collectives of a segment's program (``entry``, its ``plan``) that make ``node``
    whole for Python to read:
    those at ``node`` and at the replicated ops between it and the split values it reads."""
    from spdsl.propagate.placement import Replicate
    cone, stack = {node.name}, [node]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a.op == "call_function" and a.name not in cone and \
                    isinstance(entry.prop.decisions[a].output, Replicate):
                cone.add(a.name)
                stack.append(a)
    return [(c.kind, c.bytes) for c in plan.collectives
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


# -- recorded paths (``Segments.paths``): what a call that takes a path again replays --------

_READ = torch.ops.aten._local_scalar_dense.default


@dataclass
class SegStep:
    """A segment of a recorded path: its program, where each of its inputs comes from and,
    once built, the program's built step a replay runs directly (``built``, valid while the
    path's root has generation ``gen``; ``forms``: its outputs' placements)."""

    prog: Any              # the segment's Sharded
    srcs: list
    grad: bool
    built: Any = None      # spdsl.pipeline.Step
    gen: int = -1
    forms: tuple = ()

    def keep(self, built, gen: int) -> None:
        self.built, self.gen, self.forms = built, gen, out_forms(built)


@dataclass
class Read:
    """A read of a recorded path: how to compute it again and the guard the value gave."""

    index: int
    kind: str             # "item" (a number or a bool), "mask" (x[mask]), "data" (a shape)
    srcs: Any
    guard: Any
    brk: Any               # spdsl.inspect.breaks.Break

    def compute(self, run: Replayed) -> tuple[Any, list]:
        """The value read on this call, as the recording computed it: its guard and the
        tensors it makes (inputs of later segments)."""
        with torch.no_grad():
            if self.kind == "item":
                got = _READ(run.whole(self.srcs))
                return guard("item", got), []
            if self.kind == "mask":
                made = [i for s in self.srcs for i in run.whole(s).nonzero(as_tuple=True)]
                return guard("mask", made), made
            func, srcs, spec = self.srcs
            a, kw = tree_unflatten([run.whole(s) if s[0] != "lit" else s[1] for s in srcs],
                                   spec)
            got = func(*a, **kw)
            return guard("data", got), [t for t in tree_flatten(got)[0]
                                         if isinstance(t, torch.Tensor)]


@dataclass
class PathNode:
    """A point of the recorded paths: the segments run up to the next read, that read, and
    the path each value it gave continues with; at the end, the output."""

    n_in: int
    steps: list | None = None
    read: Read | None = None
    kids: dict = field(default_factory=dict)
    result: list | None = None
    out_spec: Any = None
    # at a root: the inputs' (shape, dtype, requires_grad) the kept steps were built for, and
    # its generation, advanced when they change (a parameter frozen re-keys every segment)
    sig: Any = None
    gen: int = 0


class Replayed:
    """The values of one replayed call: its inputs, segments' outputs and reads' results.
    A segment's outputs are kept as this rank's pieces (``pipeline.run.run_local``): the next
    segment takes them as they are; a read or the call's result wraps one as the DTensor it
    is (once)."""

    def __init__(self, ins: list) -> None:
        self.ins, self.outs, self.made = ins, [], {}
        self.forms: dict = {}     # segment -> its outputs' placements and groups, if pieces
        self.wrapped: dict = {}

    def add(self, outs: list, step: SegStep) -> None:
        """A segment's outputs as ``run_local`` gives them (pieces)."""
        self.forms[len(self.outs)] = step.forms, step.built.groups
        self.outs.append(outs)

    def inputs(self, srcs: list) -> tuple[list, frozenset]:
        """A segment's arguments and the indices of those that are pieces already."""
        vals, local = [], []
        for k, s in enumerate(srcs):
            if s[0] == "out" and s[1] in self.forms:
                p, _, dp = self.forms[s[1]][0][s[2]]
                if split_output(p, dp):
                    vals.append(self.outs[s[1]][s[2]])
                    local.append(k)
                    continue
            vals.append(self.value(s))
        return vals, frozenset(local)

    def value(self, s: tuple):
        kind = s[0]
        if kind == "in":
            return self.ins[s[1]]
        if kind == "out":
            if s[1] not in self.forms:
                return self.outs[s[1]][s[2]]
            v = self.wrapped.get(s[1:])
            if v is None:                    # the DTensor the piece is, made once
                forms, groups = self.forms[s[1]]
                p, node, dp = forms[s[2]]
                v = self.wrapped[s[1:]] = wrap_output(self.outs[s[1]][s[2]], p, node, dp,
                                                      groups)
            return v
        if kind == "read":
            return self.made[s[1]][s[2]]
        return s[1]                          # "const", "lit"

    def whole(self, s: tuple) -> torch.Tensor:
        v = self.value(s)
        return (v.full_tensor() if isinstance(v, DTensor) else v).detach()


def guard(kind: str, value: Any) -> Any:
    """What a replayed read must equal to continue a recorded path. A number or a bool, and
    a shape made from data (``unique``, ``nonzero``): the exact value, since Python sees it.
    ``x[mask]``: the number of elements picked; the indices stay tensors, inputs of the next
    segment, which Python never sees."""
    if kind == "mask":
        return tuple(tuple(t.shape) for t in value)
    if kind == "item":
        return type(value), repr(value)
    return tuple((t.dtype, tuple(t.shape), t.cpu().contiguous().view(-1).view(torch.uint8)
                  .numpy().tobytes()) if isinstance(t, torch.Tensor) else (type(t), repr(t))
                 for t in tree_flatten(value)[0])


_MODULE_OWN = frozenset(torch.nn.Module().__dict__) - {"training"}


def attributes(owner, args: tuple, kwargs: dict) -> list:
    """A fingerprint of the attributes of the modules the function reaches (not parameters,
    buffers or submodules): a forward that changes one (a counter, a list it appends to) has
    Python effects a replay would skip, so its calls are traced every time."""
    out = []
    for root in reachable_modules(owner.fn, args, kwargs):
        for m in root.modules():
            out.append([(k, _fingerprint(v, 2)) for k, v in m.__dict__.items()
                        if k not in _MODULE_OWN])
    return out


def hooked(owner, args: tuple, kwargs: dict) -> bool:
    """Forward hooks run Python at every call of their module, which a replay would skip."""
    return any(m._forward_hooks or m._forward_pre_hooks
               for root in reachable_modules(owner.fn, args, kwargs) for m in root.modules())


def _fingerprint(v: Any, depth: int) -> Any:
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return v
    if isinstance(v, torch.Tensor):
        return id(v), tuple(v.shape), v._version
    if isinstance(v, (list, tuple, dict, set, frozenset)):
        items = [x for kv in v.items() for x in kv] if isinstance(v, dict) else list(v)
        # a tuple is its items; a list, dict or set is also which one it is
        return (type(v), None if isinstance(v, (tuple, frozenset)) else id(v), len(items),
                tuple(_fingerprint(x, depth - 1) for x in items[:64]) if depth > 0 else ())
    return type(v), id(v)


