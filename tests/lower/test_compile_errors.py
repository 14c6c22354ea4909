"""``compile=True`` reports a graph break as a ShardingError naming the local node and the
user's source line (Dynamo's own message points into generated code)."""

from __future__ import annotations

import pytest
import torch

from spdsl import ShardingError
from spdsl.lower.compile import compile_local

aten = torch.ops.aten
WHERE = 'File "/home/user/model.py", line 42, in forward\n    y = weird(x)'


def _breaks(x: torch.Tensor) -> torch.Tensor:
    torch._dynamo.graph_break()       # what an opaque call in user code amounts to
    return x + 1


def _graph(breaking: bool) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(aten.mul.Tensor, (x, 2))
    b = g.call_function(_breaks if breaking else aten.add.Tensor, (a,) if breaking else (a, 1))
    b.meta.update(stack_trace=WHERE, spdsl_module="layers.0.mlp")
    g.output([g.call_function(aten.sum.default, (b,))])
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _nested() -> torch.fx.GraphModule:
    """The breaking graph as a submodule, as remat's per-layer split leaves it."""
    root = torch.nn.Module()
    root.submod_1 = _graph(True)
    g = torch.fx.Graph()
    g.output([g.call_module("submod_1", (g.placeholder("x"),))])
    return torch.fx.GraphModule(root, g)


@pytest.mark.parametrize("make", [lambda: _graph(True), _nested], ids=["flat", "split"])
def test_graph_break_names_node_and_source(make):
    with pytest.raises(ShardingError) as info:
        compile_local(make(), backend="eager")(torch.randn(3))
    msg = str(info.value)
    assert "[no graph breaks]" in msg
    assert "_breaks" in msg and "graph_break" in msg
    assert "/home/user/model.py:42 (layers.0.mlp)" in msg
    assert "compile=False" in msg


def test_no_break_runs_and_keeps_attributes():
    gm = _graph(False)
    gm.spdsl_remat = "report"
    local = compile_local(gm, backend="eager")
    assert local(torch.ones(3))[0].item() == 9.0
    assert local.spdsl_remat == "report" and local.graph is gm.graph
