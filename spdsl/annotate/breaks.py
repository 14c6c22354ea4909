"""Forwards that read tensor values in Python: run in segments, split at each read.

One traced program has no values, so a forward that branches on a tensor (``if x.mean() > 0``),
reads a number (``.item()``, ``.tolist()``), makes a shape from data (``nonzero``,
``unique``, ``x[mask]``) or draws from Python's ``random`` cannot be one program. ``Sharded``
runs such a function here instead; a call that records its path:

1. the user's Python runs under the same trace as one program would (``propagate.trace``,
   global shapes, fake tensors), so its branches, loops and side effects happen as in eager;
2. where it reads a value, the ops recorded since the last read form a *segment*: a graph
   whose inputs are the values it reads (arguments, parameters, earlier segments' outputs)
   and whose outputs are the tensors Python can still reach (``make_fx`` tracks them in a
   weak-keyed table: a tensor no Python reference holds can never be used again) plus its
   random draws. The segment is a ``Sharded`` of its own -- propagated, lowered, remat'ed and
   compiled once per structure, cached -- and runs on this rank's pieces at once; its outputs
   are DTensors (or replicated tensors), so placements carry into the next segment and
   autograd links the segments (parameters' gradients are reduced at each use, as in one
   program);
3. the value Python reads is the *global* one: the segment's output made whole (an all-reduce
   of a partial sum, an all-gather of a split tensor) and read on every rank alike. An op whose
   output shape depends on data runs on its whole (gathered) inputs on every rank and enters
   the next segment as a replicated constant; ``x[mask]`` becomes ``x[mask.nonzero()]``, so
   ``x``'s gradient still flows.

A call whose reads give values a recorded call's reads gave replays that call's path: its
segment programs in order, each read computed and checked against the recorded continuations
(``Segments.paths``), no trace and none of the function's Python. A number read with ``.item()``
and used only in torch ops stays a tensor (``spdsl.annotate.lifted``), so it is no guard. A
function that draws from Python's ``random``, changes module attributes or has forward hooks
traces every call. Cost: a trace per new path, plus one collective per read.

Random draws: Python's ``random`` runs in the user's Python, once a call, on every rank; torch's
random ops run once each, in order, inside their segment -- both the same on every rank when the
ranks' generators agree, which the first call checks (over every axis of the mesh).

On a dp x sp mesh a segment is split over both axes as one program would be, and a value read
is made whole over both (the global batch's). ``batch="local"`` rows enter as DTensors of the
global batch. With ``shard_state=True`` the sharded parameters a segment uses are its state:
gathered where used, their gradients reduce-scattered, as in one program. The memory planner
plans the step along the path a call's values take (``spdsl.annotate.segments_memory``: the segments'
programs in one simulation, the worst path seen the step's peak; on a dp x sp mesh or with
sharded state, the run's own programs with the job's groups).

This module decides and replays; the call as its trace runs (the values so far, the cut at each
read, the dispatch mode that sees the reads) is ``spdsl.annotate.cut``.
"""

from __future__ import annotations

import random
import time
import zlib
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial as DPartial

from spdsl._torch import (
    FakeTensor,
    tree_flatten,
    tree_unflatten,
)
from spdsl.annotate.cut import Cut
from spdsl.annotate.lifted import number
from spdsl.annotate.segment import (
    PathNode,
    Replayed,
    SegStep,
    attributes,
    hooked,
)
from spdsl.annotate.sharded import Sharded
from spdsl.errors import ShardingError
from spdsl.inspect.breaks import Break, SegmentedPlan
from spdsl.pipeline.programs import call_key
from spdsl.pipeline.run import _split, as_dtensor, run_local
from spdsl.pipeline.spec import P
from spdsl.propagate.placement import Shard
from spdsl.propagate.source import stack_line
from spdsl.propagate.trace import Traced, trace
from spdsl.propagate.trace_refusals import GraphBreak
from spdsl.propagate.trace_state import reachable_modules, state_of

_PROGRAMS = 64          # segment programs kept per function (a read value baked in each)
_PATHS = 4096           # nodes of recorded paths kept per function (then they start over)
_MISS = object()


def segmented(owner: Sharded, args: tuple, kwargs: dict, error: GraphBreak | None = None):
    """The segmented runner of ``owner`` if calls like this one run in segments; with
    ``error`` (the trace just met a read), decide that they do from now on."""
    seg = owner._segmented
    if error is None:
        if seg is None:
            return None
        return seg if seg.applies(args, kwargs) else None
    if seg is None:
        seg = owner.segments_runner()
    seg.remember(args, kwargs)
    return seg


def plan_segments(owner: Sharded, args: tuple, kwargs: dict,
                  error: GraphBreak | None = None) -> SegmentedPlan:
    """The plan of a function with breaks: each segment's plan, each break's line and cost.
    The values read are computed on the real global arguments in this process (the plan
    runs no collective), so the branches taken are those the sharded run takes; the random
    generators are left as they were. Its ``memory``: the training step along this path
    (``spdsl.annotate.segments_memory``)."""
    cut = planned_cut(owner, args, kwargs, error)

    def memory():
        return owner.segments_memory(args, kwargs)

    return SegmentedPlan(cut.segments, cut.breaks, memory=memory)


def planned_cut(owner: Sharded, args: tuple, kwargs: dict,
                error: GraphBreak | None = None) -> Cut:
    """This call run in segments for a plan (``planning=True``: each segment planned with no
    mesh, on the sequence axis alone, on the real global values): its segments, breaks and
    path, in order. No collective runs, but for ``shard_state=True``: each segment's sharded
    parameters are gathered whole for it (every rank must plan alike)."""
    leaves = tree_flatten((args, kwargs))[0]
    if any(isinstance(x, torch.Tensor) and (x.is_meta or isinstance(x, FakeTensor))
           for x in leaves):
        raise ShardingError(
            rule="data-dependent control flow", value="meta or fake arguments",
            where=error.where if error is not None else "",
            detail="the function reads tensor values in Python (it runs in segments, split "
                   "at each read), and which segments run depends on those values",
            fix="plan it with real arguments (a small batch of the real shapes)")
    seg = segmented(owner, args, kwargs) or segmented(owner, args, kwargs, error or GraphBreak(
        rule="data-dependent control flow"))
    py, rng = random.getstate(), torch.get_rng_state()
    try:
        return seg.run(args, kwargs, planning=True)
    finally:
        random.setstate(py)
        torch.set_rng_state(rng)


class Segments:
    """How one sharded function runs when it reads values: its segment programs (by
    structure), the program keys that run this way, the paths calls took (replayed without
    a trace) and the rank agreement check."""

    replay = True       # False: every call traces (the paths are neither kept nor replayed)

    def __init__(self, owner: Sharded) -> None:
        self.owner = owner
        self.programs: dict[Any, Sharded] = {}
        self.keys: set = set()
        self.checked: set = set()       # the generators checked to agree across ranks
        self.last: list[Break] = []          # the breaks of the last call
        self.seconds = (0.0, 0.0)
        self.paths: dict = {}           # call key -> the root of its recorded paths (PathNode)
        self.nodes = 0                  # nodes in all paths
        self.volatile: dict = {}        # call key -> why its calls are traced every time
        self.traces = 0                 # calls that ran the function's Python under the trace
        self.replays = 0                # calls that ran recorded segments only

    def _key(self, args, kwargs):
        leaves, spec = tree_flatten((args, kwargs))
        return call_key(self.owner.fn, args, kwargs, leaves, spec)

    def applies(self, args, kwargs) -> bool:
        return self._key(args, kwargs) in self.keys

    def remember(self, args, kwargs) -> None:
        self.keys.add(self._key(args, kwargs))

    def __call__(self, args: tuple, kwargs: dict):
        t0 = time.perf_counter()
        args, kwargs = self._global_rows(args, kwargs)
        key = self._key(args, kwargs)
        root = self.paths.get(key)
        if root is not None and self.replay:
            out = self._replay(root, args, kwargs)
            if out is not _MISS:
                self.replays += 1
                self.seconds = (time.perf_counter() - t0, 0.0)
                return out
        before = attributes(self.owner, args, kwargs)
        drawn = random.getstate()
        cut = self.run(args, kwargs)
        self.traces += 1
        why = "it draws from Python's random" if random.getstate() != drawn else \
            "it changes module attributes" if attributes(self.owner, args, kwargs) != before \
            else "its modules have forward hooks" if hooked(self.owner, args, kwargs) else None
        if why is not None:
            self.volatile[key] = why
            self.paths.pop(key, None)
        elif key not in self.volatile and self.replay:
            self._record(key, cut, _signature(self._inputs(args, kwargs)))
        self.last = cut.breaks
        # seconds of the last call: all of it, and the part outside the segments (the trace)
        self.seconds = (time.perf_counter() - t0, time.perf_counter() - t0 - cut.running)
        return cut.result

    def _global_rows(self, args: tuple, kwargs: dict) -> tuple:
        """``batch="local"`` on a two-axis mesh: each dp group passed its own rows. They
        enter as DTensors of the global batch (this rank's piece of its rows), so that the
        trace sees global shapes and a read of them is made whole over both axes."""
        o = self.owner
        if o.batch != "local" or o.data_parts == 1:
            return args, kwargs
        leaves, tree = tree_flatten((args, kwargs))
        reading, groups = o.reading, o.groups
        specs = reading.specs_for(args, leaves)
        new = list(leaves)
        for i, x in enumerate(leaves):
            s = specs[i] if specs is not None else None
            if s is None or not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
                continue
            dp = reading.data_placement_of(x, s, i)
            if not isinstance(dp, Shard):
                continue
            sp = reading.placement_of(x, s, i)
            piece = _split(x, sp, o.parts, groups.rank, groups.group) \
                if isinstance(sp, Shard) else x
            shape = list(x.shape)
            shape[dp.dim] = dp.size
            new[i] = as_dtensor(piece.contiguous(), sp, dp, groups, torch.Size(shape),
                                torch.empty(shape, device="meta").stride())
        return tree_unflatten(new, tree)

    # -- recorded paths ---------------------------------------------------------------------
    def _inputs(self, args: tuple, kwargs: dict) -> list:
        """The call's tensors a path reads as ``("in", i)``: parameters and buffers, then
        arguments."""
        leaves = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        return state_of(reachable_modules(self.owner.fn, args, kwargs))[1] + leaves

    def _record(self, key, cut: Cut, sig: tuple) -> None:
        """Add the call's path (segments and reads, in order) to the paths of ``key``; its
        segments' built steps are kept for replays made with inputs of signature ``sig``."""
        if self.nodes > _PATHS:
            self.paths.clear()
            self.nodes = 0
        node = self.paths.get(key)
        if node is None:
            node = self.paths[key] = PathNode(cut.n_in)
            self.nodes += 1
        if node.sig != sig:
            node.sig, node.gen = sig, node.gen + 1
        gen = node.gen
        steps: list = []
        for step in cut.path:
            if isinstance(step, SegStep):
                if step.built is not None:
                    step.gen = gen
                steps.append(step)
                continue
            if node.steps is None:
                node.steps, node.read = steps, step
            nxt = node.kids.get(step.guard)
            if nxt is None:
                nxt = node.kids[step.guard] = PathNode(cut.n_in)
                self.nodes += 1
            node, steps = nxt, []
        if node.steps is None:
            node.steps = steps
        node.result, node.out_spec = cut.recipe, cut.out_spec

    def _replay(self, node: PathNode, args: tuple, kwargs: dict):
        """Run a recorded path: its segments in order, each read computed and checked against
        the recorded continuations. ``_MISS`` where a read takes a path not recorded (the
        random generators are then as they were at the call)."""
        ins = self._inputs(args, kwargs)
        if len(ins) != node.n_in:
            return _MISS
        # the call key covers the modes and the arguments; a parameter frozen, unfrozen or
        # replaced re-keys every segment that reads it: the kept steps are then built again
        sig = _signature(ins)
        if node.sig != sig:
            node.sig, node.gen = sig, node.gen + 1
        gen = node.gen
        rng = torch.get_rng_state()
        dev = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        run = Replayed(ins)
        breaks: list = []
        while True:
            for step in node.steps:
                with torch.set_grad_enabled(step.grad):
                    if step.gen != gen:       # through the full call once: its key, its build
                        step.keep(step.prog.prepare(*[run.value(s) for s in step.srcs]).step,
                                  gen)
                    # the step as the first call built and checked it, on this rank's pieces
                    vals, local = run.inputs(step.srcs)
                    run.add(run_local(step.built, vals, local, step.prog.batch), step)
            if node.read is None:
                break
            got, made = node.read.compute(run)
            nxt = node.kids.get(got)
            if nxt is None:
                torch.set_rng_state(rng)
                if dev is not None:
                    torch.cuda.set_rng_state(dev)
                return _MISS
            breaks.append(node.read.brk)
            run.made[node.read.index] = made
            node = nxt
        self.last = [b for b in breaks if b is not None]
        return tree_unflatten([_whole(run.value(s)) for s in node.result], node.out_spec)

    def run(self, args: tuple, kwargs: dict, planning: bool = False) -> Cut:
        owner = self.owner
        leaves = tree_flatten((args, kwargs))[0]
        reading = owner.reading
        specs = reading.specs_for(args, leaves)
        leaf_specs = [specs[i] if specs is not None else None
                      for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        for x, s in zip([x for x in leaves if isinstance(x, torch.Tensor)], leaf_specs):
            if s is not None and not isinstance(x, DTensor):
                reading.placement_of(x, s, 0)     # divisibility, as one program checks it
        if planning and owner.data_parts > 1:
            # a plan's segments run on the sequence axis alone (the values read are global,
            # whatever splits the batch); the memory planner builds each with the mesh
            leaf_specs = [_sequence_only(s, owner.data_axis) for s in leaf_specs]
        cut = Cut(self, leaf_specs, planning,
                   names=state_of(reachable_modules(owner.fn, args, kwargs))[0])
        # the trace's own autograd graph never runs backward: what it would save for it is
        # not kept, so a segment hands on only what Python still holds (not every tensor a
        # backward formula saved, each one more output to make whole)
        with torch.autograd.graph.saved_tensors_hooks(_unsaved, _never_unpacked):
            traced = trace(owner.fn, args, kwargs, breaks=cut)
        out = next(n for n in traced.graph.graph.nodes if n.op == "output")
        flat = list(out.args[0])
        cut.cut(final=[n for n in flat if isinstance(n, torch.fx.Node)])
        cut.result = tree_unflatten([_whole(cut.env[n]) if n in cut.env else
                                     getattr(cut.tracer.root, n.target)   # a constant
                                     if isinstance(n, torch.fx.Node) else n
                                     for n in flat], traced.out_spec)
        cut.recipe = [cut.src[n] if n in cut.env else
                      cut.source(getattr(cut.tracer.root, n.target))
                      if isinstance(n, torch.fx.Node) else ("lit", number(n)) for n in flat]
        if cut.lifted:        # a number returned as it is: the value Python read
            cut.result = tree_unflatten([number(x) for x in tree_flatten(cut.result)[0]],
                                        traced.out_spec)
            for ref in cut.lifts:          # numbers Python kept: their values, not the call
                kept = ref()
                if kept is not None:
                    kept.settle(_whole(cut.env[cut.node_of(kept.tensor)]))
        cut.out_spec = traced.out_spec
        return cut

    def program(self, key, make, specs: list, final: bool, planning: bool) -> Sharded:
        prog = self.programs.get((key, planning))
        if prog is None:
            o = self.owner
            if len(self.programs) >= _PROGRAMS:
                self.programs.pop(next(iter(self.programs)))
            # the function's options; its sharded parameters reach a segment as its state
            # (``Cut.cut``) and its inputs as specs
            prog = _Segment(make, mesh=None if planning else o.mesh, in_specs=tuple(specs),
                            out_specs=o.out_specs if final else None, axis=o.axis,
                            parts=o.parts, data_axis=None if planning else o.data_axis,
                            options=o.options.replace(seq_dim=None, shard_state=False),
                            state_mesh=o._world() if o.shard_state and not planning else None,
                            final=final)
            self.programs[(key, planning)] = prog
        return prog

    def check_generator(self, what: str, state: bytes) -> None:
        """Python's ``random`` draws run in every rank's Python and torch's random ops in every
        rank's segments: the same values only if every rank's generator agrees. Checked once
        per generator, before the first segment after the function first draws from it."""
        o = self.owner
        if what in self.checked or not dist.is_initialized() or o.parts * o.data_parts == 1:
            return
        self.checked.add(what)
        # the values read are global: every rank of the mesh must draw alike; the largest
        # and smallest checksum over every axis, so that every rank decides alike
        crc = zlib.crc32(state)
        lo, hi = -o.groups.most(-crc), o.groups.most(crc)
        if lo != hi:
            raise ShardingError(
                rule="same random state", value=f"{what}: state checksums {lo} to {hi}",
                where=getattr(self.owner, "__qualname__", ""),
                detail="the function runs in segments (it reads tensor values in Python) and "
                       "draws random numbers; ranks whose generators differ draw different "
                       "values and take different branches",
                fix="seed every rank of the mesh alike before the first call (random.seed(s) "
                    "and torch.manual_seed(s) with the same s)")


def _signature(ins: list) -> tuple:
    return tuple((x.shape, x.dtype, x.requires_grad) for x in ins)


def _whole(v):
    """A value the call hands back: a partial sum an earlier segment handed on is reduced
    here, on every rank alike (Python may then read it on one rank only)."""
    if isinstance(v, DTensor) and any(isinstance(p, DPartial) for p in v.placements):
        return v.full_tensor()
    return v


def _sequence_only(spec, data_axis: str):
    """``spec`` with the data axis dropped (``P('dp', 'sp')`` -> ``P(None, 'sp')``)."""
    if not isinstance(spec, P):
        return spec
    return P(*[None if e == data_axis else e for e in spec])


def _unsaved(t: torch.Tensor) -> None:
    return None


def _never_unpacked(_) -> None:
    raise ShardingError(
        rule="data-dependent control flow", where=stack_line(),
        detail="the forward runs a backward of its own (torch.autograd.grad or .backward() "
               "inside it) and reads tensor values in Python: its segments are traced "
               "without what a backward would need",
        fix="compute the inner gradient outside the sharded function, or write the value "
            "read as tensor ops (torch.where, masks) so that the forward is one program")


class _Segment(Sharded):
    """One segment: a ``Sharded`` whose trace is the segment graph already recorded."""

    def __init__(self, make, data_axis: str | None = None, state_mesh=None,
                 final: bool = False, **kw) -> None:
        self._make, self._data, self._final = make, data_axis, final
        self._made: Traced | None = None
        super().__init__(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), **kw)
        self._state_mesh = state_mesh      # the function's parameters' mesh, not a new one

    def _reading_extra(self) -> dict:
        """A segment may be handed a partial sum (planning: as its input spec); a segment
        before the last hands a partial sum on as it is (a ``Partial`` DTensor): the segment
        that uses it reduces it where its op needs it, or a read does; made whole here, it
        would be reduced twice (once here, once for the op of this segment that needed it
        whole). On a mesh of the sequence axis alone."""
        return {"partial_in": True, "keep_partial": not self._final and self.data_parts == 1}

    @property
    def data_axis(self) -> str | None:
        """The function's data axis: a segment's inputs may all be DTensors, whose specs
        name no axis."""
        return self._data

    @property
    def job(self):
        """The function's job; a segment's gradient buckets merge with the other segments'
        (``spdsl.lower.grad_buckets.merge_buckets``)."""
        return replace(super().job, merge_buckets=True)

    def _traced(self) -> Traced:
        """The segment's graph, recorded already: made again once an entry took the last one
        (a new entry decides on a graph of its own)."""
        if self._made is None or any(e.traced is self._made for e in self._cache.values()):
            self._made = self._make()
        return self._made

    def _check_same_inputs(self, args: tuple, kwargs: dict) -> None:
        """Checked once per call, by the function the segments split (its arguments)."""

    def _check_collectives(self, leaves: list) -> tuple:
        return ()
