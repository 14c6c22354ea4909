"""``spdsl.lower.tokenwise.run``: a token-wise module called on a rank's tokens with the state
the graph passes, its gradients reaching that state; on fake tensors, outputs of the right
shapes, and Hugging Face-style experts as one batch of (token, expert) pairs."""

from __future__ import annotations

import itertools
import weakref

import pytest
import torch
import torch.nn.functional as F

from spdsl._torch import FakeTensorMode, tree_flatten
from spdsl.lower.tokenwise import _experts_like, run
from spdsl.propagate.tokenwise import SITES, Marked, Site

_KEYS = itertools.count(10 ** 6)       # apart from the keys tracing hands out


def _site(module: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> int:
    leaves, spec = tree_flatten((args, kwargs or {}))
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    key = next(_KEYS)
    SITES[key] = Site(weakref.ref(module), type(module).__name__, spec,
                      [None if isinstance(x, torch.Tensor) else x for x in leaves], names,
                      None, Marked())
    return key


def test_the_module_runs_with_the_state_it_is_given():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4)
    site = _site(m, (x,))
    w = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    (y,) = run([x], [w, b], site)
    assert torch.equal(y, F.linear(x, w, b))
    y.sum().backward()
    assert torch.equal(w.grad, x.sum(0).expand(3, 4)) and m.weight.grad is None
    del SITES[site]


def test_a_module_that_no_longer_exists_says_so():
    m = torch.nn.Linear(2, 2)
    site = _site(m, (torch.zeros(1, 2),))
    state = [p.detach() for p in m.parameters()]
    del m
    with pytest.raises(RuntimeError, match="no longer exists"):
        run([torch.zeros(1, 2)], state, site)
    del SITES[site]


def test_on_fake_tensors_outputs_have_the_shapes_and_gradients_are_zeros():
    m = torch.nn.Linear(4, 4)
    site = _site(m, (torch.zeros(3, 4),))
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(3, 4, requires_grad=True)
        w, b = torch.empty(4, 4, requires_grad=True), torch.empty(4, requires_grad=True)
        (y,) = run([x], [w, b], site)
        gx, gw = torch.autograd.grad(y.sum(), [x, w])
    assert y.shape == (3, 4) and gx.shape == (3, 4) and gw.shape == (4, 4)
    del SITES[site]


class Experts(torch.nn.Module):
    """Hugging Face's layout: ``gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``."""

    def __init__(self, experts: int, d: int = 4, f: int = 3) -> None:
        super().__init__()
        one_gu, one_down = torch.randn(1, 2 * f, d), torch.randn(1, d, f)
        self.gate_up_proj = torch.nn.Parameter(one_gu.repeat(experts, 1, 1))
        self.down_proj = torch.nn.Parameter(one_down.repeat(experts, 1, 1))
        self.act_fn = F.silu

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for t in range(hidden_states.shape[0]):
            for j in range(top_k_index.shape[1]):
                e = int(top_k_index[t, j])
                gate, up = F.linear(hidden_states[t], self.gate_up_proj[e]).chunk(2, -1)
                y = F.linear(self.act_fn(gate) * up, self.down_proj[e])
                out[t] += top_k_weights[t, j] * y
        return out


def test_experts_as_one_batch_of_pairs_compute_what_the_experts_do():
    """Every pair goes through the first expert's weights: with every expert alike, the
    values are the module's own (what matters to the planner is the shapes and bytes)."""
    torch.manual_seed(0)
    m = Experts(3)
    x = torch.randn(5, 4)
    index = torch.randint(0, 3, (5, 2))
    weights = torch.rand(5, 2)
    site = _site(m, (x, index, weights))
    state = [m.gate_up_proj, m.down_proj]
    (got,) = _experts_like(SITES[site], [x, index, weights], state)
    assert torch.allclose(got, m(x, index, weights), rtol=1e-5, atol=1e-6)
    lin = torch.nn.Linear(4, 4)
    other = _site(lin, (x,))
    assert _experts_like(SITES[other], [x], [lin.weight, lin.bias]) is None   # another layout
    del SITES[site], SITES[other]
