"""Segments of a forward that reads values planned on a dp x sp mesh or with sharded state
(``spdsl.annotate.segments_memory``, step 2): each segment's program is the one the run builds
(the same graph on the function's mesh, its arguments with their specs, earlier segments'
outputs as the run's DTensors), lowered with the job's groups. Such a plan is made inside the
job, as the one-program planner's is."""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor

from spdsl._torch import tree_flatten
from spdsl.errors import ShardingError
from spdsl.pipeline.run import wrap_output


def on_mesh(owner) -> bool:
    """Segments built with the job's mesh (a data axis, sharded state), not one axis."""
    return owner.data_parts > 1 or owner.shard_state


def check_mesh(owner, where: str) -> None:
    """Refuse what a plan on a mesh cannot do (module docstring)."""
    what = "shard_state=True" if owner.shard_state else "a dp x sp mesh"
    if owner.job.groups is None:
        raise ShardingError(
            rule="segment memory plan", value=what, where=where,
            detail="the segments are planned with the job's process groups, as they run",
            fix="call plan_memory inside the job (under torchrun), on every rank alike")
    if owner.batch == "local" and owner.data_parts > 1:
        raise ShardingError(
            rule="segment memory plan", value='batch="local"', where=where,
            detail="the values read are computed on the global batch, which no rank holds",
            fix='plan a copy wrapped with batch="global" on the global batch (the same step)')


def where_planned(owner, built, rank: int) -> str:
    """The rank planned, as the plan's label names it."""
    g = built.groups
    if g is None or g.data_parts == 1:
        return f"rank {built.rank if g is not None else rank} of {owner.parts}"
    return f"{g.data_axis} rank {g.data_rank} of {g.data_parts} x {owner.axis} rank " \
           f"{g.rank} of {g.parts}"


def leaf_specs(owner, args: tuple, kwargs: dict) -> list:
    """The call's specs of its tensor arguments, as the run's segments read them."""
    leaves = tree_flatten((args, kwargs))[0]
    specs = owner.reading.specs_for(args, leaves)
    return [specs[i] if specs is not None else None
            for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]


# the planning program -> {its inputs' specs in the run: the run's program}
_RUN_FORM: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def run_form(owner, prog, specs: list):
    """The program the run builds for the segment ``prog`` plans (``Segments.program``): the
    same graph, on the function's mesh (its data axis, its sharded parameters' mesh), its
    arguments with their specs and earlier segments' outputs as DTensors."""
    from spdsl.annotate.breaks import _Segment

    forms = _RUN_FORM.setdefault(prog, {})
    key = tuple(repr(s) for s in specs)
    got = forms.get(key)
    if got is None:
        got = forms[key] = _Segment(
            prog._make, mesh=owner.mesh, in_specs=tuple(specs), out_specs=prog.out_specs,
            axis=owner.axis, parts=owner.parts, data_axis=owner.data_axis,
            options=prog.options, state_mesh=owner._world(), final=prog._final)
    return got


def run_input(src: tuple, grad: bool, real: dict, fakes: dict, placed: dict):
    """A segment's input as the run hands it to the segment's program: an earlier segment's
    output as that program wraps its piece (a DTensor, or the whole tensor where it is
    replicated over both axes); the rest as the planning run saw them. Only its shape,
    placement and gradient matter: the program is built, not run."""
    if src[0] != "out":
        return as_grad(real[src] if src[0] in ("in", "read") else src[1], grad)
    q, dq, node, groups = placed[src]
    f = fakes[src]
    if isinstance(f, DTensor):
        with torch.no_grad():
            f = f.to_local()
    local = torch.empty(f.shape, dtype=f.dtype).requires_grad_(grad)
    return wrap_output(local, q, node, dq, groups)


def as_grad(x, grad: bool):
    """``x`` needing a gradient where the run's does (a tensor argument)."""
    if not isinstance(x, torch.Tensor) or x.requires_grad == grad:
        return x
    return x.detach().requires_grad_(grad)
