"""The run of a built step: this rank's pieces of the global inputs, the program, the outputs
as DTensors.

The one place global tensors become local: each argument is cut as ``spdsl.lower.local``
says (the step's input specs were read the same way), with the ``Groups`` the step was
lowered with; an argument that needs its gradient goes through ``collectives.take``, whose
backward gathers the whole gradient. Outputs split over an axis come back as DTensors on the
job's mesh (``Groups.mesh``); the rest (the loss) come back whole.

Example::

    step = spdsl.sp_shard(seq=4)(model)
    built = step.prepare(ids, ids).step             # trace, decide, build: nothing runs yet
    loss = run(built, (ids, ids), {})               # what step(ids, ids) does next
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard

import spdsl.collectives as C
from spdsl._torch import tree_flatten, tree_unflatten
from spdsl.lower.local import bounds
from spdsl.pipeline.build import Step
from spdsl.pipeline.decide import out_nodes
from spdsl.pipeline.groups import Groups
from spdsl.propagate.modes import run_modes
from spdsl.propagate.placement import PARTIAL, REPLICATE, Placement, Shard


def run(step: Step, args: tuple, kwargs: dict, *, batch: str = "global") -> Any:
    """``step`` (built by ``build_step`` for this rank) on the global ``args``/``kwargs``:
    the outputs as the traced function returns them, split ones as DTensors. ``batch``:
    ``"global"`` (every rank passed the whole batch, cut here over the data axis too) or
    ``"local"`` (each data rank passed its own rows)."""
    outs = _pieces(step, args, kwargs, batch)
    wrapped = [wrap_output(o, p, node, dp, step.groups)
               for o, (p, node, dp) in zip(outs, out_forms(step))]
    return tree_unflatten(wrapped, step.decisions.traced.out_spec)


def run_local(step: Step, values: list, local=frozenset(), batch: str = "global") -> list:
    """``step`` on ``values`` (its tensor arguments in order; those whose index is in
    ``local`` already this rank's pieces, as a DTensor's ``to_local`` gives them): the
    program's outputs as they come, this rank's pieces. A replay of segments hands them on so
    (``spdsl.annotate.breaks``); ``out_forms`` and ``wrap_output`` make one a DTensor where it
    is read or returned."""
    return _pieces(step, tuple(values), {}, batch, local)


def _pieces(step: Step, args: tuple, kwargs: dict, batch: str, local=frozenset()) -> list:
    """The program on this rank's pieces of the arguments (and of the parameters): its
    outputs as they come."""
    state = [t.to_local() if isinstance(t, DTensor) else t for t in step.decisions.traced.state]
    with run_modes(), C.backward_order():    # the trace's casts are ops of the program
        return list(C.tie_order(step.program(*state, *local_inputs(step, args, kwargs, batch,
                                                                    local))))


def out_forms(step: Step) -> tuple:
    """Per output of ``step``: its placement, traced node and data placement, what
    ``wrap_output`` takes."""
    d = step.decisions
    data_out = d.data_out or (REPLICATE,) * len(d.out_placements)
    return tuple(zip(d.out_placements, out_nodes(d.traced), data_out))


def split_output(p: Placement, dp: Placement) -> bool:
    """Whether an output placed ``p`` (``dp`` over the data axis) is handed back as a DTensor
    (split, or a partial sum) rather than as the tensor itself."""
    return isinstance(p, Shard) or isinstance(dp, Shard) or p == PARTIAL


def local_inputs(step: Step, args: tuple, kwargs: dict, batch: str = "global",
                 local=frozenset()) -> list:
    """This rank's pieces of the call's tensor arguments, in the program's input order
    (``local``: the indices of leaves that are pieces already)."""
    d, groups = step.decisions, step.groups
    leaves, _ = tree_flatten((args, kwargs))
    local_in = []
    for j, i in enumerate(d.traced.tensor_leaf_index):
        x = leaves[i]
        if i in local:
            local_in.append(x)
            continue
        p = d.in_placements[j]
        dp = d.data_in[j] if d.data is not None else REPLICATE
        if isinstance(x, DTensor):
            local_in.append(x.to_local())
            continue
        if isinstance(dp, Shard) and batch == "global":
            x = _split(x, dp, groups.data_parts, groups.data_rank, groups.data_group)
        if isinstance(p, Shard):
            x = _split(x, p, groups.parts, groups.rank, groups.group)
        local_in.append(x.contiguous() if x is not leaves[i] else x)
    return local_in


def _split(x: torch.Tensor, p: Shard, parts: int, rank: int, group: str) -> torch.Tensor:
    """This rank's chunk of a global input. The global tensor is the same on every rank
    (replicated), so its gradient is the whole one: gathered in backward where it is asked
    for."""
    if x.requires_grad and torch.is_grad_enabled() and parts > 1:
        return C.take(x, (p.dim, 1, p.size, 1), parts, rank, group)
    lo, hi = bounds(p, parts, rank)
    return x.narrow(p.dim, lo, hi - lo)


def wrap_output(local, p: Placement, node, dp: Placement, groups: Groups):
    """A program's output ``local`` (of the traced output ``node``) as the run hands it back:
    a DTensor where it is split or a partial sum, the tensor itself where replicated."""
    # a partial sum stays one only where a segment hands it on (``Starts.keep_partial``)
    if split_output(p, dp) and isinstance(local, torch.Tensor):
        val = node.meta["val"]
        return as_dtensor(local, p, dp, groups, val.shape, val.stride())
    return local


def as_dtensor(local: torch.Tensor, p: Placement, dp: Placement, groups: Groups, shape,
               stride) -> DTensor:
    """``local`` as the piece it is of a global tensor of ``shape``: placed ``p`` over the
    sequence axis and ``dp`` over the data axis of ``groups.mesh`` (a partial sum is a
    ``Partial``)."""
    mesh = groups.mesh
    if groups.data_parts > 1:
        names = mesh.mesh_dim_names
        sub = mesh[(names[0], names[1])] if mesh.ndim > 2 else mesh
        pl = {groups.axis: p, groups.data_axis: dp}
        places = [_dtensor_placement(pl[n]) for n in sub.mesh_dim_names]
    else:
        sub = mesh[groups.axis] if mesh.ndim > 1 else mesh
        places = [_dtensor_placement(p)]
    return DTensor.from_local(local, sub, places, run_check=False, shape=shape, stride=stride)


def _dtensor_placement(p: Placement):
    return DShard(p.dim) if isinstance(p, Shard) else DPartial() if p == PARTIAL else \
        DReplicate()
