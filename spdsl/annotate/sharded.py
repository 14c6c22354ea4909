"""``Sharded``: a function made to run split over a mesh, and what it decided per call signature.

A sharded function traces itself on first call (and again only when shapes, dtypes or specs
change), reads its arguments, constraints and ``out_specs`` into placements (``Starts``) and
hands them to the pipeline (``spdsl.pipeline``), which decides (``decide``), builds this
rank's program (``build_step``) and runs it (``run``). ``Sharded`` is assembled from the parts
of the public layer: ``options.py`` (every option, read once), ``specs.py`` (arguments to
placements, ``with_sharding_constraint``), ``sharded_params.py`` (parameters sharded when
wrapped), ``runtime.py`` (the same-batch check); this module keeps the mesh, one frozen
:class:`Entry` per call signature, and the call itself. ``api.py`` holds the public
transforms that make one.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
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
from spdsl.annotate.runtime import Runtime
from spdsl.annotate.sharded_params import StateSharding
from spdsl.annotate.spec import P
from spdsl.annotate.specs import InputSpecs, _axis_of, _check_specs, _decode
from spdsl.errors import one_error_per_job
from spdsl.inspect.decided import plan_of
from spdsl.inspect.plan import PlanSources, ShardingPlan
from spdsl.inspect.program import read_program
from spdsl.memory.fit import SIZING
from spdsl.memory.planner import plan_entry
from spdsl.pipeline import Decisions, Groups, Job, Starts, Step, build_step, decide, run
from spdsl.pipeline.decide import out_nodes
from spdsl.propagate.modes import describe_change, global_modes, module_modes
from spdsl.propagate.placement import REPLICATE, Shard
from spdsl.propagate.trace import Traced, trace
from spdsl.propagate.trace_refusals import GraphBreak
from spdsl.propagate.trace_state import reachable_modules
from spdsl.remat import Remat

# programs traced by one step before it says why: train/eval x autocast x grad mode x a few
# lengths are legitimately that many; state that changes every call reaches it at once
_RETRACE_WARN = 16


@dataclass(frozen=True)
class Entry:
    """What one call signature decided and built: ``decisions`` (``spdsl.pipeline.decide``),
    the ``plan`` of them (``spdsl.inspect``) and, once a call has built it, ``step`` (this
    rank's program, ``spdsl.pipeline.Step``). Replaced, never changed, when the step is built
    or ``remat="fit"`` chooses."""

    decisions: Decisions
    plan: ShardingPlan
    step: Step | None = None

    # the decisions read through the entry (segments, the plan's readers)
    traced = property(lambda self: self.decisions.traced)
    prop = property(lambda self: self.decisions.prop)
    in_placements = property(lambda self: self.decisions.in_placements)
    out_placements = property(lambda self: self.decisions.out_placements)
    data = property(lambda self: self.decisions.data)
    data_in = property(lambda self: self.decisions.data_in)
    data_out = property(lambda self: self.decisions.data_out)
    sharded = property(lambda self: self.decisions.sharded)

    @property
    def local(self):
        """The program that runs (None before the step is built)."""
        return None if self.step is None else self.step.program

    @property
    def remat(self) -> Remat | None:
        """The mode ``remat="fit"`` chose for this program (None: not built, or not "fit")."""
        return self.step.remat if self.step is not None and self.step.why is not None else None

    def stale(self) -> bool:
        return self.decisions.stale()


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
        self._cache: dict[Any, Entry] = {}        # call signature -> what it decided, built
        self._agreed: set = set()     # signatures whose trace the ranks put in one order
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

    def build(self, args: tuple, kwargs: dict, agree: bool = False, *,
              fit: bool = False) -> Entry:
        """Trace and decide (cached per call signature). ``agree``: the run's build, on every
        rank of the mesh at once: the ranks' programs are put in one order first
        (``spdsl.pipeline.decide.one_order``); the plan's build (one rank may ask) exchanges
        nothing. ``fit``: under ``remat="fit"``, the plan's mode is chosen now."""
        key, entry = self._entry(args, kwargs, agree)
        if fit and self.remat.fit and entry.plan.remat is None:
            entry = replace(entry, plan=self._planned(entry.plan, entry.decisions, args,
                                                      kwargs, fit=True))
            self._cache[key] = entry
        return entry

    def _entry(self, args: tuple, kwargs: dict, agree: bool) -> tuple[tuple, Entry]:
        leaves, spec = tree_flatten((args, kwargs))
        key = self._key(args, kwargs, leaves, spec)
        cached = self._cache.get(key)
        if cached is not None and not cached.stale():
            if not agree or key in self._agreed or not self._same_order(cached.traced.graph):
                if agree:
                    self._agreed.add(key)
                return key, cached
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
        decisions = decide(traced, self._starts(traced, leaves, placements, data_in),
                           self.job)
        entry = Entry(decisions, self._planned(plan_of(decisions), decisions, args, kwargs))
        self._cache[key] = entry
        if agree:
            self._agreed.add(key)
        else:
            self._agreed.discard(key)
        return key, entry

    def _starts(self, traced: Traced, leaves: list, placements: list, data_in: list) -> Starts:
        """What the arguments, ``with_sharding_constraint`` and ``out_specs`` say, as
        placements (``spdsl.pipeline.decide.Starts``)."""
        constraints = []
        for node in traced.graph.graph.nodes:
            if node.target is torch.ops.spdsl.constraint.default:
                sp, val = _decode(node.args[1]), node.meta["val"]
                data = self._data_placement_of(val, sp, -1) if self.data_parts > 1 and \
                    self.data_axis in sp else None
                constraints.append((node, self._placement_of(val, sp, -1) if len(sp)
                                    else REPLICATE, data))
        return Starts(tuple(placements), tuple(data_in),
                      tuple(leaves[i].requires_grad for i in traced.tensor_leaf_index),
                      tuple(constraints), self._out_pins(traced), self._hands_on_partial())

    def _out_pins(self, traced: Traced) -> tuple:
        """Per output, the placement ``out_specs`` gives it (None: as propagated)."""
        if self.out_specs is None:
            return ()
        specs = self.out_specs if isinstance(self.out_specs, (list, tuple)) and not \
            isinstance(self.out_specs, P) else [self.out_specs]
        pins = []
        for i, o in enumerate(out_nodes(traced)):
            val = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
            if not isinstance(val, torch.Tensor) or i >= len(specs) or specs[i] is None:
                pins.append(None)
            else:
                pins.append(self._placement_of(val, specs[i], i) if len(specs[i]) else REPLICATE)
        return tuple(pins)

    def _hands_on_partial(self) -> bool:
        """Whether outputs that are partial sums stay so (a segment's, ``annotate.breaks``)."""
        return False

    def _planned(self, plan: ShardingPlan, decisions: Decisions, args: tuple, kwargs: dict, *,
                 fit: bool = False, chosen: Remat | None = None) -> ShardingPlan:
        """``plan`` with what it computes when first asked, from the pipeline's records only
        (``PlanSources``): the calls this call's program runs (``spdsl.inspect.program``) and
        its memory. ``fit=True``: the program is read now, ``remat="fit"`` choosing the mode
        (``plan.remat``); ``chosen``: the mode the run chose (``Entry.remat``)."""
        job = self.job
        extra = self._check_collectives(tree_flatten((args, kwargs))[0])
        program = functools.partial(read_program, job, decisions, args, kwargs, extra=extra,
                                    chosen=chosen)
        if fit:
            read = program(plan, fit=True)
            program, plan = (lambda _: read), replace(plan, remat=read.chosen)
        memory = functools.partial(plan_entry, job, decisions, args, kwargs, chosen=chosen)
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

    def prepare(self, *args, **kwargs) -> Entry | None:
        """Trace, decide and build this rank's program for these arguments without running
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
            key, entry = self._entry(args, kwargs, agree=True)
        except GraphBreak as e:
            segmented(self, args, kwargs, e)     # raises where segments cannot run
            return None
        if entry.step is None:
            # -- lower for this rank, kernels, remat, compile: one pipeline (spdsl.pipeline) --
            step = build_step(replace(self.job, groups=self.groups), entry.decisions, args,
                              kwargs, SIZING)
            plan = entry.plan
            if step.why is not None:   # remat="fit": what was chosen, once per program
                plan = self._planned(replace(plan, remat=step.why), entry.decisions, args,
                                     kwargs, chosen=step.remat)
            entry = self._cache[key] = replace(entry, plan=plan, step=step)
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
                   groups=self.groups if fits else None, strict=self.strict,
                   attention=self.attention, shard_state=self.shard_state)

    def segments_runner(self):
        """This function's runner of calls that read tensor values in Python
        (``spdsl.annotate.breaks.Segments``), made when a call first shows one."""
        if self._segmented is None:
            from spdsl.annotate.breaks import Segments
            self._segmented = Segments(self)
        return self._segmented

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
        return run(entry.step, args, kwargs, batch=self.batch)
