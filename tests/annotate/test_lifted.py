"""``spdsl.annotate.lifted``: a number read with ``.item()`` while tracing is read from the
segments only when Python looks at it; a torch op given it computes with the traced tensor."""

from __future__ import annotations

import math
import pickle

import torch

from spdsl._torch import FakeTensorMode
from spdsl.annotate.lifted import Lifted, LiftMode, number


class _Cut:
    """What ``Lifted`` asks of the cut: the node of a traced tensor, and a guarded read."""

    def __init__(self, value: float) -> None:
        self.value, self.reads, self.lifted, self.lifts = value, 0, [], []

    def node_of(self, t):
        return type("Node", (), {"op": "call_function"})()

    def read_number(self, tensor, where):
        self.reads += 1
        return self.value


def test_the_first_look_reads_once_and_the_number_behaves_as_a_float():
    cut = _Cut(2.5)
    s = Lifted(torch.tensor(2.5), cut, "here")
    assert cut.reads == 0
    assert float(s) == 2.5 and cut.reads == 1
    assert s + 1 == 3.5 and 1 - s == -1.5 and s * 2 == 5.0 and s > 2 and -s == -2.5
    assert int(s) == 2 and round(s) == 2 and math.floor(s) == 2 and math.ceil(s) == 3
    assert f"{s:.1f}" == "2.5" and str(s) == "2.5" and hash(s) == hash(2.5) and bool(s)
    assert s.is_integer() is False              # a float's own methods
    assert pickle.loads(pickle.dumps(s)) == 2.5
    assert number(s) == 2.5 and number(3) == 3
    assert cut.reads == 1


def test_settled_it_keeps_only_its_value():
    cut = _Cut(0.0)
    s = Lifted(torch.tensor(1.0), cut, "here")
    s.settle(torch.tensor(4.0))
    assert s.tensor is None and float(s) == 4.0 and cut.reads == 0


def test_outside_the_trace_a_torch_op_takes_the_number():
    s = Lifted(torch.tensor(3.0), _Cut(3.0), "here")
    assert torch.equal(torch.full((2,), 1.0) * s, torch.full((2,), 3.0))
    assert torch.equal(torch.mul(torch.ones(2), s), torch.full((2,), 3.0))


def test_while_tracing_item_lifts_and_an_op_reads_nothing():
    cut = _Cut(2.0)
    with FakeTensorMode():
        h = torch.ones(3)
        with LiftMode(cut):
            s = h.sum().item()
            assert isinstance(s, Lifted) and len(cut.lifted) == 1
            y = h / s                                  # the traced tensor, no read
            assert cut.reads == 0 and y.shape == (3,)
            z = torch.ones(3, dtype=torch.float64, device="cpu") * s   # another dtype: read
            assert cut.reads == 1 and z.dtype == torch.float64
