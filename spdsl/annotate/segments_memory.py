"""The memory planner for forwards that read tensor values in Python (``spdsl.annotate.breaks``);
its results are ``spdsl.memory.segmented``'s.

Such a forward runs in segments, and which segments run depends on the values read, so there is
no one program to simulate: a plan is made per *path* (the segments one call runs and the values
its reads gave), and the step's peak is the worst path planned. One path is planned as it runs:

1. the call runs in segments for a plan (``spdsl.annotate.breaks.planned_cut``: real global
   values in this process, no collective but the gathers of sharded parameters), which gives
   the path -- each segment's program (a ``Sharded`` planned with no mesh, on the sequence
   axis) and where each of its inputs comes from;
2. each segment's rank program is built by the pipeline as the run builds it
   (``spdsl.pipeline.planned_step``: lowered for the rank, kernels, remat). On the sequence
   axis alone, against one planning process group. On a dp x sp mesh or with
   ``shard_state=True``, the program is the run's own (``spdsl.annotate.segments_memory_mesh``: the same graph on
   the function's mesh, its arguments with their specs, earlier segments' outputs as the
   run's DTensors) lowered with the job's groups, as the one-program planner plans such a
   step: inside the job, this process's rank;
3. the programs run in order in ONE fake step under one ``LiveBytes`` tracker (as
   ``spdsl.memory.simulate`` runs one program): a segment's inputs are the fake outputs of the
   segments before it (this rank's pieces, the tensors themselves, so that autograd links them;
   on a mesh wrapped as the run's DTensors and unwrapped by the next segment), the function's
   parameters (the same fake tensors in every segment that uses them: their gradients
   accumulate; a sharded parameter's fake is this rank's rows, the program's state, gathered
   where used) and its arguments' pieces; a read makes its value whole with the collective the
   run uses (an all-gather of a split value, an all-reduce of a partial sum, over both axes on
   a mesh: ``DTensor.full_tensor``; both allocate), and a shape made from data (``x[mask]``'s
   indices, ``unique``) enters the next segment as a tensor allocated at the read. The
   segments' collectives are chained into one backward order (``collectives.backward_order``)
   as the run chains them: a collective's backward keeps what its forward's inputs saved (an
   all-reduced number the forward reads, on a mesh) until backward reaches it. Every segment's
   outputs stay alive until the forward returns, as the runner holds them (``Cut.env``,
   ``Replayed.outs``); then one backward from the function's outputs through every segment,
   and the optimizer over the parameters (over this rank's rows of sharded ones).

Each plan is kept on the function's runner (per call signature and planning options), so a
later call down another path adds its path and the step's peak is the worst of them; the
runner's recorded paths that no plan has taken yet are counted apart.

Measured: at SP 2 (``tests/annotate/test_segments_memory.py``) each path's peak equals a real
replayed step's ``LiveBytes`` count to the byte (but for a collective's buffers that gloo's
worker thread releases after the wait has let the step go on, ``LiveBytes.released_elsewhere``:
seen on one core, up to 48,000 B above the plan), and the allocator's to 20 B (bytes C++
allocates below the dispatcher); with ``x[mask]`` the plan is one copy of the gathered gradient above the
allocator (its backward scatters out of place under any dispatch mode, in place when nothing
watches). At dp 2 x sp 2, with and without sharded state
(``tests/annotate/test_segments_memory_mesh.py``): to the byte against ``LiveBytes``, the
allocator within 20 B on branches; where ``x[mask]`` all-gathers an activation over both axes
the allocator is 9-12% above (gloo's all-gather scratch below the dispatcher: a copy of the
input, a flat copy of the output on gloo's thread).

Not planned (refused as a ``ShardingError``): meta or fake arguments (the reads need values), a
compiled step (one program's is, ``spdsl.memory.compiled``; the segments are planned eager), on
a mesh a plan outside the job or with rows passed per data rank (``batch="local"``). Not
counted: the temporaries inside an op that makes a shape from data (``nonzero``, ``unique``:
only its outputs); the padding of an all-gather of uneven pieces; a collective's scratch below
the dispatcher (gloo's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref

import torch
from torch.distributed.tensor import DTensor

from spdsl._torch import FakeTensorMode, disable_current_modes, pop_mode_temporarily, tree_flatten
from spdsl.annotate.segment import Read, SegStep
from spdsl.annotate.segments_memory_mesh import (
    as_grad,
    check_mesh,
    leaf_specs,
    on_mesh,
    run_form,
    run_input,
    where_planned,
)
from spdsl.collectives import backward_order, made_whole, tie_order, unordered
from spdsl.errors import ShardingError
from spdsl.memory.fit import SIZING
from spdsl.memory.planner import _local_tokens
from spdsl.memory.report import MemoryPlan
from spdsl.memory.segmented import PathMemory, SegmentedMemoryPlan
from spdsl.memory.simulate import (
    MASTER,
    _adamw_state,
    _moment_dtype,
    _rng_states_counted,
    canonical_optimizer,
    optimizer_phase,
)
from spdsl.memory.tracker import LiveBytes
from spdsl.pipeline import Groups, planned_step, planning_group
from spdsl.pipeline.decide import out_nodes
from spdsl.pipeline.run import wrap_output
from spdsl.propagate.placement import PARTIAL, REPLICATE, Shard
from spdsl.remat import Remat

# the runner (``Segments``) -> {(call key, options): {path guards: PathMemory}}
_PLANNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plan_segmented(owner, args: tuple, kwargs: dict, error=None, *, remat=None,
                   rank: int = 0, optimizer: str = "adamw", optimizer_on_host: bool = False,
                   pinned_host: bool | None = None, compiled: bool | None = None
                   ) -> SegmentedMemoryPlan:
    """:func:`spdsl.memory.plan_memory` of a function that reads values: this call's path
    planned and added to the paths planned before (see the module docstring)."""
    from spdsl.annotate.breaks import planned_cut

    where = getattr(owner, "__qualname__", "")
    if compiled or (compiled is None and owner.compile):
        raise ShardingError(
            rule="data-dependent control flow", value="compile=True", where=where,
            detail="a function that reads values runs in segments; their compiled programs "
                   "are not planned",
            fix="plan_memory(..., compiled=False) plans the eager segments")
    if on_mesh(owner):
        check_mesh(owner, where)
    cut = planned_cut(owner, args, kwargs, error)
    if pinned_host is None:
        pinned_host = any(isinstance(a, torch.Tensor) and a.device.type == "cuda"
                          for a in tree_flatten((args, kwargs))[0])
    r = Remat.of(remat) if remat is not None else None
    plan, n_segs = _simulate_path(owner, cut, args, kwargs, rank=rank, remat=r,
                                  optimizer=optimizer, optimizer_on_host=optimizer_on_host,
                                  pinned_host=pinned_host)
    reads = [s for s in cut.path if _is_read(s)]
    guards = tuple(s.guard for s in reads)
    path = PathMemory(tuple(_shown(s) for s in reads), n_segs, plan, guards)
    seg = owner._segmented
    call = seg._key(args, kwargs)
    opts = (call, repr(remat), rank, optimizer, optimizer_on_host, pinned_host)
    planned = _PLANNED.setdefault(seg, {}).setdefault(opts, {})
    planned[guards] = path
    paths = tuple(planned.values())
    recorded = _recorded(seg.paths.get(call))
    return SegmentedMemoryPlan(paths, list(planned).index(guards),
                               len([g for g in recorded if g not in planned]))


def _simulate_path(owner, cut, args: tuple, kwargs: dict, *, rank: int, remat,
                   optimizer: str, optimizer_on_host: bool, pinned_host: bool
                   ) -> tuple[MemoryPlan, int]:
    """One fake step along ``cut``'s path (module docstring, step 3)."""

    optimizer = canonical_optimizer(optimizer, optimizer_on_host)
    mesh = on_mesh(owner)
    # on the sequence axis alone, a segment's job: its options against a planning group (read
    # here, before that group is up: a mesh made now would be made on it); on a mesh, each
    # segment is the run's own program (``run_form``) with the job's groups
    jobs = {} if mesh else {id(s.prog): s.prog.job for s in cut.path if isinstance(s, SegStep)}
    specs_in = leaf_specs(owner, args, kwargs) if mesh else None
    real = _planning_values(cut)
    n_state = len(cut.names)
    cpu = all(t.device.type in ("cpu", "meta") for t in real.values()
              if isinstance(t, torch.Tensor))
    tracker = LiveBytes(workspace=True, pinned=pinned_host)
    label, tokens, n_segs = "", None, 0
    with contextlib.ExitStack() as stack:
        group = stack.enter_context(planning_group(owner.parts)) if not mesh else None
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(unordered())
        # the function's parameters and buffers: one fake each, whichever segments use it (a
        # sharded parameter's: this rank's rows)
        fakes: dict = {("in", i): _fake_like(real[("in", i)]) for i in range(n_state)}
        params = [f for f in fakes.values() if f.requires_grad]
        states = {}
        if optimizer.startswith("adamw"):
            states = {i: _adamw_state(p, optimizer == MASTER, _moment_dtype(p.dtype, optimizer))
                      for i, p in enumerate(params)}
        tracker.register(list(fakes.values()), "parameter")
        tracker.register([t for st in states.values() for t in st if t is not None],
                         "host-pageable" if optimizer_on_host else "optimizer")
        # ("out", k, j) -> its placement as segment k hands it on; on a mesh (sequence
        # placement, data placement, output node, the groups segment k was lowered with)
        placed: dict = {}
        hooks = tracker.watch_gradients(params)
        try:
            with tracker, _rng_states_counted(tracker):
                # a replayed call (the steady state) holds the CPU generator's state from its
                # start to its end, to restore it on a path not recorded (``Segments._replay``)
                held = torch.get_rng_state() if cpu else None
                # the call's collectives in one backward order, as the run chains them: a
                # collective's backward holds what its forward saved until backward reaches it
                # (an all-reduced number Python reads keeps the tensors its ops saved)
                order = stack.enter_context(contextlib.ExitStack())
                order.enter_context(backward_order())
                for step in cut.path:
                    if not isinstance(step, SegStep):
                        with torch.no_grad():
                            _read(step, fakes, placed, real, group)
                        continue
                    k = n_segs
                    n_segs += 1
                    # the run's inputs need a gradient where the fake ones do (the planning
                    # values were computed without one): the program is built for that
                    grads = [_needs_grad(s, fakes, real) for s in step.srcs]
                    with disable_current_modes():      # built as the run builds it
                        if mesh:
                            specs = [specs_in[s[1] - n_state] if s[0] == "in" and
                                     s[1] >= n_state else None for s in step.srcs]
                            prog = run_form(owner, step.prog, specs)
                            job = prog.job
                            ins = tuple(run_input(s, g, real, fakes, placed)
                                        for s, g in zip(step.srcs, grads))
                        else:
                            prog = step.prog
                            job = dataclasses.replace(
                                jobs[id(prog)], data_axis=None, data_parts=1,
                                groups=Groups.planned(owner.parts, owner.axis, group, rank))
                            ins = tuple(as_grad(real[s] if s[0] in ("in", "out", "read")
                                                 else s[1], g)
                                        for s, g in zip(step.srcs, grads))
                        entry = prog.build(ins, {})
                        built = stack.enter_context(planned_step(
                            job, entry, ins, {}, SIZING, rank=None if mesh else rank,
                            remat=remat, compiled=False, optimizer=optimizer))
                    if k == 0:
                        label = f"{built.remat.describe()}, {where_planned(owner, built, rank)}"
                        tokens = _local_tokens(built.decisions, built.inputs)
                    # sharded parameters are the program's state (gathered where used)
                    own = [fakes[("in", cut.names.index(n))]
                           for n in built.decisions.traced.state_names]
                    xs = [_fake_input(s, spec, fakes, tracker, k)
                          for s, spec in zip(step.srcs, built.inputs)]
                    with torch.set_grad_enabled(step.grad):
                        outs = tree_flatten(tie_order(built.program(*own, *xs)))[0]
                    d = built.decisions
                    data_out = d.data_out or [REPLICATE] * len(outs)
                    for j, (o, q, dq, node) in enumerate(zip(
                            outs, d.out_placements, data_out, out_nodes(d.traced))):
                        if mesh:       # handed on as the run hands it on (a DTensor)
                            o = wrap_output(o, q, node, dq, built.groups)
                        fakes[("out", k, j)] = o
                        placed[("out", k, j)] = (q, dq, node, built.groups) if mesh else q
                    del xs, outs, own
                order.close()
                roots = [fakes[s] for s in cut.recipe if s[0] == "out"]
                roots = [o for o in dict.fromkeys(roots) if isinstance(o, torch.Tensor)
                         and o.requires_grad]
                tracker.mark("forward_end")
                for src in [s for s in fakes if s[0] in ("out", "read")]:
                    del fakes[src]              # the runner's values die with the call
                placed.clear()
                del held
                tracker.phase = "backward"
                if roots:
                    torch.autograd.backward(roots, [torch.ones_like(o) for o in roots])
                del roots
                optimizer_phase(tracker, params, states, optimizer, optimizer_on_host)
        finally:
            for h in hooks:
                h.remove()
    fwd = tracker.marks["forward_end"]
    return MemoryPlan.from_tracker(tracker, saved=fwd.get("activation", 0), tokens=tokens,
                                   label=label), n_segs


def _planning_values(cut) -> dict:
    """Source -> the global value the planning run gave it (arguments, parameters, segments'
    outputs, reads' results)."""
    real = {cut.src[n]: v for n, v in cut.env.items() if n in cut.src}
    real.update({src: t for t, src in cut.made.values()})
    return real


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    grad = t.requires_grad
    if isinstance(t, DTensor):              # a sharded parameter: this rank's rows
        t = t._local_tensor
    f = torch.empty(t.shape, dtype=t.dtype, device=t.device if not t.is_meta else "cpu")
    return f.requires_grad_(True) if grad else f


def _needs_grad(src: tuple, fakes: dict, real: dict) -> bool:
    if src[0] == "out":
        return fakes[src].requires_grad
    return src[0] == "in" and real[src].requires_grad


def _fake_input(src: tuple, spec, fakes: dict, tracker: LiveBytes, k: int):
    """What segment ``k`` reads for ``src``: a parameter's or an earlier segment's fake itself;
    an argument's piece (a view of the global argument in the run, held before the step: an
    input, as one program's are); a constant of the function (held before the step too)."""
    kind = src[0]
    if kind == "in" and src in fakes:               # a parameter or a buffer
        return fakes[src]
    if kind in ("in", "const"):
        key = (kind, src[1] if kind == "in" else id(src[1]), tuple(spec.shape))
        if key not in fakes:
            with _quiet(tracker):
                fakes[key] = spec.fake()
            tracker.register([fakes[key]], "input")
        return fakes[key]
    if kind in ("out", "read"):
        got = fakes[src]
        if isinstance(got, DTensor):        # its piece, as the run's program takes it
            got = got.to_local()
        if tuple(got.shape) != tuple(spec.shape):
            raise ShardingError(
                rule="segment memory plan", value=f"{src}: {tuple(got.shape)}",
                where=f"segment {k}",
                detail=f"the segment's program reads a piece of shape {tuple(spec.shape)}",
                fix="plan with the options the run uses")
        return got
    return src[1]                                    # a literal


@contextlib.contextmanager
def _quiet(tracker: LiveBytes):
    """Allocations the tracker must not see (tensors held before the step, registered)."""
    with pop_mode_temporarily() as mode:
        if mode is not tracker:
            raise RuntimeError("the memory tracker is not the innermost mode")
        yield


def _whole(src: tuple, fakes: dict, placed: dict, group: str | None):
    """A value read, made whole as the run makes it (``DTensor.full_tensor``)."""
    v = fakes.get(src)
    q = placed.get(src)
    if src[0] != "out" or v is None:
        return v              # an argument, a parameter, a read's result: whole already
    if isinstance(q, tuple):  # on a mesh: the run's DTensor, made whole over both axes
        return v.full_tensor() if isinstance(v, DTensor) else v
    if q == PARTIAL:
        return made_whole(v, group)
    if isinstance(q, Shard):
        return made_whole(v, group, q.dim)
    return v


def _read(read, fakes: dict, placed: dict, real: dict, group: str | None) -> None:
    """A read (``spdsl.annotate.segment.Read``): its values made whole (freed once read) and
    the tensors it makes (inputs of later segments: ``x[mask]``'s indices, ``unique``'s
    output), allocated as the real ones are laid out."""
    srcs = [read.srcs] if read.kind == "item" else read.srcs if read.kind == "mask" \
        else [s for s in read.srcs[1] if s[0] != "lit"]
    whole = [_whole(s, fakes, placed, group) for s in srcs]
    made = sorted((src, t) for src, t in real.items()
                  if src[0] == "read" and src[1] == read.index)
    bases: dict = {}
    for src, t in made:
        st = t.untyped_storage()
        base = bases.get(st.data_ptr())
        if base is None:
            base = bases[st.data_ptr()] = torch.empty(st.nbytes() // t.element_size(),
                                                      dtype=t.dtype, device=t.device)
        fakes[src] = base.as_strided(t.shape, t.stride(), t.storage_offset())
    del whole


def _is_read(step) -> bool:
    return isinstance(step, Read)


def _shown(read) -> str:
    """A read's value as Python saw it (a number or a bool), or what it made."""
    if read.kind == "item":
        return read.guard[1]
    if read.kind == "mask":
        return "x[mask] " + "x".join(str(s[0]) for s in read.guard[:1]) + " picked"
    return read.brk.kind if read.brk is not None else "a shape from data"


def _recorded(node, guards: tuple = ()) -> list[tuple]:
    """The guards of every path recorded under ``node`` (``Segments.paths``)."""
    if node is None:
        return []
    if node.read is None:
        return [guards]
    return [g for guard, kid in node.kids.items() for g in _recorded(kid, guards + (guard,))]
