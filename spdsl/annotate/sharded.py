"""``Sharded``: a function made to run split over a mesh.

``Sharded`` holds what the user wrote, as values: the function, its options (``options.py``,
every option read once), its specs, the mesh and the process groups made from it. A call
hands them to the pipeline (``spdsl.pipeline``), which keeps the function's programs, one per
call signature (``programs.py``: key, trace, starts, decide, build), checks that the ranks
passed the same batch (``same_batch.py``) and runs the program (``run.py``). The plan of a call
(``spdsl.inspect``) is made only when asked (:meth:`Sharded.plan_call`). ``api.py`` holds the
public transforms that make one; ``sharded_params.py`` shards the parameters when wrapped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import spdsl.collectives as C
import spdsl.watchdog as watchdog
from spdsl._torch import tree_flatten
from spdsl.annotate.mesh import axis_size
from spdsl.annotate.mesh import mesh as make_mesh
from spdsl.annotate.options import ShardOptions
from spdsl.annotate.sharded_params import StateSharding
from spdsl.annotate.specs import _axis_of, _check_specs
from spdsl.errors import one_error_per_job
from spdsl.inspect.decided import plan_of
from spdsl.inspect.plan import Collective, PlanSources, ShardingPlan
from spdsl.inspect.program import read_program
from spdsl.memory.fit import SIZING
from spdsl.memory.planner import plan_entry
from spdsl.pipeline import Groups, Job, run
from spdsl.pipeline.programs import Entry, Programs
from spdsl.pipeline.same_batch import check_same_inputs
from spdsl.pipeline.starts import Reading
from spdsl.propagate.trace import Traced
from spdsl.propagate.trace_refusals import GraphBreak
from spdsl.propagate.trace_state import reachable_modules

__all__ = ["Entry", "Sharded"]


class Sharded(StateSharding):
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
        self._segmented = None     # spdsl.annotate.breaks: how calls that read values run
        functools.update_wrapper(self, getattr(fn, "forward", fn), updated=())
        # the function's programs, one per call signature (spdsl.pipeline.programs), and the
        # plans asked of them (plan_of)
        self._programs = Programs(getattr(self, "__name__", "a sharded step"))
        self._plans: dict[int, tuple] = {}
        # (options, value): kept once the mesh is made, made again if the options change
        self._reading: tuple | None = None
        self._job: tuple | None = None           # the run's Job, with the job's groups
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

    # -- what the pipeline is handed ------------------------------------------------------
    @property
    def reading(self) -> Reading:
        """How this function's arguments are read into placements
        (``spdsl.pipeline.starts.Reading``): axes, specs, ``seq_dim``, ``batch``."""
        if self._reading is not None and self._reading[0] is self.options:
            return self._reading[1]
        reading = Reading(self.axis, self.parts, self.data_axis, self.data_parts, self.batch,
                          self.seq_dim, self.in_specs, self.out_specs,
                          tuple(self._mesh.mesh_dim_names or ())
                          if self._mesh is not None else None, **self._reading_extra())
        if self._mesh is not None:       # the mesh made, only the options may change it
            self._reading = (self.options, reading)
        return reading

    def _reading_extra(self) -> dict:
        return {}

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

    def _run_job(self) -> Job:
        """The job a run builds with: the running job's process groups."""
        if self._job is None or self._job[0] is not self.options:
            self._job = (self.options, replace(self.job, groups=self.groups))
        return self._job[1]

    def _traced(self) -> Traced | None:
        """The program already traced, if the function has one (a segment's), else None."""
        return None

    # -- build, plan and run ------------------------------------------------------------------
    @property
    def _cache(self) -> dict:
        """Call key -> ``spdsl.pipeline.programs.Entry``."""
        return self._programs.cache

    @property
    def _traces(self) -> int:
        return self._programs.traces

    def build(self, args: tuple, kwargs: dict, agree: bool = False) -> Entry:
        """Trace and decide (cached per call signature). ``agree``: the run's build, on every
        rank of the mesh at once: the ranks' programs are put in one order first
        (``spdsl.pipeline.decide.one_order``); the plan's build (one rank may ask) exchanges
        nothing."""
        job = self._run_job() if agree else self.job
        return self._programs.entry(self.fn, args, kwargs, self.reading, job, agree=agree,
                                    traced=self._traced())[1]

    def plan_call(self, args: tuple, kwargs: dict, *, fit: bool = False) -> ShardingPlan:
        """The plan of this call (``spdsl.plan``): built from its decisions and, once a call
        has built it, its step. ``fit``: under ``remat="fit"``, the mode is chosen now if no
        run chose it."""
        return self.plan_of(self.build(args, kwargs), args, kwargs, fit=fit)

    def plan_of(self, entry: Entry, args: tuple, kwargs: dict, *, fit: bool = False
                ) -> ShardingPlan:
        """The plan of ``entry`` (kept while the entry is the one cached): values, placements
        and attention sites from its decisions (``spdsl.inspect.decided.plan_of``); what it
        computes when first asked from the pipeline's records only (``PlanSources``): the
        calls its program runs (``spdsl.inspect.program``) and its memory. ``fit=True``: the
        program is read now, ``remat="fit"`` choosing the mode (``plan.remat``)."""
        kept = self._plans.get(id(entry))
        if kept is not None and kept[0] is entry and (kept[1] or not fit):
            return kept[2]
        job, decisions, chosen = self.job, entry.decisions, entry.remat
        plan = plan_of(decisions)
        if chosen is not None:       # remat="fit": what the run chose, once per program
            plan = replace(plan, remat=entry.step.why)
        extra = self._check_collectives(tree_flatten((args, kwargs))[0])
        program = functools.partial(read_program, job, decisions, args, kwargs, extra=extra,
                                    chosen=chosen)
        if fit and self.remat.fit and plan.remat is None:
            read = program(plan, fit=True)
            program, plan = (lambda _: read), replace(plan, remat=read.chosen)
        memory = functools.partial(plan_entry, job, decisions, args, kwargs, chosen=chosen)
        plan = replace(plan, remat_mode=job.remat.describe(),
                       sources=PlanSources(program, memory))
        if len(self._plans) > 2 * len(self._cache):
            self._plans = {k: v for k, v in self._plans.items()
                           if any(e is v[0] for e in self._cache.values())}
        self._plans[id(entry)] = (entry, fit, plan)
        return plan

    def _check_collectives(self, leaves: list) -> tuple:
        """The collective the same-batch check (``spdsl.pipeline.same_batch``) runs on every
        call, as the plan lists it."""
        n = sum(isinstance(x, torch.Tensor) and not isinstance(x, DTensor) for x in leaves)
        if self.parts == 1 or not n:
            return ()
        kind, typed = ("all_gather", f"f64[{n},2]") if self.debug else ("all_reduce",
                                                                        f"f64[{2 * n}]")
        return (Collective(kind, self.axis, 16 * n, 0, "check", (typed,), "", "", ""),)

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
            return self._programs.prepare(self.fn, args, kwargs, self.reading,
                                          self._run_job(), SIZING, traced=self._traced())[1]
        except GraphBreak as e:
            segmented(self, args, kwargs, e)     # raises where segments cannot run
            return None

    def _check_same_inputs(self, args: tuple, kwargs: dict) -> None:
        """Every rank of the axis passed the same batch (``spdsl.pipeline.same_batch``)."""
        if self.parts > 1 and dist.is_initialized():
            check_same_inputs(self.groups, self.fn, args, kwargs, full=self.debug)

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
        self._check_same_inputs(args, kwargs)       # 16 B per input
        watchdog.set_check_order(self.debug)    # each collective compared across its group
        if entry is None:                      # a function that reads values: in segments
            with C.backward_order():
                return segmented(self, args, kwargs)(args, kwargs)
        return run(entry.step, args, kwargs, batch=self.batch)
