"""The decisions of one call: where every value of the traced program lives, as a frozen
:class:`Decisions`.

:func:`decide` takes the trace (``spdsl.propagate.trace``; in a job, put in the mesh's one
order first, :func:`one_order`)
and what the arguments say as placements (``spdsl.pipeline.starts.Starts``: specs, DTensor
arguments and the mesh read into them) and propagates every axis in one walk over the graph
(``spdsl.propagate.mesh_propagation``), the data axis before the sequence axis at each node
(the sequence axis must not cut what it splits); then
the outputs' placements, which parameters are sharded, which of their gradients are one
reduce-scatter (read off a lowering, :func:`spdsl.pipeline.build.reduced_state`) and which
are gathered again under recompute. Nothing here runs a collective but :func:`one_order`'s,
or calls back into the layer that asked; ``build_step`` turns the result into the rank's
program and ``spdsl.inspect.decided.plan_of`` into the plan, when one is asked for.

Example::

    step = spdsl.sp_shard(seq=4)(model)
    d = step.build((ids, ids), {}).decisions       # decide(trace, Starts, step.job)
    d.out_placements              # (Replicate(),): the loss, whole on every rank
    d.prop.decisions[node]        # how one value is split, and what it cost
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

import spdsl.collectives as C
from spdsl.errors import ShardingError
from spdsl.pipeline.build import Job, reduced_state
from spdsl.pipeline.groups import Groups
from spdsl.pipeline.starts import Starts
from spdsl.propagate.engine import Propagator
from spdsl.propagate.mesh_propagation import MeshAxis, MeshPropagator
from spdsl.propagate.order import digest, follow, merge_equal, structure_keys
from spdsl.propagate.placement import PARTIAL, REPLICATE, Placement, Shard
from spdsl.propagate.trace import Traced


@dataclass(frozen=True)
class Decisions:
    """Where every value of one traced call lives (see the module docstring).

    ``traced``: the program at global shapes; ``prop``: the sequence axis' propagation (a
    ``Decision`` per node); ``in_placements``/``out_placements``: the arguments' and outputs'
    placements over the sequence axis; ``requires``: graph input -> needs a gradient;
    ``state_requires``: that, per parameter, when decided (:meth:`stale`); ``data``: the data
    axis' propagation (None: no data axis), ``data_in``/``data_out`` its placements;
    ``sharded``: the sharded parameters (``spdsl.lower.param_gather.ShardedInput``);
    ``reduced``: graph input index -> its gradient is one reduce-scatter; ``regathered``:
    sharded parameters gathered again when their checkpointed layer is recomputed."""

    traced: Traced
    prop: Propagator
    in_placements: tuple[Placement, ...]
    out_placements: tuple[Placement, ...]
    requires: Mapping[torch.fx.Node, bool]
    state_requires: tuple[bool, ...]
    data: Propagator | None = None
    data_in: tuple[Placement, ...] = ()
    data_out: tuple[Placement, ...] = ()
    sharded: tuple = ()
    reduced: Mapping[int, bool] = field(default_factory=lambda: MappingProxyType({}))
    regathered: frozenset = frozenset()

    def stale(self) -> bool:
        """A parameter was frozen or unfrozen since the trace: which gradients exist, and so
        the plan and its lowering (tables built per rank, say), may differ."""
        return tuple(t.requires_grad for t in self.traced.state) != self.state_requires


def decide(traced: Traced, starts: Starts, job: Job) -> Decisions:
    """The decisions for ``traced`` started from ``starts``, for ``job``'s axes and options
    (``strict``: a gather of the sequence is an error; ``attention``: how attention is
    chosen; ``shard_state``; ``remat``, for what is gathered again). See the module
    docstring."""
    gm = traced.graph
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    n_state = len(traced.state)
    inputs, requires = {}, {}
    for j, ph in enumerate(phs):
        if j < n_state:
            inputs[ph] = (REPLICATE, f"parameter {traced.state_names[j]}")
            requires[ph] = traced.state[j].requires_grad
        else:
            inputs[ph] = starts.inputs[j - n_state]
            requires[ph] = starts.requires[j - n_state]
        ph.meta["spdsl_requires_grad"] = requires[ph]
    axes, starts_of, pins = [], {}, {}
    if job.data_parts > 1:         # first: the sequence axis must not cut what dp splits
        axes.append(MeshAxis(job.data_axis, job.data_parts))
        starts_of[job.data_axis] = _data_inputs(traced, phs, starts, job)
        pins[job.data_axis] = {node: dp for node, _, dp in starts.constraints}
    axes.append(MeshAxis(job.axis, job.parts, gathers="error" if job.strict else "warn",
                         attention=job.attention))
    starts_of[job.axis] = inputs
    pins[job.axis] = {node: sp for node, sp, _ in starts.constraints}
    mesh = MeshPropagator(gm, axes)
    mesh.run(starts_of, pins)
    prop = mesh[job.axis]
    dprop = mesh[job.data_axis] if job.data_parts > 1 else None
    data_out = _data_out(traced, dprop) if dprop is not None else ()
    outs = _out_placements(traced, prop, starts)
    sharded = tuple(sharded_inputs(traced, job.shard_state))
    reduced = reduced_state(prop, list(outs), dprop, list(data_out), list(sharded), job.parts,
                            job.axis, job.data_axis)
    return Decisions(traced, prop, tuple(p for p, _ in starts.inputs), outs,
                     MappingProxyType(requires), tuple(t.requires_grad for t in traced.state),
                     data=dprop, data_in=starts.data_in, data_out=data_out, sharded=sharded,
                     reduced=MappingProxyType(reduced),
                     regathered=_regathered(phs, sharded, job) if sharded else frozenset())


def one_order(gm: torch.fx.GraphModule, groups: Groups) -> bool:
    """Put this rank's traced program in the order of the mesh's first rank where the ranks
    traced the same work in different orders (``spdsl.propagate.order``): two all-reduces of
    a digest when they agree; True if this rank's order changed. Every rank raises, before
    any exchange of the step, if one traced other work. ``groups``: a running job's."""
    keys = structure_keys(gm)
    mine = digest(keys)
    if groups.most(mine) == -groups.most(-mine):
        return False
    moved, failed = merge_equal(gm) > 0, None
    keys = structure_keys(gm)
    mesh = groups.mesh
    for i, name in enumerate(mesh.mesh_dim_names or ()):
        if mesh.size(i) == 1:
            continue
        first = C.share(keys, group=mesh.get_group(name))
        if failed is None:
            try:
                moved = follow(gm, first) or moved
            except ShardingError as e:
                failed = e
        if groups.most(int(failed is not None)):
            raise failed or ShardingError(
                rule="one program on every rank",
                detail="another rank of the mesh traced a different program (its error "
                       "says where); no exchange of the step ran")
        keys = structure_keys(gm)
    return moved


def out_nodes(traced: Traced) -> list:
    """The values the traced program returns, in order."""
    out_node = next(n for n in traced.graph.graph.nodes if n.op == "output")
    return list(out_node.args[0])


def _whole_shard(have: Placement, val) -> bool:
    """A split ``Shard`` of the whole dim (not a piece of a flattened one): what a DTensor
    output can say."""
    return isinstance(have, Shard) and have.outer == 1 and have.size == val.shape[have.dim]


def _out_placements(traced: Traced, prop: Propagator, starts: Starts
                    ) -> tuple[Placement, ...]:
    outs, pins = [], starts.outs
    for i, o in enumerate(out_nodes(traced)):
        val = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
        if starts.keep_partial and isinstance(o, torch.fx.Node) and \
                prop.placement(o) == PARTIAL:
            outs.append(PARTIAL)
        elif not isinstance(val, torch.Tensor):
            outs.append(REPLICATE)
        elif i < len(pins) and pins[i] is not None:
            outs.append(pins[i])
        else:
            have = prop.placement(o)
            outs.append(have if _whole_shard(have, val) else REPLICATE)
    return tuple(outs)


def _data_inputs(traced: Traced, phs: list, starts: Starts, job: Job) -> dict:
    """The graph inputs over the data axis: parameters whole, arguments as their specs say
    (the batch's rows, where batch rows meet)."""
    n_state = len(traced.state)
    return {ph: (REPLICATE, "parameter") if j < n_state else
            (starts.data_in[j - n_state], f"in_specs[{j - n_state}] over {job.data_axis!r}")
            for j, ph in enumerate(phs)}


def _data_out(traced: Traced, dprop: Propagator) -> tuple[Placement, ...]:
    """The outputs' placements over the data axis: a split of a whole dim, else whole."""
    data_out = []
    for o in out_nodes(traced):
        val = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
        have = dprop.placement(o) if isinstance(val, torch.Tensor) else REPLICATE
        data_out.append(have if _whole_shard(have, val) else REPLICATE)
    return tuple(data_out)


def sharded_inputs(traced: Traced, shard_state: bool) -> list:
    """Which graph inputs are sharded parameters (``spdsl.lower.param_gather.ShardedInput``);
    under ``shard_state`` every parameter must be one."""
    from spdsl.lower.param_gather import ShardedInput
    from spdsl.sharded_state import is_sharded_state
    out = []
    for j, t in enumerate(traced.state):
        if not isinstance(t, torch.nn.Parameter):
            continue
        if is_sharded_state(t):
            out.append(ShardedInput(j, t.shape[0], t.to_local().shape[0]))
        elif shard_state:
            raise ShardingError(
                rule="state sharding", value=f"parameter {traced.state_names[j]}",
                detail="shard_state=True, but this parameter was not reachable when the "
                       "function was wrapped, so it is still whole",
                fix="wrap the model itself, or a function that closes over it, so that "
                    "its parameters are sharded before the optimizer is built")
    return out


def _regathered(phs: list, sharded: tuple, job: Job) -> frozenset:
    """Sharded parameters first used inside a checkpointed layer: gathered again when the
    layer is recomputed in backward (remat ``auto``/``full``)."""
    from spdsl.propagate.source import module_of
    from spdsl.remat.segments import layer_of
    if job.remat.mode not in ("auto", "full"):
        return frozenset()
    order = {n: i for i, n in enumerate(phs[0].graph.nodes)} if phs else {}
    out = set()
    for s in sharded:
        users = list(phs[s.index].users)
        if users and layer_of(module_of(min(users, key=order.__getitem__))) is not None:
            out.add(s.index)
    return frozenset(out)
