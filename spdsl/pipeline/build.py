"""One rank's program for one call, built one way for everyone who reads it.

``trace -> decide`` give the decisions (:class:`spdsl.pipeline.decide.Decisions`, kept per
call signature by ``spdsl.annotate``); from them :func:`build_step` makes this rank's
program: lower for the rank, swap in kernels (and fuse the output projection into attention
pipelined by head groups, ``spdsl.lower.project``), apply the remat stage (chosen from
memory under ``remat="fit"``), compile when asked. The run (``spdsl.pipeline.run``), the
plan's list of collectives (``spdsl.inspect.program``), the memory planner
(``spdsl.memory.planner``) and both command lines all read the :class:`Step` it returns; none
of them lowers or rewrites a program itself.

A wrapped function describes itself to the pipeline as a :class:`Job` (``Sharded.job``): its
mesh axes, its options and its process groups, decided once (:class:`Groups`,
``spdsl.pipeline.groups``). Outside a job (:func:`planned_step` with no process group of the
job's size) a fake process group of the axis' size stands in (:func:`planning_group`): no
collective runs and the model may live on the meta device. This module holds the only calls of
``lower()``: the program's, and the lowering read for which sharded parameters' gradients are
one reduce-scatter (:func:`reduced_state`).

Example::

    step = spdsl.sp_shard(seq=4)(model)
    d = step.build((ids, ids), {}).decisions                # trace + decide
    with planned_step(step.job, d, (ids, ids), {}, SIZING) as s:     # no collective runs
        s.program.print_readable()                         # rank 0's program, remat applied
        s.remat.describe(), s.kernels                      # what was chosen
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from spdsl._torch import tree_flatten, use_lazy_graph_module
from spdsl.lower.grad_buckets import merge_buckets
from spdsl.lower.graph import lower
from spdsl.lower.kernels import KernelChoice, swap_kernels
from spdsl.lower.local import local_specs
from spdsl.lower.project import fuse_output_projection
from spdsl.lower.shapes import TensorSpec
from spdsl.pipeline.groups import Groups, planning_group
from spdsl.propagate.attention_choice import AttentionConfig, Links, device_model
from spdsl.remat import Remat, apply_remat


@dataclass(frozen=True)
class Job:
    """What the pipeline needs of a wrapped function: its axes and options, and the running
    job's process groups (``groups``; None outside a job of the axis' size: the pipeline then
    plans against a fake group). ``batch``: ``"global"`` (every rank passes the whole batch)
    or ``"local"`` (each data rank its own rows). ``strict``, ``attention``, ``shard_state``:
    the options propagation reads (``spdsl.pipeline.decide``)."""

    parts: int
    axis: str
    data_axis: str | None
    data_parts: int
    remat: Remat
    kernels: KernelChoice
    compile: bool
    batch: str = "global"
    groups: Groups | None = None
    strict: bool = False
    attention: Any = None
    shard_state: bool = False
    merge_buckets: bool = False     # a segment's: its gradient buckets merged across segments


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

    ``decisions``: the traced and propagated call (``spdsl.pipeline.decide.Decisions``);
    ``lowered``: this rank's program as lowering made it with the kernels
    swapped in, before remat (kept for inspection); ``program``: what runs (kernels swapped, remat
    applied, compiled if asked); ``remat``: the mode applied (under ``"fit"``, the one chosen)
    and ``why`` (``RematChoice``, or None); ``kernels``: the swaps made (``kernel_report``
    rows); ``state``/``inputs``: the specs of the program's inputs on ``rank``; ``axes``:
    process group name -> the mesh axis it spans; ``planning``: built outside the run (fake
    groups, meta tensors allowed); ``groups``: the process groups it was lowered with."""

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
    groups: Groups | None = None


def build_step(job: Job, decisions, args: tuple, kwargs: dict, sizing: Sizing) -> Step:
    """This rank's program for ``decisions``, for the run (see the module docstring): lowered
    with the job's groups, kernels swapped, remat applied (``"fit"`` agreed over the mesh),
    compiled if the job asks."""
    with contextlib.ExitStack() as stack:
        return _build(stack, job, decisions, args, kwargs, sizing, planning=False)


@contextlib.contextmanager
def planned_step(job: Job, decisions, args: tuple, kwargs: dict, sizing: Sizing, *,
                 rank: int | None = None, remat: Remat | None = None,
                 compiled: bool | None = None, optimizer: str = "adamw",
                 chosen: Remat | None = None):
    """The step built without running anything, as the plan and the memory planner read it:
    a fake process group where the job has none (kept up inside the ``with``, so the program
    can be simulated or its shapes filled), factory calls off the meta device, the program
    left uncompiled. ``rank``: the rank to plan (default: this process's rank in a job, else
    0); a dp axis or sharded state always plans this process's own rank, whose groups they
    need. ``remat``/``compiled`` override the job's; ``optimizer``: the update ``"fit"``
    sizes the step with; ``chosen``: the mode the run's ``"fit"`` chose for this program
    (``Step.remat`` where ``Step.why`` is set), taken instead of choosing again.

    Example::

        with planned_step(step.job, step.build(args, {}).decisions, args, {}, SIZING) as s:
            simulate(s.program, s.state, s.inputs)
    """
    with contextlib.ExitStack() as stack:
        yield _build(stack, job, decisions, args, kwargs, sizing, planning=True, rank=rank,
                     remat=remat, compiled=compiled, optimizer=optimizer, chosen=chosen)


def _build(stack: contextlib.ExitStack, job: Job, decisions, args: tuple, kwargs: dict,
           sizing: Sizing, *, planning: bool, rank: int | None = None,
           remat: Remat | None = None, compiled: bool | None = None,
           optimizer: str = "adamw", chosen: Remat | None = None) -> Step:
    r = remat if remat is not None else job.remat
    compiled = job.compile if compiled is None else compiled
    if planning:     # code generated when first run: a plan reads graphs (0.3 s of an 8B plan)
        stack.enter_context(use_lazy_graph_module(True))
    if planning and r.fit and chosen is not None:
        r = chosen                         # the mode the run chose for this program
    groups = _groups(stack, job, decisions, planning, rank)
    lowered = lower(decisions.prop, groups.rank, groups.group, decisions.out_placements,
                    groups.data_axis_of(decisions.data), decisions.data_out,
                    groups.gather_of(decisions.sharded), groups.factor)
    if job.merge_buckets and not compiled:
        merge_buckets(lowered)            # held across segments (spdsl.lower.grad_buckets)
    if planning:
        lowered = _off_meta(lowered)
    state, ins = local_specs(decisions, args, kwargs, groups.parts, groups.rank,
                             data_parts=groups.data_parts, data_rank=groups.data_rank,
                             batch=job.batch)
    lowered = swap_kernels(lowered, job.kernels, state, ins)    # in place, before remat
    fuse_output_projection(lowered, state, ins)                 # with head groups; in place
    kernels = tuple(getattr(lowered, "spdsl_kernels", ()))
    program, why = lowered, None
    if r.fit:        # the least recomputation that fits (spdsl.memory.fit), every rank alike
        away = planning and any(isinstance(a, torch.Tensor) and a.device.type == "meta"
                                for a in tree_flatten((args, kwargs))[0])
        program, r, why = sizing.choose(
            program, r, state, ins, compiled=compiled, optimizer=optimizer,
            **({"target": device_of(decisions, args, kwargs)} if away else {} if planning else
               {"resident": _resident(decisions), "agree": groups.most}))
    else:
        program = apply_remat(program, r, state, ins, peak=sizing.peak)
    if compiled and not planning:
        from spdsl.lower.compile import compile_local
        program = compile_local(program)         # fullgraph; breaks -> ShardingError
    from spdsl.lower.ring import ring_axes
    axes = {**ring_axes(lowered, job.axis), **groups.axes()}
    return Step(decisions, lowered, program, r, why, kernels, groups.rank, state, ins, axes,
                planning, groups)


def _groups(stack: contextlib.ExitStack, job: Job, decisions, planning: bool,
            rank: int | None) -> Groups:
    """The groups to lower with: the job's own for the run, and for a plan that needs them
    (a data axis, sharded state); else a fake group of the axis' size (kept up by ``stack``),
    or the job's sequence group lowered for another rank."""
    own = job.groups
    if not planning or decisions.data is not None or decisions.sharded:
        if own is None:
            raise ValueError("a step with a data axis or sharded state is lowered with the "
                             "job's own process groups: build it inside the job")
        return own
    if own is not None and dist.is_initialized() and dist.get_world_size() > 1:
        return own if rank is None or rank == own.rank else replace(own, rank=rank)
    if dist.is_initialized() and job.parts == 1:
        name = dist.group.WORLD.group_name
    else:
        name = stack.enter_context(planning_group(job.parts))
    return Groups.planned(job.parts, job.axis, name, rank or 0)


def reduced_state(prop, outs: list, data, data_out: list, sharded: list, parts: int,
                  axis: str, data_axis: str | None) -> dict[int, bool]:
    """Which sharded parameters' gradients are one reduce-scatter (graph input index ->
    the gather's ``reduce`` flag; the rest are whole on every rank already), read off rank 0's
    lowering against groups named but never run (:meth:`Groups.named`), so that the plan says
    what runs. ``data``: the data axis' propagation, or None."""
    if not sharded:
        return {}
    data_parts = data.parts if data is not None else 1
    groups = Groups.named(parts, axis, data_parts, data_axis)
    local = lower(prop, 0, groups.group, outs, groups.data_axis_of(data), data_out,
                  groups.gather_of(sharded), groups.factor)
    found = {}
    phs = [n for n in local.graph.nodes if n.op == "placeholder"]
    for n in local.graph.nodes:
        if n.target is torch.ops.spdsl.gather_param.default:
            found[phs.index(n.args[0])] = n.args[5]
    return found


def _resident(decisions) -> int:
    """Bytes of the parameters already in CPU memory (``spdsl.memory.fit.device_budget``)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes
               for t in decisions.traced.state if t.device.type == "cpu")


def device_of(decisions, args: tuple, kwargs: dict | None = None) -> Links:
    """The device model of one call's step (``spdsl.propagate.attention_choice.device_model``):
    the ``Links`` its attention choice priced, which ``plan.timing()`` runs on and, for a plan
    on the meta device (a plan for another machine), ``remat="fit"`` budgets against."""
    device = next((a.device.type for a in tree_flatten((args, kwargs or {}))[0]
                   if isinstance(a, torch.Tensor)), "cpu")
    return device_model(device, AttentionConfig.of(decisions.prop.attention).links)


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
