"""``spdsl.lower.shapes``: faking a graph's inputs from their specs, and one fake forward that
fills every node's ``meta["val"]`` (spdsl's own calls run once per signature)."""

from __future__ import annotations

import torch

from spdsl._torch import FakeTensorMode
from spdsl.lower.shapes import TensorSpec, fill_shapes

CALLS = []


def _counted(x: torch.Tensor) -> torch.Tensor:
    CALLS.append(tuple(x.shape))
    return x @ x.transpose(-1, -2)


torch.fx.wrap("_counted")


def _program(x, w):
    h = (x @ w).relu()
    return _counted(h) + _counted(h * 2), _counted(x)


def test_a_spec_fakes_its_tensor():
    spec = TensorSpec.of(torch.zeros(2, 3, dtype=torch.float16, requires_grad=True))
    assert spec == TensorSpec((2, 3), torch.float16, "cpu", True) and spec.nbytes == 12
    assert TensorSpec.of(torch.zeros(2, 3), shape=(4, 3)).shape == (4, 3)
    assert TensorSpec.of(torch.zeros(1, device="meta")).device == "cpu"
    with FakeTensorMode():
        t = spec.fake()
        ids = TensorSpec((5,), torch.long, requires_grad=True).fake()
    assert t.shape == (2, 3) and t.dtype == torch.float16 and t.requires_grad
    assert not ids.requires_grad            # integers take no gradient


def test_every_node_gets_its_value_and_identical_calls_run_once():
    gm = torch.fx.symbolic_trace(_program)
    CALLS.clear()
    fill_shapes(gm, [TensorSpec((4, 3), torch.float32), TensorSpec((3, 5), torch.float32)])
    vals = {n.name: n.meta["val"] for n in gm.graph.nodes if n.op != "output"}
    assert all(isinstance(v, torch.Tensor) for v in vals.values())
    assert vals["relu"].shape == (4, 5) and vals["add"].shape == (4, 4)
    assert CALLS == [(4, 5), (4, 3)]       # the second call of signature (4, 5): memoised
    CALLS.clear()
    seen = []
    fill_shapes(gm, [TensorSpec((4, 3), torch.float32), TensorSpec((3, 5), torch.float32)],
                before=lambda n: seen.append(n.name))
    assert CALLS == [(4, 5), (4, 5), (4, 3)]   # watched: every call runs
    assert seen[:2] == ["x", "w"] and "output" in seen
