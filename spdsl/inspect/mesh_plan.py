"""The plan on a two-axis mesh and with sharded state: the data axis' collectives beside the
sequence axis' ones, a sum over both axes listed once (it runs as one all-reduce over every
rank), and the gathers and reduce-scatters of sharded parameters.

=========================  ===========================  ==========================================
collective                 axis                         bytes per rank
=========================  ===========================  ==========================================
loss (sum, count)          ``dp+sp`` when both split    2 elements
gradient all-reduce        ``dp+sp``, ``dp`` or ``sp``  the parameter (backward)
parameter all-gather       ``dp+sp`` (every rank)       the rank's rows forward; again in backward
                                                        under remat ``auto``/``full``
gradient reduce-scatter    ``dp+sp`` (every rank)       the whole parameter (backward)
=========================  ===========================  ==========================================
"""

from __future__ import annotations

import dataclasses

import torch

from spdsl.inspect.plan import Collective, ShardingPlan, build_plan
from spdsl.propagate.engine import Propagator, nbytes
from spdsl.propagate.placement import dtype_name


def add_mesh_collectives(plan: ShardingPlan, gm: torch.fx.GraphModule,
                         data: Propagator | None, requires: dict[torch.fx.Node, bool],
                         data_out: list, sharded: list, reduced: dict[int, bool],
                         regathered: frozenset) -> None:
    """Extend ``plan`` (the sequence axis') in place: see the module's table. ``sharded``:
    ``spdsl.lower.state.ShardedInput`` per sharded parameter; ``reduced``: which of them
    (by graph input index) have their gradient reduce-scattered; ``regathered``: which are
    gathered again in backward (used inside a checkpointed layer)."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    axis, world = plan.axis, plan.parts
    if data is not None:
        axis, world = f"{data.axis}+{plan.axis}", plan.parts * data.parts
        skip = frozenset(phs[s.index].name for s in sharded if reduced.get(s.index))
        _merge(plan, build_plan(data, requires, data_out, skip), axis)
        plan.title = (plan.title + " " if plan.title else "") + \
            f"[mesh {data.axis}={data.parts} x {plan.axis}={plan.parts}]"
    for s in sharded:
        ph = phs[s.index]
        val = ph.meta["val"]
        chunk = -(-s.rows // world) * (nbytes(val) // max(1, val.shape[0]))
        again = chunk if s.index in regathered else 0
        typed = f"{dtype_name(val.dtype)}[{','.join(map(str, val.shape))}]{{rows@{axis}}}"
        owner = plan.by_name[ph.name].module if ph.name in plan.by_name else ""
        # listed where the gather runs: at the parameter's first use
        first = min(ph.users, key=order.__getitem__).name if ph.users else ph.name
        plan.collectives.append(Collective("all_gather", axis, chunk, again, "state",
                                           (typed,), "", owner, first))
        if reduced.get(s.index):
            plan.collectives.append(Collective("reduce_scatter", axis, 0, chunk * world,
                                               "state", (typed,), "", owner, first))


def _merge(plan: ShardingPlan, dplan: ShardingPlan, joint: str) -> None:
    """A sum both axes ask for at one point runs once, over every rank."""
    index = {(c.node, c.purpose): i for i, c in enumerate(plan.collectives)
             if c.purpose in ("loss", "gradient") and c.kind == "all_reduce"}
    for c in dplan.collectives:
        i = index.get((c.node, c.purpose)) if c.kind == "all_reduce" else None
        if i is not None:
            mine = plan.collectives[i]
            plan.collectives[i] = dataclasses.replace(
                mine, axis=joint, bytes=max(mine.bytes, c.bytes),
                bytes_bwd=max(mine.bytes_bwd, c.bytes_bwd))
        else:
            plan.collectives.append(c)
