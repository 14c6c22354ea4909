"""``spdsl.lower.param_gather``: the gather of a sharded parameter sits right before its first
use, makes the whole parameter from the rank's rows, and takes over the sub-group all-reduce
marker of the gradient when that marker names the group the parameter is cut over (the
gradient's one reduce-scatter); a marker of another group stays, after the gather."""

from __future__ import annotations

import torch

import spdsl.collectives as C
from spdsl.lower.param_gather import GatherState, ShardedInput

GATHER = torch.ops.spdsl.gather_param.default


def _graph(marker_group: str | None):
    """``x @ w.T`` with ``w`` (input 1) the rank's 3 rows of a [6, 4] parameter, its value
    wrapped in a gradient all-reduce marker over ``marker_group`` (None: no marker)."""
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    w.meta["spdsl_local"] = ((6, 4), torch.float32)
    used = g.call_function(C.grad_all_reduce, (w, marker_group)) if marker_group else w
    t = g.call_function(torch.ops.aten.t.default, (used,))
    g.output(g.call_function(torch.ops.aten.mm.default, (x, t)))
    return g, w, t


def _gathers(g: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in g.nodes if n.target is GATHER]


def test_gather_before_first_use_without_a_marker():
    g, w, t = _graph(None)
    assert GatherState([ShardedInput(1, 6, 3)], 2, 1, "every")(g) == 1
    (gather,) = _gathers(g)
    assert gather.args == (w, 6, 2, 1, "every", False)
    assert t.args[0] is gather and list(w.users) == [gather]
    assert w.meta["spdsl_local"] == ((3, 4), torch.float32)        # the rank's rows now
    assert gather.meta["spdsl_local"] == ((6, 4), torch.float32)
    order = list(g.nodes)
    assert order.index(gather) == order.index(t) - 1


def test_a_marker_of_the_same_group_becomes_the_reduce_scatter():
    g, _, t = _graph("every")
    GatherState([ShardedInput(1, 6, 3)], 2, 0, "every")(g)
    (gather,) = _gathers(g)
    assert gather.args[5] is True and t.args[0] is gather
    assert not [n for n in g.nodes if n.target is C.grad_all_reduce]


def test_a_marker_of_another_group_stays():
    g, _, t = _graph("sp")
    GatherState([ShardedInput(1, 6, 3)], 2, 0, "every")(g)
    (gather,) = _gathers(g)
    (marker,) = [n for n in g.nodes if n.target is C.grad_all_reduce]
    assert gather.args[5] is False and marker.args[0] is gather and t.args[0] is marker


def test_an_unused_parameter_is_left_alone():
    g = torch.fx.Graph()
    g.placeholder("w")
    g.output(None)
    assert GatherState([ShardedInput(0, 6, 3)], 2, 0, "every")(g) == 0
    assert not _gathers(g)
