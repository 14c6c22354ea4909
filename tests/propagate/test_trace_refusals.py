"""What one traced program refuses (``spdsl.propagate.trace_refusals``), each as one error that
names its rule: a value read into Python, a shape made from values, a draw from Python's
``random``, an output that is neither tensors nor plain values, a captured tensor that needs a gradient."""

from __future__ import annotations

import random

import pytest
import torch

from spdsl.errors import ShardingError
from spdsl.propagate.trace import trace
from spdsl.propagate.trace_refusals import GraphBreak, shape_from_data

aten = torch.ops.aten


def _refused(fn, *args) -> ShardingError:
    with pytest.raises(ShardingError) as e:
        trace(fn, args, {})
    return e.value


def test_a_read_of_a_traced_value_is_a_break():
    e = _refused(lambda x: x * 2 if x.sum() > 0 else x, torch.randn(4))
    assert isinstance(e, GraphBreak) and e.rule == "data-dependent control flow"
    e = _refused(lambda x: x * x.max().item(), torch.randn(4))
    assert isinstance(e, GraphBreak) and e.rule == "data-dependent control flow"


def test_a_shape_from_values_is_a_break():
    e = _refused(lambda x: torch.nonzero(x), torch.randn(4))
    assert isinstance(e, GraphBreak) and e.rule == "data-dependent shape"
    e = _refused(lambda x: x[x > 0], torch.randn(4))
    assert e.rule == "data-dependent shape"


def test_a_python_draw_is_a_break_and_the_state_is_kept():
    state = random.getstate()
    e = _refused(lambda x: x * random.random(), torch.randn(4))
    assert isinstance(e, GraphBreak) and e.rule == "python random draw"
    assert random.getstate() == state


def test_an_object_output_is_refused_with_its_type():
    class Cache:
        pass
    e = _refused(lambda x: (x, Cache()), torch.randn(4))
    assert not isinstance(e, GraphBreak) and e.rule == "output type"


def test_shape_from_data_tells_masks_from_integer_indices():
    mask, idx = torch.tensor([True, False]), torch.tensor([0, 1])
    assert shape_from_data(aten.index.Tensor, (torch.randn(2), [mask]))
    assert not shape_from_data(aten.index.Tensor, (torch.randn(2), [idx]))
    assert shape_from_data(aten.nonzero.default, (torch.randn(2),))
    assert not shape_from_data(aten.add.Tensor, (torch.randn(2), 1))


def test_a_captured_tensor_that_needs_a_gradient_is_refused():
    """A closure's tensor is a constant of the program: it would get no gradient."""
    w = torch.randn(4, 4, requires_grad=True)
    e = _refused(lambda x: (x @ w).sum(), torch.randn(2, 4))
    assert not isinstance(e, GraphBreak) and e.rule == "captured tensor"
    assert "float32[4, 4]" in str(e) and "nn.Parameter" in str(e)
    assert w.grad is None
    # one that needs no gradient is a constant, as before; so is a module's parameter
    trace(lambda x: (x @ w.detach()).sum(), (torch.randn(2, 4),), {})
    lin = torch.nn.Linear(4, 4)
    trace(lambda x: lin(x).sum(), (torch.randn(2, 4),), {})
