"""``spdsl.remat.segments`` on a small graph stamped with module paths (one process): which
partition each node joins, and per-layer checkpointing that recomputes each layer once in
backward and keeps the outputs and gradients."""

from __future__ import annotations

import torch

from spdsl.remat.segments import Checkpointed, checkpoint_layers, layer_partition

# the module path of each op of _program, in order
MODULES = ["embed", "layers.0.attn", "layers.0.attn", "layers.0.mlp", "", "layers.1.attn",
           "layers.1.attn", "lm_head", "", ""]


def _program(x, w):
    emb = x * 2
    a0 = torch.tanh(emb @ w)
    b0 = a0 @ w
    mid = b0 + 1
    a1 = torch.sin(mid @ w)
    head = a1 @ w
    loss = torch.sum(torch.square(head))
    return loss


def _stamped() -> torch.fx.GraphModule:
    gm = torch.fx.symbolic_trace(_program)
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]      # as in a local graph
    assert len(ops) == len(MODULES)
    for n, path in zip(ops, MODULES):
        n.meta["spdsl_module"] = path
    return gm


def test_nodes_join_their_layer_and_those_between_join_the_layer_before():
    gm = _stamped()
    parts = {n.name: p for n, p in layer_partition(gm).items()}
    by_module = {}
    for n in gm.graph.nodes:
        if n.name in parts:
            by_module.setdefault(n.meta["spdsl_module"] or n.name, set()).add(parts[n.name])
    assert by_module["embed"] == {0}
    assert by_module["layers.0.attn"] == by_module["layers.0.mlp"] == {1}
    assert by_module["layers.1.attn"] == {2}
    assert by_module["lm_head"] == {3}
    assert {p for name, p in parts.items() if name.startswith("add")} == {1}   # between layers
    assert layer_partition(torch.fx.symbolic_trace(lambda x: x + 1)) == {}


def test_each_layer_is_checkpointed_and_recomputed_once_in_backward():
    gm = _stamped()
    torch.manual_seed(0)
    x, w = torch.randn(3, 4), torch.randn(4, 4, requires_grad=True)
    want = gm(x, w)
    (dw,) = torch.autograd.grad(want, w)
    split = checkpoint_layers(gm, None)
    layers = [m for m in split.children() if isinstance(m, Checkpointed)]
    assert [m.index for m in layers] == [1, 2] and split.spdsl_offload is None
    runs = []
    for m in layers:
        m.inner.register_forward_pre_hook(lambda mod, a, i=m.index: runs.append(i))
    got = split(x, w)
    assert runs == [1, 2]
    (got_dw,) = torch.autograd.grad(got, w)
    assert runs == [1, 2, 2, 1]             # recomputed in backward, last layer first
    assert torch.equal(got, want) and torch.allclose(got_dw, dw, rtol=1e-6, atol=0)
    with torch.no_grad():
        split(x, w)
    assert runs == [1, 2, 2, 1, 1, 2]       # no grad: each layer runs once, unchecked


def test_offload_is_shared_by_the_layers():
    split = checkpoint_layers(_stamped(), None, offload=True)
    layers = [m for m in split.children() if isinstance(m, Checkpointed)]
    assert split.spdsl_offload is not None
    assert all(m.offload is split.spdsl_offload for m in layers)
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    want = _stamped()(x, w)
    got = split(x, w)
    assert torch.equal(got, want)
    assert sorted(split.spdsl_offload.pending) == [1, 2]      # each layer's input held
    got.backward()
    assert not any(split.spdsl_offload.pending.values())
