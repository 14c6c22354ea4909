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

from spdsl.inspect.decided import build_plan
from spdsl.inspect.plan import Collective, ShardingPlan
from spdsl.propagate.engine import Propagator, nbytes
from spdsl.propagate.placement import dtype_name


def with_mesh_collectives(plan: ShardingPlan, gm: torch.fx.GraphModule,
                          data: Propagator | None, requires: dict[torch.fx.Node, bool],
                          data_out: list, sharded: list, reduced: dict[int, bool],
                          regathered: frozenset) -> ShardingPlan:
    """``plan`` (the sequence axis') with the collectives of the module's table. ``sharded``:
    ``spdsl.lower.param_gather.ShardedInput`` per sharded parameter; ``reduced``: which of them
    (by graph input index) have their gradient reduce-scattered; ``regathered``: which are
    gathered again in backward (used inside a checkpointed layer)."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    axis, world = plan.axis, plan.parts
    colls, title = list(plan.decided), plan.title
    if data is not None:
        axis, world = f"{data.axis}+{plan.axis}", plan.parts * data.parts
        skip = frozenset(phs[s.index].name for s in sharded if reduced.get(s.index))
        _merge(colls, build_plan(data, requires, data_out, skip), axis)
        title = (title + " " if title else "") + \
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
        colls.append(Collective("all_gather", axis, chunk, again, "state", (typed,), "",
                                owner, first))
        if reduced.get(s.index):
            colls.append(Collective("reduce_scatter", axis, 0, chunk * world, "state",
                                    (typed,), "", owner, first))
    return dataclasses.replace(plan, decided=tuple(colls), title=title)


def _merge(colls: list[Collective], dplan: ShardingPlan, joint: str) -> None:
    """A sum both axes ask for at one point runs once, over every rank: ``dplan``'s
    collectives merged into ``colls`` (the sequence axis')."""
    index = {(c.node, c.purpose): i for i, c in enumerate(colls)
             if c.purpose in ("loss", "gradient") and c.kind == "all_reduce"}
    for c in dplan.decided:
        i = index.get((c.node, c.purpose)) if c.kind == "all_reduce" else None
        if i is not None:
            mine = colls[i]
            colls[i] = dataclasses.replace(mine, axis=joint, bytes=max(mine.bytes, c.bytes),
                                           bytes_bwd=max(mine.bytes_bwd, c.bytes_bwd))
        else:
            colls.append(c)
