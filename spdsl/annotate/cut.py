"""One call of a forward that reads values, as its trace runs (``spdsl.annotate.breaks``):
``Cut`` holds the values computed so far and runs the ops recorded since the last read as a
segment when Python reads a value (``Cut.cut``), recording the path a later call replays;
``BreakMode`` is the dispatch mode inside the trace that sees the reads (``.item()``, a
boolean mask, an op whose shape comes from data) and answers them with the global value."""

from __future__ import annotations

import contextlib
import pickle
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Shard as DShard
from torch.fx.experimental.proxy_tensor import get_proxy_slot

from spdsl._torch import (
    FakeTensor,
    TorchDispatchMode,
    tree_flatten,
    tree_unflatten,
)
from spdsl.annotate.lifted import LiftMode
from spdsl.annotate.segment import (
    Read,
    SegStep,
    graph,
    guard,
    made_whole,
    no_trace_hooks,
    outside,
    seeded,
    spec_key,
    spec_of,
)
from spdsl.errors import ShardingError
from spdsl.inspect.breaks import Break, Segment
from spdsl.inspect.plan import Collective
from spdsl.pipeline.decide import out_nodes
from spdsl.pipeline.spec import P
from spdsl.propagate.placement import PARTIAL, REPLICATE, Shard, typed_shape
from spdsl.propagate.source import stack_line
from spdsl.propagate.trace import Traced
from spdsl.propagate.trace_refusals import shape_from_data
from spdsl.sharded_state import is_sharded_state

if TYPE_CHECKING:
    from spdsl.annotate.breaks import Segments

_READ = torch.ops.aten._local_scalar_dense.default
_INDEX = torch.ops.aten.index.Tensor
_MASKED_SELECT = torch.ops.aten.masked_select.default
_VIEW = torch.ops.aten.view.default


@dataclass
class Cut:
    """One call in segments: the values computed so far and the pending graph's cut points."""

    segs: Segments
    leaf_specs: list
    planning: bool
    env: dict = field(default_factory=dict)        # node -> value (DTensor / tensor)
    spec: dict = field(default_factory=dict)       # planning: node -> P of its value
    done: set = field(default_factory=set)
    segments: list = field(default_factory=list)
    breaks: list = field(default_factory=list)
    result: Any = None
    running: float = 0.0              # seconds spent running (and building) segments
    drawn: Any = field(default_factory=random.getstate)    # Python's random at the call
    placed: dict = field(default_factory=dict)     # node -> its placement in its segment
    cost: dict = field(default_factory=dict)       # node -> the moves that made it whole
    # the path, for calls that take it again (``Segments._replay``)
    path: list = field(default_factory=list)       # SegStep and Read, in order
    src: dict = field(default_factory=dict)        # node -> where its value comes from
    made: dict = field(default_factory=dict)       # id -> (tensor, source): read results
    n_in: int = 0
    recipe: list = field(default_factory=list)     # the output's leaves: sources
    out_spec: Any = None
    read_src: Any = None                           # the source of the last value read
    lifted: list = field(default_factory=list)     # the nodes of Lifted numbers
    lifts: list = field(default_factory=list)      # weak references to them
    names: list = field(default_factory=list)      # the function's state names, in order
    sharded: dict = field(default_factory=dict)    # placeholder -> name: sharded parameters
    check: tuple = ()              # the call's same-inputs check (Collective), as planned
    based: dict = field(default_factory=dict)      # base not handed on -> its view handed on

    def __call__(self, tracer, state, leaves, assign, module):
        self.tracer, self.assign, self.module = tracer, assign, module
        phs = [n for n in tracer.graph.nodes if n.op == "placeholder"]
        self.n_in = len(state) + len(leaves)
        self.check = self.segs.owner._check_collectives(list(leaves))
        # parameters sharded over the mesh (shard_state=True): each segment's own state
        self.sharded = {n: self.names[i] for i, (n, x) in enumerate(zip(phs, state))
                        if is_sharded_state(x)}
        for i, (n, x) in enumerate(zip(phs, list(state) + list(leaves))):
            self.env[n] = x
            self.src[n] = ("in", i)
            self.done.add(n)
            if i >= len(state):
                s = self.leaf_specs[i - len(state)]
                self.spec[n] = spec_of(x, self.segs.owner.axis) if isinstance(x, DTensor) \
                    else s
        stack = contextlib.ExitStack()
        stack.enter_context(LiftMode(self))
        stack.enter_context(BreakMode(self))
        return stack

    # -- values ---------------------------------------------------------------------------
    def node_of(self, t: torch.Tensor) -> torch.fx.Node | None:
        try:
            return get_proxy_slot(t, self.tracer).proxy.node
        except (KeyError, AttributeError, RuntimeError):
            return None

    def source(self, t: torch.Tensor) -> tuple:
        """Where a tensor that is not an op's output comes from: a read's result (computed
        again on replay) or a constant of the function."""
        got = self.made.get(id(t))
        return got[1] if got is not None and got[0] is t else ("const", t)

    def record(self, kind: str, srcs: Any, result: Any, made: list) -> None:
        """A read: what the segments must compute again on replay, and the value it gave."""
        r = sum(isinstance(s, Read) for s in self.path)
        for j, t in enumerate(made):
            self.made[id(t)] = (t, ("read", r, j))
        g = outside(lambda: guard(kind, result), False)    # real tensors' bytes
        self.path.append(Read(r, kind, srcs, g, self.breaks[-1]
                               if self.breaks else None))

    def read_number(self, t: torch.Tensor, where: str) -> float | int | bool:
        """``t.item()``: the global value, a read guarded on it."""
        real = self.value(t, "bool" if t.dtype == torch.bool else "item", where)
        got = outside(lambda: _READ(real), False)
        if self.read_src[0] in ("in", "out"):     # else a constant: the same on replay
            self.record("item", self.read_src, got, [])
        return got

    def value(self, t: torch.Tensor, kind: str, where: str) -> torch.Tensor:
        """The global value of traced tensor ``t``: its segment run first if pending;
        ``read_src`` is where it comes from (None: a constant)."""
        self.read_src = None
        if not isinstance(t, FakeTensor):
            self.read_src = self.source(t)
            return t
        node = self.node_of(t)
        if node is None:
            raise ShardingError(rule="data-dependent control flow", where=where,
                                detail="a tensor read in Python was not made by a traced op",
                                fix="compute it from the function's arguments")
        if node.op == "get_attr":
            got = getattr(self.tracer.root, node.target)
            self.read_src = self.source(got)
            return got
        if node not in self.env:
            self.cut(read=node)
        v = self.env[node]
        self.read_src = self.src[node]
        self.breaks.append(self._break(node, v, kind, where))
        return outside(lambda: (v.full_tensor() if isinstance(v, DTensor) else v).detach(),
                        False)

    def _break(self, node, v, kind: str, where: str) -> Break:
        val = node.meta["val"]
        p = self.placed.get(node, REPLICATE)
        moves = list(self.cost.pop(node, ()))      # paid once, by the first read
        # an argument the caller passed whole is read as it is (no collective), as the run does
        given = node.op == "placeholder" and not isinstance(v, DTensor)
        split = isinstance(v, DTensor) and isinstance(v.placements[0], DShard) or \
            self.planning and not given and isinstance(self.spec.get(node), P)
        own = []
        if split:             # the segment hands it on split: gathered to be read
            own.append(("all_gather", val.numel() * val.element_size() //
                        self.segs.owner.parts))
        if isinstance(v, DTensor) and isinstance(v.placements[0], DPartial) or \
                self.planning and not given and self.spec.get(node) == PARTIAL:
            own.append(("all_reduce", val.numel() * val.element_size()))   # a partial sum
        moves += own
        typed = typed_shape(val.shape, val.dtype, p, self.segs.owner.axis)
        mod = self.module()
        # a number or a shape read inside a block: the routing of a mixture of experts, often
        note = (f"if {mod} computes each token on its own (the experts of a mixture of "
                f"experts), spdsl.token_wise(model.get_submodule({mod!r})) runs it on each "
                "rank's tokens with no break") if mod and kind != "bool" else ""
        issued = tuple(Collective(k, self.segs.owner.axis, b, 0, "read", (typed,), where,
                                  mod, node.name) for k, b in own)
        return Break(len(self.segments) - 1, kind, where, typed,
                     tuple(f"{k} {b} B" for k, b in moves), sum(b for _, b in moves),
                     kind not in ("bool", "item") and any(k == "all_gather" for k, _ in moves),
                     mod, note, issued)

    # -- segments ---------------------------------------------------------------------------

    def cut(self, read: torch.fx.Node | None = None, final: list | None = None) -> None:
        """Run the ops recorded since the last cut as one segment."""
        g = self.tracer.graph
        final, again = self._rebuild(g, read, final)
        read = again.get(read, read)
        seg = [n for n in g.nodes if n.op == "call_function" and n not in self.done]
        if not self.planning and random.getstate() != self.drawn:
            state = pickle.dumps(self.drawn)
            outside(lambda: self.segs.check_generator("Python's random", state), False)
        if not self.planning and any(seeded(n) for n in seg):
            outside(lambda: self.segs.check_generator(
                "torch's default generator", torch.get_rng_state().numpy().tobytes()), False)
        if not seg:
            return
        self.assign(g)
        in_seg = set(seg)
        if final is not None:
            # and the numbers Python may still look at after the trace (a Lifted returned or
            # kept); one no reference holds any more is never read
            kept = [n for n, ref in zip(self.lifted, self.lifts) if ref() is not None]
            outs = [n for n in dict.fromkeys(final + kept) if n in in_seg]
            # a partial sum an earlier segment handed on, handed back (or kept): reduced then
            back = [n for n in final + kept if n not in in_seg and self.placed.get(n) == PARTIAL]
        else:
            live = set()
            for t in list(self.tracer.tensor_tracker.keys()):
                n = self.node_of(t)
                if n in in_seg:
                    live.add(n)
            outs = [n for n in seg if (n in live or n is read or seeded(n))
                    and isinstance(n.meta.get("val"), torch.Tensor)]
            outs = self._views_not_bases(outs, read)
        outs += [n for n in seg if seeded(n) and n not in outs]
        gm, ext, key = graph(seg, outs, self.tracer.root, self.sharded)
        # sharded parameters are the segment's state (gathered where used, their gradients
        # reduce-scattered), the program's own: its key names them
        n_state = sum(a in self.sharded for a in ext)
        state, names = [self.env[a] for a in ext[:n_state]], [self.sharded[a] for a in
                                                              ext[:n_state]]
        ext = ext[n_state:]
        inputs, specs, srcs = [], [], []
        for a in ext:
            x = self.env[a] if a.op != "get_attr" else getattr(self.tracer.root, a.target)
            inputs.append(x)
            srcs.append(self.src[a] if a.op != "get_attr" else self.source(x))
            s = None if isinstance(x, DTensor) or a.op == "get_attr" else self.spec.get(a)
            specs.append(s)
        key = (key, tuple((tuple(x.shape), x.dtype, x.requires_grad, spec_key(x, s))
                          for x, s in zip(inputs, specs)), torch.is_grad_enabled(),
               final is not None, tuple(id(t) for t in state))
        n_out = len(outs)
        first = self.sharded

        def make() -> Traced:
            from spdsl.propagate.attention_nodes import uncast_attention, unrepeat_kv
            from spdsl.propagate.convs import convs_as_mixers
            from spdsl.propagate.fills import fills_as_cat
            from spdsl.propagate.forms import find_all
            from spdsl.propagate.masks import masks_as_functions
            fresh = graph(seg, outs, root, first)[0]
            fills_as_cat(fresh)
            convs_as_mixers(fresh)
            find_all(fresh)
            unrepeat_kv(fresh)
            uncast_attention(fresh)
            masks_as_functions(fresh)
            _, arg_spec = tree_flatten((tuple(inputs), {}))
            _, out_spec = tree_flatten([0] * n_out)
            return Traced(fresh, names, state, arg_spec, list(range(len(inputs))), out_spec)

        root = self.tracer.root
        prog = self.segs.program(key, make, specs, final is not None, self.planning)
        built: list = [None]

        def run():
            entry = prog.build(tuple(inputs), {}, agree=not self.planning)
            plan = prog.plan_of(entry, tuple(inputs), {})
            placed = [entry.prop.placement(o) for o in out_nodes(entry.traced)]
            if self.planning:
                with torch.no_grad():
                    # sharded parameters (shard_state=True) read whole: an all-gather each,
                    # on every rank alike, as the run's segments gather them
                    whole = [x.full_tensor() for x in state]
                    vals = gm(*[x.detach() for x in whole + inputs])
                for o, q in zip(outs, entry.out_placements):
                    self.spec[o] = PARTIAL if q == PARTIAL else None \
                        if not isinstance(q, Shard) else \
                        P(*[self.segs.owner.axis if d == q.dim else None
                            for d in range(o.meta["val"].dim())])
            else:
                vals = prog(*inputs)
                # the step just built (cached): what a replay of this path runs directly
                built[0] = prog.prepare(*inputs).step
            for o, n in zip(outs, out_nodes(entry.traced)):    # what a later read costs
                if o is read or o.meta["val"].numel() == 1:
                    self.cost[o] = made_whole(plan, entry, n)
            return entry, plan, placed, vals

        t0 = time.perf_counter()
        with no_trace_hooks():
            entry, plan, placed, vals = outside(run, torch.is_grad_enabled())
        self.running += time.perf_counter() - t0
        self.path.append(SegStep(prog, srcs, torch.is_grad_enabled()))
        if built[0] is not None:
            self.path[-1].keep(built[0], -1)    # its generation set when the path is recorded
        for j, (o, v, p) in enumerate(zip(outs, vals, placed)):
            self.env[o] = v
            self.src[o] = ("out", len(self.segments), j)
            self.placed[o] = p if not isinstance(p, tuple) else REPLICATE
        after = () if final is None else tuple(
            Collective("all_reduce", self.segs.owner.axis, n.meta["val"].numel() *
                       n.meta["val"].element_size(), 0, "output", (typed_shape(
                           n.meta["val"].shape, n.meta["val"].dtype, PARTIAL,
                           self.segs.owner.axis),), "", "", n.name) for n in back)
        self.segments.append(Segment(len(self.segments), len(seg), len(outs), plan,
                                     () if self.segments else self.check, after))
        self.done.update(seg)
        for b, r in again.items():      # a base rebuilt for Python to read, or handed back
            self.env[b], self.src[b], self.placed[b] = self.env[r], self.src[r], self.placed[r]
            if r in self.cost:
                self.cost[b] = self.cost.pop(r)

    def _views_not_bases(self, outs: list, read) -> list:
        """Of a base and a view of all of it (``view`` of a linear layer's ``[B*S, H]`` output
        as the ``[B, S, H]`` Python holds), only the view is handed on: the view keeps its
        base alive, so both are live, but the base's merged dim would be split on its inner
        factor, which a DTensor cannot describe (gathered whole to be handed on). A later
        segment that reads the base (Python may hold it too) views the view back
        (``_rebuild``): the same values, its gradient flowing through the view."""
        keep = set(outs)
        pairs = {}
        for n in outs:
            b = n.args[0] if n.target is _VIEW else None
            val, bval = n.meta.get("val"), getattr(b, "meta", {}).get("val")
            if b in keep and b is not read and not seeded(b) and b not in self.lifted and \
                    isinstance(bval, torch.Tensor) and bval.is_contiguous() and \
                    val.numel() == bval.numel():
                pairs.setdefault(b, n)
        for b, n in pairs.items():
            if n not in pairs:           # the view itself handed on (not a base of another)
                keep.discard(b)
                self.based[b] = n
        return [n for n in outs if n in keep]

    def _rebuild(self, g, read, final: list | None) -> tuple[list | None, dict]:
        """Bases a segment handed on as their view (``_views_not_bases``), needed again: by an
        op since the last cut, a read, or the output. Each is the view viewed back, an op of the
        segment about to run; returns ``final`` with them and ``{base: its rebuilt node}`` for
        those Python reads or is handed back (their values after the segment runs)."""
        pending = [n for n in g.nodes if n.op == "call_function" and n not in self.done]
        used = {a for u in pending for a in u.all_input_nodes}
        wanted = [b for b in self.based if b not in self.env and (
            b is read or b in used or final is not None and b in final)]
        out = next((n for n in g.nodes if n.op == "output"), None)
        again = {}
        for b in wanted:
            users = [u for u in pending if b in u.all_input_nodes]
            at = users[0] if users else out
            ctx = g.inserting_before(at) if at is not None else contextlib.nullcontext()
            with ctx:
                r = g.call_function(_VIEW, (self.based[b], list(b.meta["val"].shape)))
            r.meta = dict(b.meta)
            for u in users:
                u.replace_input_with(b, r)
            if b is read or final is not None and b in final:
                again[b] = r
        if final is not None:
            final = [again.get(n, n) for n in final]
        return final, again


class BreakMode(TorchDispatchMode):
    """Inside the trace: a read of a value, or an op whose output shape depends on one, cuts
    the graph there and gets the global value."""

    supports_higher_order_operators = True      # flex_attention: passed through whole

    def __init__(self, cut: Cut) -> None:
        super().__init__()
        self.c = cut

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _READ:
            return self.c.read_number(args[0], stack_line())
        if func is _MASKED_SELECT and args[0].shape == args[1].shape:
            func, args = _INDEX, (args[0], [args[1]])
        if func is _INDEX and any(isinstance(i, torch.Tensor) and i.dtype in
                                  (torch.bool, torch.uint8) for i in args[1]):
            where = stack_line()
            index, srcs, made = [], [], []
            for i in args[1]:
                if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
                    mask = self.c.value(i, "x[mask]", where)
                    srcs.append(self.c.read_src)
                    made += list(outside(lambda m=mask: m.nonzero(as_tuple=True), False))
                    index += made[-mask.dim():]
                else:
                    index.append(i)
            self.c.record("mask", srcs, made, made)
            return func(args[0], index)
        if shape_from_data(func, args):
            where = stack_line()
            name = func.overloadpacket.__name__.lstrip("_").rstrip("2")
            flat, spec = tree_flatten((args, kwargs))
            if self.c.segs.owner.strict:
                raise ShardingError(
                    rule="gather", where=where,
                    detail=f"{name} makes a shape from data: it runs on the whole sequence "
                           "on every rank, and strict=True refuses that",
                    fix="drop strict=True, or compute it with fixed-shape ops")
            real, srcs = [], []
            for x in flat:
                if isinstance(x, torch.Tensor):
                    real.append(self.c.value(x, name, where))
                    srcs.append(self.c.read_src)
                else:
                    real.append(x)
                    srcs.append(("lit", x))
            a, kw = tree_unflatten(real, spec)
            got = outside(lambda: func(*a, **kw), False)   # a constant of the next segment
            made = [t for t in tree_flatten(got)[0] if isinstance(t, torch.Tensor)]
            self.c.record("data", (func, srcs, spec), got, made)
            return got
        return func(*args, **kwargs)
