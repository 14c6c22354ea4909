"""One rank's program for one call, built one way for everyone who reads it.

``trace -> propagate`` give the decisions (``spdsl.annotate`` keeps them per call signature);
from them :func:`build_step` makes this rank's program: lower for the rank, swap in kernels (and fuse
the output projection into attention pipelined by head groups, ``spdsl.lower.project``),
apply the remat stage (chosen from memory under ``remat="fit"``), compile when asked. The run
(``sp_shard``/``shard``), the plan's list of collectives (``spdsl.inspect.program``), the memory
planner (``spdsl.memory.planner``) and both command lines all read the :class:`Step` it returns;
none of them lowers or rewrites a program itself.

A wrapped function describes itself to the pipeline as a :class:`Job` (``Sharded.job``): its
mesh axes, its options and the three things only a running job knows (its process groups, the
hybrid groups of its sequence axis, and its own lowering with the dp axis and sharded state).
Outside a job (:func:`planned_step` with no process group of the job's size) a fake process group
of the axis' size stands in (:func:`planning_group`): no collective runs and the model may live
on the meta device.

Example::

    step = spdsl.sp_shard(seq=4)(model)
    entry = step.build((ids, ids), {})                     # decisions: trace + propagate
    with planned_step(step.job, entry, (ids, ids), {}, SIZING) as s:   # no collective runs
        s.program.print_readable()                         # rank 0's program, remat applied
        s.remat.describe(), s.kernels                      # what was chosen
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from spdsl._torch import fake_store, tree_flatten, use_lazy_graph_module
from spdsl.lower.graph import lower
from spdsl.lower.kernels import KernelChoice, swap_kernels
from spdsl.lower.project import fuse_output_projection
from spdsl.lower.shapes import TensorSpec
from spdsl.propagate.attention_choice import AttentionConfig, Links, device_model
from spdsl.remat import Remat, apply_remat, local_specs


@dataclass(frozen=True)
class Job:
    """What the pipeline needs of a wrapped function: its axes and options, and the job's
    own groups. ``group(axis)`` -> (process group name, this rank in it), ``axis=None`` the
    sequence axis; ``factor(u)`` -> the hybrid groups of the sequence axis
    (``spdsl.lower.ring``); ``lowered(entry, args, kwargs)`` -> this rank's lowering with the dp
    axis and sharded state (records the rank and its input shapes on ``entry``); ``world()`` ->
    the mesh of every rank; ``resident()`` -> bytes of parameters already in CPU memory;
    ``agree(index)`` -> the largest ``index`` over the mesh (None outside a job)."""

    parts: int
    axis: str
    data_axis: str | None
    data_parts: int
    remat: Remat
    kernels: KernelChoice
    compile: bool
    group: Callable[..., tuple[str, int]]
    factor: Callable[[int], tuple]
    lowered: Callable[[Any, tuple, dict], torch.fx.GraphModule]
    world: Callable[[], Any]
    resident: Callable[[Any], int] = lambda entry: 0
    agree: Callable[[int], int] | None = None


@dataclass(frozen=True)
class Sizing:
    """The memory model the remat stage decides by (``spdsl.memory.SIZING``): ``peak`` fits
    ``remat="auto"``'s byte budget (``spdsl.remat.PeakModel``), ``choose`` picks the mode under
    ``remat="fit"`` (``spdsl.memory.fit.choose_remat``: graph, mode, record of the choice)."""

    peak: Callable
    choose: Callable


@dataclass(frozen=True)
class Step:
    """One rank's compiled step for one call signature.

    ``decisions``: the traced and propagated call (``spdsl.annotate``'s entry: graph,
    placements, plan); ``lowered``: this rank's program as lowering made it with the kernels
    swapped in, before remat (kept for inspection); ``program``: what runs (kernels swapped, remat
    applied, compiled if asked); ``remat``: the mode applied (under ``"fit"``, the one chosen)
    and ``why`` (``RematChoice``, or None); ``kernels``: the swaps made (``kernel_report``
    rows); ``state``/``inputs``: the specs of the program's inputs on ``rank``; ``axes``:
    process group name -> the mesh axis it spans; ``planning``: built outside the run (fake
    groups, meta tensors allowed)."""

    decisions: Any
    lowered: torch.fx.GraphModule
    program: Any
    remat: Remat
    why: Any
    kernels: tuple
    rank: int
    state: list[TensorSpec]
    inputs: list[TensorSpec]
    axes: dict[str, str] = field(default_factory=dict)
    planning: bool = False


def build_step(job: Job, entry, args: tuple, kwargs: dict, sizing: Sizing) -> Step:
    """This rank's program for ``entry``, for the run (see the module docstring): lowered
    with the job's groups, kernels swapped, remat applied (``"fit"`` agreed over the mesh),
    compiled if the job asks."""
    with contextlib.ExitStack() as stack:
        return _build(stack, job, entry, args, kwargs, sizing, planning=False)


@contextlib.contextmanager
def planned_step(job: Job, entry, args: tuple, kwargs: dict, sizing: Sizing, *,
                 rank: int | None = None, remat: Remat | None = None,
                 compiled: bool | None = None, optimizer: str = "adamw"):
    """The step built without running anything, as the plan and the memory planner read it:
    a fake process group where the job has none (kept up inside the ``with``, so the program
    can be simulated or its shapes filled), factory calls off the meta device, the program
    left uncompiled. ``rank``: the rank to plan (default: this process's rank in a job, else
    0); a dp axis or sharded state always plans this process's own rank, whose groups they
    need. ``remat``/``compiled`` override the job's; ``optimizer``: the update ``"fit"``
    sizes the step with.

    Example::

        with planned_step(step.job, step.build(args, {}), args, {}, SIZING) as s:
            simulate(s.program, s.state, s.inputs)
    """
    with contextlib.ExitStack() as stack:
        yield _build(stack, job, entry, args, kwargs, sizing, planning=True, rank=rank,
                     remat=remat, compiled=compiled, optimizer=optimizer)


def _build(stack: contextlib.ExitStack, job: Job, entry, args: tuple, kwargs: dict,
           sizing: Sizing, *, planning: bool, rank: int | None = None,
           remat: Remat | None = None, compiled: bool | None = None,
           optimizer: str = "adamw") -> Step:
    r = remat if remat is not None else job.remat
    compiled = job.compile if compiled is None else compiled
    if planning:     # code generated when first run: a plan reads graphs (0.3 s of an 8B plan)
        stack.enter_context(use_lazy_graph_module(True))
    if planning and r.fit and getattr(entry, "remat", None) is not None:
        r = entry.remat                    # the mode the run chose for this program
    if not planning or entry.data is not None or entry.sharded:
        lowered = job.lowered(entry, args, kwargs)      # the job's own groups, its rank
        rank, axes = entry.rank, _job_axes(job)
        if planning:
            lowered = _off_meta(lowered)
    else:
        in_job = dist.is_initialized() and dist.get_world_size() > 1
        if rank is None:
            rank = job.group()[1] if in_job else 0
        factor = job.factor if in_job else functools.partial(_planning_factor, job.parts)
        group = stack.enter_context(_planning_or_job_group(job, in_job))
        lowered = _off_meta(lower(entry.prop, rank, group, entry.out_placements,
                                  factor=factor))
        axes = {group: job.axis}
    state, ins = local_specs(entry, args, kwargs, job.parts, rank)
    lowered = swap_kernels(lowered, job.kernels, state, ins)    # in place, before remat
    fuse_output_projection(lowered, state, ins)                 # with head groups; in place
    kernels = tuple(getattr(lowered, "spdsl_kernels", ()))
    program, why = lowered, None
    if r.fit:        # the least recomputation that fits (spdsl.memory.fit), every rank alike
        away = planning and any(isinstance(a, torch.Tensor) and a.device.type == "meta"
                                for a in tree_flatten((args, kwargs))[0])
        program, r, why = sizing.choose(
            program, r, state, ins, compiled=compiled, optimizer=optimizer,
            **({"target": device_of(entry, args, kwargs)} if away else {} if planning else
               {"resident": job.resident(entry), "agree": job.agree}))
    else:
        program = apply_remat(program, r, state, ins, peak=sizing.peak)
    if compiled and not planning:
        from spdsl.lower.compile import compile_local
        program = compile_local(program)         # fullgraph; breaks -> ShardingError
    from spdsl.lower.ring import ring_axes
    axes = {**ring_axes(lowered, job.axis), **axes}
    return Step(entry, lowered, program, r, why, kernels, rank, state, ins, axes, planning)


def device_of(entry, args: tuple, kwargs: dict | None = None) -> Links:
    """The device model of one call's step (``spdsl.propagate.attention_choice.device_model``):
    the ``Links`` its attention choice priced, which ``plan.timing()`` runs on and, for a plan
    on the meta device (a plan for another machine), ``remat="fit"`` budgets against."""
    device = next((a.device.type for a in tree_flatten((args, kwargs or {}))[0]
                   if isinstance(a, torch.Tensor)), "cpu")
    return device_model(device, AttentionConfig.of(entry.prop.attention).links)


def _job_axes(job: Job) -> dict[str, str]:
    """Process group name -> the axis it reduces or exchanges over (``dp+sp``: every rank)."""
    axes = {job.group()[0]: job.axis}
    if job.data_parts > 1:
        axes[job.group(job.data_axis)[0]] = job.data_axis
        both = f"{job.data_axis}+{job.axis}" if job.parts > 1 else job.data_axis
        axes.setdefault(job.world().get_group().group_name, both)
    return axes


def _planning_or_job_group(job: Job, in_job: bool):
    if in_job:
        return contextlib.nullcontext(job.group()[0])
    if dist.is_initialized() and job.parts == 1:
        return contextlib.nullcontext(dist.group.WORLD.group_name)
    return planning_group(job.parts)


def _planning_factor(parts: int, u: int) -> tuple:
    """Hybrid attention's groups in the planning group (rank 0 of ``parts``)."""
    from spdsl.lower.ring import factor_ranks
    return factor_ranks(torch.arange(parts).view(1, parts), u)


def _off_meta(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Factory calls traced from a meta-device model (``arange(..., device="meta")``) run on
    fake CPU tensors instead: on meta, attention would pick its quadratic-memory math path."""
    changed = False
    for n in gm.graph.nodes:
        if isinstance(n.kwargs.get("device"), torch.device) and n.kwargs["device"].type == "meta":
            n.kwargs = {**n.kwargs, "device": torch.device("cpu")}
            changed = True
    if changed:        # code generation: 0.4 s for an 8B model's 3,000 nodes
        gm.recompile()
    return gm


@contextlib.contextmanager
def planning_group(parts: int):
    """A process group to lower against when none is running: a fake one, ``parts`` ranks
    (``torch.testing._internal.distributed.fake_pg``), torn down afterwards. Yields its name."""
    if dist.is_initialized():
        if dist.get_world_size() != parts:
            raise ValueError(f"cannot plan {parts} ranks inside a running job of "
                             f"{dist.get_world_size()}: plan in a process without one (the "
                             "`python -m spdsl memory` command does)")
        yield dist.group.WORLD.group_name
        return
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=parts)
    try:
        yield dist.group.WORLD.group_name
        return
    finally:
        dist.destroy_process_group()
