"""``Sharded``: a function made to run split over a mesh, and what it decided per call signature.

A sharded function traces itself on first call (and again only when shapes, dtypes or specs
change), propagates placements, has the pipeline (``spdsl.pipeline``) build this rank's
program and runs it on local tensors. ``Sharded`` is assembled from the parts of the job:
``options.py`` (every option, read once), ``specs.py`` (arguments to placements,
``with_sharding_constraint``), ``state.py`` (sharded parameters), ``runtime.py`` (local inputs
in, DTensors out); this module keeps the mesh, the cache of decisions per call signature, and
the call itself. ``api.py`` holds the public transforms that make one.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import spdsl.collectives as C
import spdsl.watchdog as watchdog
from spdsl._torch import tree_flatten, tree_unflatten
from spdsl.annotate.mesh import axis_size
from spdsl.annotate.mesh import mesh as make_mesh
from spdsl.annotate.options import ShardOptions
from spdsl.annotate.runtime import Runtime, _out_nodes
from spdsl.annotate.sharded_params import StateSharding
from spdsl.annotate.spec import P
from spdsl.annotate.specs import (
    InputSpecs,
    _axis_of,
    _check_specs,
    _decode,
)
from spdsl.errors import one_error_per_job
from spdsl.inspect.decided import build_plan
from spdsl.inspect.plan import PlanSources, ShardingPlan
from spdsl.inspect.program import read_program
from spdsl.memory.fit import SIZING
from spdsl.memory.planner import plan_entry
from spdsl.pipeline import Groups, Job, build_step
from spdsl.propagate.engine import Propagator
from spdsl.propagate.modes import describe_change, global_modes, module_modes, run_modes
from spdsl.propagate.placement import (
    REPLICATE,
    Placement,
    Shard,
)
from spdsl.propagate.trace import Traced, trace
from spdsl.propagate.trace_refusals import GraphBreak
from spdsl.propagate.trace_state import reachable_modules

# programs traced by one step before it says why: train/eval x autocast x grad mode x a few
# lengths are legitimately that many; state that changes every call reaches it at once
_RETRACE_WARN = 16


@dataclass
class _Compiled:
    traced: Traced
    prop: Propagator
    in_placements: list[Placement]
    out_placements: list[Placement]
    plan: ShardingPlan
    local: Any = None
    state_requires: tuple = ()
    data: Any = None                  # the data axis' Propagator (a dp axis of size > 1)
    data_in: list[Placement] = field(default_factory=list)
    data_out: list[Placement] = field(default_factory=list)
    input_shapes: list = field(default_factory=list)    # what this rank's inputs look like
    sharded: list = field(default_factory=list)    # lower.param_gather.ShardedInput each
    remat: Any = None         # the Remat remat="fit" chose for this program
    step: Any = None          # spdsl.pipeline.Step: this rank's program, as built
    agreed: bool = False      # the ranks' traces were put in one order (Runtime._same_order)

    def stale(self) -> bool:
        """A parameter was frozen or unfrozen since the trace: which gradients exist, and so
        the plan and its lowering (tables built per rank, say), may differ."""
        return tuple(t.requires_grad for t in self.traced.state) != self.state_requires


class Sharded(InputSpecs, StateSharding, Runtime):
    """A function (or module) made to run split over one mesh axis. See ``shard``."""

    def __init__(self, fn: Callable, *, mesh=None, in_specs=None, out_specs=None,
                 axis: str | None = None, parts: int | None = None,
                 options: ShardOptions | None = None, **option_kwargs) -> None:
        """``options``, or the keyword arguments ``ShardOptions.of`` takes (``compile``,
        ``remat``, ``seq_dim``, ...)."""
        one_error_per_job()       # under torchrun: a ShardingError prints once (spdsl.errors)
        if options is None:
            options = ShardOptions.of(**option_kwargs)
        elif option_kwargs:
            raise TypeError(f"Sharded takes options= or option keywords, not both: "
                            f"{sorted(option_kwargs)}")
        _check_specs(in_specs, "in_specs")
        _check_specs(out_specs, "out_specs")
        self.fn, self._mesh, self.in_specs, self.out_specs = fn, mesh, in_specs, out_specs
        self.options = options
        self._groups: Groups | None = None     # made once, from the mesh (self.groups)
        self._state_mesh = None
        self.axis = axis or _axis_of(in_specs) or "sp"
        self._parts = parts
        self._cache: dict[Any, _Compiled] = {}
        self._traces, self._last_key = 0, None     # programs traced, the last one's key
        self._segmented = None     # spdsl.annotate.breaks: how calls that read values run
        functools.update_wrapper(self, getattr(fn, "forward", fn), updated=())
        if isinstance(fn, torch.nn.Module):
            self.module = fn
        if options.shard_state:
            self._shard_state(reachable_modules(fn, (), {}))

    # -- the options (spdsl.annotate.options), read where they are used ----------------------
    seq_dim = property(lambda self: self.options.seq_dim)
    compile = property(lambda self: self.options.compile)
    debug = property(lambda self: self.options.debug)
    remat = property(lambda self: self.options.remat)
    kernels = property(lambda self: self.options.kernels)
    shard_state = property(lambda self: self.options.shard_state)
    batch = property(lambda self: self.options.batch)
    strict = property(lambda self: self.options.strict)
    attention = property(lambda self: self.options.attention)

    def __getattr__(self, name: str):
        # a wrapped module keeps its own attributes (parameters(), train(), ...)
        module = self.__dict__.get("module")
        if module is not None:
            return getattr(module, name)
        raise AttributeError(name)

    # -- mesh and group -------------------------------------------------------------------
    @property
    def parts(self) -> int:
        if self._parts is None:
            self._parts = axis_size(self.mesh, self.axis)
        return self._parts

    @property
    def mesh(self):
        if self._mesh is None:
            world = dist.get_world_size() if dist.is_initialized() else self._parts
            if world is not None and self._parts and world > self._parts and \
                    world % self._parts == 0:
                self._mesh = make_mesh(dp=world // self._parts, **{self.axis: self._parts})
            else:
                self._mesh = make_mesh(**{self.axis: self._parts})
        return self._mesh

    @property
    def groups(self) -> Groups:
        """Every process group of the job (``spdsl.pipeline.Groups``), decided once from the
        mesh: the sequence and data axes' groups, the group of every rank where the mesh has
        more than the sequence axis or the parameters are sharded, hybrid attention's."""
        if self._groups is None:
            mesh = self.mesh
            every = self.data_parts > 1 or self._state_mesh is not None or \
                self.parts < mesh.size()
            self._groups = Groups.of_mesh(mesh, self.axis, self.data_axis,
                                          self._world() if every else None)
        return self._groups

    def _group_and_rank(self, axis: str | None = None) -> tuple[str, int]:
        g = self.groups
        if axis in (None, self.axis):
            return g.group, g.rank
        return g.data_group, g.data_rank

    # -- the data axis and sharded state ------------------------------------------------------
    @property
    def data_axis(self) -> str | None:
        """The mesh axis the batch is split over (``dp``), or None: named in the specs (by
        ``shard``), or the other axis of a two-axis mesh (``sp_shard``)."""
        if self._mesh is None and not dist.is_initialized():
            return None          # planning without a mesh: one axis
        named = _axis_of(self.in_specs, skip=self.axis) if self.in_specs is not None else None
        if named is not None:
            return named
        if self.seq_dim is None:
            return None
        names = [n for n in (self.mesh.mesh_dim_names or ()) if n != self.axis]
        return names[0] if len(names) == 1 and axis_size(self.mesh, names[0]) > 1 else None

    @property
    def data_parts(self) -> int:
        ax = self.data_axis
        return 1 if ax is None else axis_size(self.mesh, ax)

    def _world(self):
        """A one-axis mesh over every rank of the mesh: sums over both axes, parameter
        gathers and their gradients' reduce-scatters."""
        if self._state_mesh is None:
            from spdsl.sharded_state import state_mesh
            self._state_mesh = state_mesh(self.mesh)
        return self._state_mesh


    # -- specs ----------------------------------------------------------------------------


    # -- build and run --------------------------------------------------------------------
    def _key(self, args, kwargs, leaves, spec) -> tuple:
        """What the program depends on besides the inputs' values (``propagate.modes``):
        a change picks (or traces) the program made under the same state."""
        inputs = (spec, tuple((tuple(x.shape), x.dtype, x.device, isinstance(x, DTensor),
                               x.requires_grad)
                              if isinstance(x, torch.Tensor) else ("c", repr(x))
                              for x in leaves))
        return inputs, (global_modes(), module_modes(reachable_modules(self.fn, args, kwargs)))

    def build(self, args: tuple, kwargs: dict, agree: bool = False) -> _Compiled:
        """Trace and propagate (cached per call signature). ``agree``: the run's build, on
        every rank of the mesh at once: the ranks' programs are put in one order first
        (``spdsl.propagate.order``); the plan's build (one rank may ask) exchanges nothing."""
        leaves, spec = tree_flatten((args, kwargs))
        key = self._key(args, kwargs, leaves, spec)
        cached = self._cache.get(key)
        if cached is not None and not cached.stale():
            if not agree or cached.agreed or not self._same_order(cached.traced.graph):
                cached.agreed = cached.agreed or agree
                return cached
            traced = cached.traced          # traced before the ranks compared: decide again
        else:
            traced = None
            self._note_retrace(key)
        specs = self._specs_for(args, kwargs, leaves)
        placements = self._leaf_placements(leaves, specs)
        data_in = [self._data_placement_of(x, specs[i] if specs is not None else None, i)
                   for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        if traced is None:
            targs, tkwargs = self._global_args(args, kwargs, leaves, data_in)
            traced = self._trace(targs, tkwargs)
            if agree:
                self._same_order(traced.graph)
        gm = traced.graph
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        n_state = len(traced.state)
        inputs, requires = {}, {}
        for j, ph in enumerate(phs):
            if j < n_state:
                inputs[ph] = (REPLICATE, f"parameter {traced.state_names[j]}")
                requires[ph] = traced.state[j].requires_grad
            else:
                p, origin = placements[j - n_state]
                inputs[ph] = (p, origin)
                requires[ph] = leaves[traced.tensor_leaf_index[j - n_state]].requires_grad
            ph.meta["spdsl_requires_grad"] = requires[ph]
        for node in gm.graph.nodes:
            if node.target is torch.ops.spdsl.constraint.default:
                sp = _decode(node.args[1])
                val = node.meta["val"]
                node.meta["spdsl_constraint"] = self._placement_of(val, sp, -1) if len(sp) \
                    else REPLICATE
        dprop, data_out = None, []
        if self.data_parts > 1:      # first: the sequence axis must not cut what dp splits
            dprop, data_out = self._propagate_data(traced, phs, data_in)
        prop = Propagator(gm, self.parts, self.axis, gathers="error" if self.strict else "warn",
                          attention=self.attention, taken=dprop)
        prop.run(inputs)
        outs = self._out_placements(traced, prop)
        sharded = self._check_state_sharded(traced)
        reduced = self._state_reduced(traced, prop, dprop, outs, data_out, sharded)
        plan = build_plan(prop, requires, outs, frozenset(
            phs[s.index].name for s in sharded if reduced.get(s.index)))
        if dprop is not None or sharded:
            from spdsl.inspect.mesh_plan import with_mesh_collectives
            plan = with_mesh_collectives(plan, gm, dprop, requires, data_out, sharded,
                                         reduced, self._regathered(phs, sharded))
        entry = _Compiled(traced, prop, [p for p, _ in placements], outs, plan,
                          state_requires=tuple(t.requires_grad for t in traced.state),
                          data=dprop, data_in=data_in, data_out=data_out, sharded=sharded,
                          agreed=agree)
        entry.plan = self._planned(plan, entry, args, kwargs)
        self._cache[key] = entry
        return entry

    def _planned(self, plan: ShardingPlan, entry: _Compiled, args: tuple, kwargs: dict, *,
                 fit: bool = False) -> ShardingPlan:
        """``plan`` with what it computes when first asked, from the pipeline's records only
        (``PlanSources``): the calls this call's program runs (``spdsl.inspect.program``) and
        its memory. ``fit=True``: the program is read now, ``remat="fit"`` choosing the mode
        (``plan.remat``)."""
        job = self.job
        extra = self._check_collectives(tree_flatten((args, kwargs))[0])
        program = functools.partial(read_program, job, entry, args, kwargs, extra=extra)
        if fit:
            read = program(plan, fit=True)
            program, plan = (lambda _: read), replace(plan, remat=read.chosen)
        memory = functools.partial(plan_entry, job, entry, args, kwargs)
        return replace(plan, remat_mode=job.remat.describe(),
                       sources=PlanSources(program, memory))

    def _trace(self, args: tuple, kwargs: dict) -> Traced:
        return trace(self.fn, args, kwargs)

    def _note_retrace(self, key: tuple) -> None:
        """A step that keeps tracing anew is slow, and usually a sign of state that changes
        every call (a counter on a module): at the ``_RETRACE_WARN``-th program, say what
        changed from the one before, once. Programs picked again from the cache count once."""
        self._traces += 1
        last, self._last_key = self._last_key, key
        if self._traces == _RETRACE_WARN and last is not None:
            what = describe_change(last, key)
            name = getattr(self, "__name__", "a sharded step")
            warnings.warn(f"spdsl: {name} traced {self._traces} programs; the last "
                          f"change: {what}. Each train/eval, autocast, grad-mode or shape "
                          "change picks its own program; state that changes every call "
                          "retraces every call", stacklevel=4)

    def _global_args(self, args, kwargs, leaves, data_in):
        """``batch="local"``: each dp group passed its own rows; the trace sees the global
        batch (uninitialised rows: tracing reads shapes only)."""
        if self.batch != "local" or self.data_parts == 1:
            return args, kwargs
        new, j = list(leaves), 0
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                p = data_in[j]
                j += 1
                if isinstance(p, Shard) and not isinstance(x, DTensor):
                    shape = list(x.shape)
                    shape[p.dim] = p.size
                    new[i] = torch.empty(shape, dtype=x.dtype, device=x.device)
        return tree_unflatten(new, tree_flatten((args, kwargs))[1])

    def _propagate_data(self, traced: Traced, phs, data_in):
        """The same rules over the same graph for the data axis: where batch rows meet."""
        gm = traced.graph
        n_state = len(traced.state)
        inputs = {}
        for j, ph in enumerate(phs):
            inputs[ph] = (REPLICATE, "parameter") if j < n_state else \
                (data_in[j - n_state], f"in_specs[{j - n_state}] over {self.data_axis!r}")
        saved = {}
        for node in gm.graph.nodes:      # constraints that name no data axis leave it alone
            if node.target is torch.ops.spdsl.constraint.default:
                saved[node] = node.meta["spdsl_constraint"]
                sp = _decode(node.args[1])
                node.meta["spdsl_constraint"] = self._data_placement_of(
                    node.meta["val"], sp, -1) if self.data_axis in sp else None
        try:
            dprop = Propagator(gm, self.data_parts, self.data_axis)
            dprop.run(inputs)
        finally:
            for node, c in saved.items():
                node.meta["spdsl_constraint"] = c
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        data_out = []
        for o in out_node.args[0]:
            val = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
            have = dprop.placement(o) if isinstance(val, torch.Tensor) else REPLICATE
            keep = isinstance(have, Shard) and have.outer == 1 and \
                have.size == val.shape[have.dim]
            data_out.append(have if keep else REPLICATE)
        return dprop, data_out


    def _out_placements(self, traced: Traced, prop: Propagator) -> list[Placement]:
        out_node = next(n for n in traced.graph.graph.nodes if n.op == "output")
        outs = []
        specs = None
        if self.out_specs is not None:
            specs = self.out_specs if isinstance(self.out_specs, (list, tuple)) and not \
                isinstance(self.out_specs, P) else [self.out_specs]
        for i, o in enumerate(out_node.args[0]):
            val = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
            if not isinstance(val, torch.Tensor):
                outs.append(REPLICATE)
                continue
            if specs is not None and i < len(specs) and specs[i] is not None:
                outs.append(self._placement_of(val, specs[i], i) if len(specs[i]) else REPLICATE)
                continue
            have = prop.placement(o)
            if isinstance(have, Shard) and have.outer == 1 and have.size == val.shape[have.dim]:
                outs.append(have)
            else:
                outs.append(REPLICATE)
        return outs

    def prepare(self, *args, **kwargs) -> _Compiled | None:
        """Trace, propagate and build this rank's program for these arguments without running
        it (no collective runs): what a call does first. A rank that fails here fails before
        any exchange, so the others are not left waiting in one.

        Example::

            step = spdsl.sp_shard(seq=4)(model)
            step.prepare(input_ids, labels)      # errors now, on every rank alike
            loss = step(input_ids, labels)

        A function that reads tensor values in Python has no one program: it runs in segments
        (``spdsl.annotate.breaks``), built as the call reaches them; here it returns None.
        """
        from spdsl.annotate.breaks import segmented
        if segmented(self, args, kwargs) is not None:
            return None
        try:
            entry = self.build(args, kwargs, agree=True)
        except GraphBreak as e:
            segmented(self, args, kwargs, e)     # raises where segments cannot run
            return None
        if entry.local is None:
            # -- lower for this rank, kernels, remat, compile: one pipeline (spdsl.pipeline) --
            entry.step = build_step(replace(self.job, groups=self.groups), entry, args,
                                    kwargs, SIZING)
            entry.local = entry.step.program
            entry.input_shapes = [s.shape for s in entry.step.inputs]
            if entry.step.why is not None:   # remat="fit": what was chosen, once per program
                entry.remat = entry.step.remat
                entry.plan = replace(entry.plan, remat=entry.step.why)
        return entry

    @property
    def job(self) -> Job:
        """This function as the pipeline sees it (``spdsl.pipeline.Job``): axes, options and,
        inside a job the mesh fits, its process groups (``groups``)."""
        fits = dist.is_initialized() and (self._mesh is not None or
                                          dist.get_world_size() % self.parts == 0)
        return Job(parts=self.parts, axis=self.axis, data_axis=self.data_axis,
                   data_parts=self.data_parts, remat=self.remat, kernels=self.kernels,
                   compile=self.compile, batch=self.batch,
                   groups=self.groups if fits else None)

    def runs_in_segments(self, args: tuple, kwargs: dict) -> bool:
        """Whether calls like this one run in segments (the function reads tensor values in
        Python, ``spdsl.annotate.breaks``), as far as calls so far have shown."""
        from spdsl.annotate.breaks import segmented
        return segmented(self, args, kwargs) is not None

    def segments_memory(self, args: tuple, kwargs: dict, error: GraphBreak | None = None,
                        **options):
        """``spdsl.memory.plan_memory`` of a call that runs in segments: the path these (real)
        arguments take, added to the paths planned before (``spdsl.annotate.segments_memory``);
        ``error``: the read that made the trace stop, if the call is the first to show one."""
        from spdsl.annotate.segments_memory import plan_segmented
        return plan_segmented(self, args, kwargs, error, **options)

    def __call__(self, *args, **kwargs):
        from spdsl.annotate.breaks import segmented
        entry = self.prepare(*args, **kwargs)
        self._check_same_inputs(args, kwargs, full=self.debug)   # 16 B per input (runtime.py)
        watchdog.set_check_order(self.debug)    # each collective compared across its group
        if entry is None:                      # a function that reads values: in segments
            with C.backward_order():
                return segmented(self, args, kwargs)(args, kwargs)
        state = [t.to_local() if isinstance(t, DTensor) else t for t in entry.traced.state]
        with run_modes(), C.backward_order():   # the trace's casts are ops of the program
            outs = C.tie_order(entry.local(*state, *self._local_inputs(entry, args, kwargs)))
        data_out = entry.data_out or [REPLICATE] * len(entry.out_placements)
        wrapped = [self._wrap(o, p, node, dp) for o, p, node, dp in zip(
            outs, entry.out_placements, _out_nodes(entry.traced), data_out)]
        return tree_unflatten(wrapped, entry.traced.out_spec)
