"""Gathers of sharded parameters in the local graph (``shard_state=True``; see
``spdsl.sharded_state``).

Each sharded parameter's graph input is the rank's rows; one ``spdsl::gather_param`` node,
placed right before the parameter's first use, makes the whole parameter. Its backward is the
parameter's one gradient reduction:

=====================================  =============================================
the parameter's gradient, per rank     backward of the gather
=====================================  =============================================
a partial sum over every rank          reduce-scatter over all ranks (the usual case:
(every use is split over both axes)    the sequence and data partial sums in one)
whole already (a use that is not       take the rank's rows (no communication); the
split, or a sub-group all-reduce)      sub-group all-reduce stays where the lowering
                                       put it
=====================================  =============================================

Under remat ``auto``/``full`` the gather sits inside the checkpointed layer and is run again in
backward (the policy recomputes parameter gathers), so a whole parameter lives only while its
layer runs: ZeRO-3. With ``remat="none"`` autograd keeps what it needs of the gathered
parameters until backward.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch

import spdsl.collectives as C
from spdsl.lower.factories import VAL


@dataclass(frozen=True)
class ShardedInput:
    """Graph input ``index`` is the rank's ``local_rows`` of a parameter of ``rows`` rows."""

    index: int
    rows: int
    local_rows: int


@dataclass
class GatherState:
    """The pass: ``GatherState(inputs, world, rank, group)(graph)``."""

    inputs: list[ShardedInput]
    world: int
    rank: int
    group: str

    def __call__(self, graph: torch.fx.Graph) -> int:
        phs = [n for n in graph.nodes if n.op == "placeholder"]
        order = {n: i for i, n in enumerate(graph.nodes)}
        done = 0
        for s in self.inputs:
            ph = phs[s.index]
            users = list(ph.users)
            if not users:
                continue
            reduce = len(users) == 1 and users[0].target is C.grad_all_reduce and \
                users[0].args[1] == self.group
            marker = users[0] if reduce else None
            uses = list(marker.users) if reduce else users
            first = min(uses, key=lambda u: order[u]) if uses else None
            if first is None:
                continue
            with graph.inserting_before(first):
                g = graph.call_function(torch.ops.spdsl.gather_param.default,
                                        (ph, s.rows, self.world, self.rank, self.group,
                                         reduce))
            shape, dtype = ph.meta.get("spdsl_local", ((), None))
            g.meta.update(spdsl_local=(shape, dtype), spdsl_module=first.meta.get(
                "spdsl_module", ""), stack_trace=first.meta.get("stack_trace"),
                spdsl_origin="parameter gather")
            ph.meta["spdsl_local"] = ((s.local_rows, *shape[1:]), dtype)
            if VAL in ph.meta:                   # the whole value is the gather's now
                g.meta[VAL] = ph.meta.pop(VAL)
            if reduce:
                marker.replace_all_uses_with(g)
                graph.erase_node(marker)
            else:
                ph.replace_all_uses_with(g, delete_user_cb=functools.partial(_is_not, g))
            done += 1
        return done


def _is_not(g: torch.fx.Node, user: torch.fx.Node) -> bool:
    return operator.is_not(user, g)
