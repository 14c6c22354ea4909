"""The modules a traced function reaches are found however it holds them: itself, a closure
cell holding the module or one of its bound methods (``orig = model.forward``, as
``spdsl.hf`` wraps a forward), default arguments. A module it misses is traced as constants
(its gradients never reach the parameters)."""

from __future__ import annotations

import torch

from spdsl.propagate.trace_state import reachable_modules


def test_bound_method_in_a_closure_reaches_its_module():
    model = torch.nn.Linear(4, 4)
    orig = model.forward
    assert reachable_modules(lambda x: orig(x), (), {}) == [model]
    assert reachable_modules(lambda x: model(x), (), {}) == [model]


def test_plain_function_in_a_closure_reaches_nothing():
    def double(x):
        return 2 * x
    assert reachable_modules(lambda x: double(x), (), {}) == []
