"""``spdsl.remat.offload`` on CPU (one process): what a layer saves goes to a host copy and
comes back with its values, gradients are bitwise those without offload, views of one storage
share one copy, parameters stay, and backward fetches the layer before ahead of it."""

from __future__ import annotations

import torch

from spdsl._torch import TorchDispatchMode
from spdsl.remat.offload import (
    Offloader,
    _activation,
    allocating_on_host,
    recording_host_requests,
)
from spdsl.remat.segments import Checkpointed


def _layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).sin() * x.cos()


def _two_layers(x, w0, w1, off: Offloader | None):
    for i, w in enumerate((w0, w1)):
        if off is None:
            x = _layer(x, w)
        else:
            with off.layer(i):
                x = _layer(x, w)
    return x.square().sum()


def _inputs():
    torch.manual_seed(0)
    x = torch.randn(3, 5, requires_grad=True)
    w0 = torch.nn.Parameter(torch.randn(5, 5))
    w1 = torch.nn.Parameter(torch.randn(5, 5))
    return x, w0, w1


def test_values_and_gradients_are_bitwise_those_without_offload():
    x, w0, w1 = _inputs()
    _two_layers(x * 1, w0, w1, None).backward()
    want = [t.grad.clone() for t in (x, w0, w1)]
    for t in (x, w0, w1):
        t.grad = None
    off = Offloader()
    with recording_host_requests() as asked:
        loss = _two_layers(x * 1, w0, w1, off)
    # the [3, 5] activations each layer saves; the [5, 5] parameters stay
    assert asked and all(req == (3 * 5 * 4, False) for req in asked)
    assert sorted(off.pending) == [0, 1]
    held = [r() for refs in off.pending.values() for r in refs]
    assert all(h.source is None and h.host is not None for h in held)   # copied at layer end
    loss.backward()
    got = [t.grad for t in (x, w0, w1)]
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert all(not refs for refs in off.pending.values())


def test_a_host_copy_is_a_separate_tensor_with_the_values():
    off = Offloader()
    x = torch.randn(4, 4, requires_grad=True) * 1
    with off.layer(0):
        held = off.put(x, 0)
    assert held.host is not None and torch.equal(held.host, x)
    assert held.host.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    back = off.get(held)
    assert torch.equal(back, x) and back.data_ptr() != held.host.data_ptr()


def test_views_of_one_storage_share_a_copy_while_the_layer_runs():
    off = Offloader()
    x = torch.randn(4, 6, requires_grad=True) * 1
    with recording_host_requests() as asked, off.layer(0):
        a, b = off.put(x, 0), off.put(x, 0)
        c = off.put(x[:, :3], 0)                 # another view: its own copy
    assert a is b and c is not a
    assert asked == [(4 * 6 * 4, False), (4 * 3 * 4, False)]


def test_copies_are_allocated_as_host_memory():
    seen = []
    off = Offloader()
    x = torch.randn(8, requires_grad=True) * 1

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.clone.default:
                seen.append(allocating_on_host())
            return func(*args, **(kwargs or {}))

    with Watch(), off.layer(0):
        off.put(x, 0)
    assert seen == [True] and not allocating_on_host()


def test_backward_fetches_the_layer_before_ahead():
    off = Offloader()
    xs = [torch.randn(2, 2, requires_grad=True) * 1 for _ in range(3)]
    held = []
    for i, x in enumerate(xs):
        with off.layer(i):
            held.append(off.put(x, i))
    assert all(h.fetched is None for h in held)
    off.get(held[2])
    assert held[1].fetched is not None and held[0].fetched is None
    assert torch.equal(off.get(held[1]), xs[1])
    assert held[0].fetched is not None


def test_only_activations_move():
    w = torch.nn.Parameter(torch.randn(3, 3))
    x = torch.randn(3, 3, requires_grad=True)
    assert _activation(x @ w)
    assert not _activation(w) and not _activation(w.t())      # a parameter and its view
    assert not _activation(x)                                 # a leaf: no history of its own
    assert not _activation(torch.arange(3))
    assert _activation((x @ w).t())                           # a view of an activation


def test_a_checkpointed_layer_with_offload_keeps_its_input_on_the_host():
    x, w0, w1 = _inputs()
    layer = torch.fx.symbolic_trace(_layer)
    ref = layer(layer(x * 1, w0), w1).square().sum()
    ref.backward()
    want = [t.grad.clone() for t in (x, w0, w1)]
    for t in (x, w0, w1):
        t.grad = None
    off = Offloader()
    blocks = [Checkpointed(layer, None, off, 0), Checkpointed(layer, None, off, 1)]
    with recording_host_requests() as asked:
        loss = blocks[1](blocks[0](x * 1, w0), w1).square().sum()
    assert [n for n, _ in asked] == [3 * 5 * 4, 3 * 5 * 4]     # each layer's input, once
    assert torch.equal(loss, ref)
    loss.backward()
    for t, w in zip((x, w0, w1), want):
        assert torch.equal(t.grad, w)
