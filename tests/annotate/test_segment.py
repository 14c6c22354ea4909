"""``spdsl.annotate.segment``: a segment cut out as its own graph and its structural key, the
guards a replayed read must meet, the values of a replayed call, the attribute fingerprint
that makes a call trace every time, and running on a thread of its own."""

from __future__ import annotations

import threading

import pytest
import torch

from spdsl._torch import tree_flatten
from spdsl.annotate import segment as S


def _nodes(fn):
    gm = torch.fx.symbolic_trace(fn)
    return gm, {n.name: n for n in gm.graph.nodes}


def test_a_segment_is_its_own_graph_and_equal_segments_share_a_key():
    gm, n = _nodes(lambda x, y: ((x + 1) * y).relu() - y)
    seg = [n["add"], n["mul"], n["relu"]]
    sub, ext, key = S.graph(seg, [n["relu"]], gm)
    assert ext == [n["x"], n["y"]]
    x, y = torch.randn(3), torch.randn(3)
    (out,) = sub(x, y)
    assert torch.equal(out, ((x + 1) * y).relu())
    _, ext, _first = S.graph(seg, [n["relu"]], gm, first=frozenset({n["y"]}))
    assert ext == [n["y"], n["x"]]                    # the given inputs first
    gm2, n2 = _nodes(lambda a, b: ((a + 1) * b).relu() - b)
    assert S.graph([n2["add"], n2["mul"], n2["relu"]], [n2["relu"]], gm2)[2] == key
    gm3, n3 = _nodes(lambda a, b: ((a + 2) * b).relu() - b)
    assert S.graph([n3["add"], n3["mul"], n3["relu"]], [n3["relu"]], gm3)[2] != key


def test_guards():
    assert S.guard("item", 3) == (int, "3") != S.guard("item", 3.0)
    assert S.guard("mask", [torch.tensor([0, 2])]) == ((2,),)
    a, b = S.guard("data", torch.tensor([1, 2])), S.guard("data", torch.tensor([1, 3]))
    assert a != b and a == S.guard("data", torch.tensor([1, 2]))


def test_a_replayed_call_reads_its_values_and_recomputes_reads():
    run = S.Replayed([torch.tensor([1.0, -2.0, 3.0])])
    run.outs.append([torch.tensor(0.5)])
    run.made[0] = [torch.tensor(7)]
    assert torch.equal(run.value(("in", 0)), run.ins[0]) and run.value(("const", 4)) == 4
    assert run.value(("out", 0, 0)).item() == 0.5 and run.value(("read", 0, 0)).item() == 7
    g, made = S.Read(0, "item", ("out", 0, 0), None, None).compute(run)
    assert g == (float, "0.5") and made == []
    g, made = S.Read(0, "mask", [("in", 0)], None, None).compute(run)
    assert g == ((3,),) and torch.equal(made[0], torch.tensor([0, 1, 2]))
    read = S.Read(0, "data", (torch.unique, [("in", 0)], tree_flatten(((0,), {}))[1]),
                  None, None)
    g, made = read.compute(run)
    assert torch.equal(made[0], torch.tensor([-2.0, 1.0, 3.0]))


def test_attributes_change_the_fingerprint_parameters_do_not():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.calls, self.seen = torch.nn.Linear(2, 2), 0, []

    m = M()
    owner = type("Owner", (), {"fn": m})()
    before = S.attributes(owner, (), {})
    with torch.no_grad():
        m.lin.weight.add_(1)
    assert S.attributes(owner, (), {}) == before
    m.calls += 1
    assert S.attributes(owner, (), {}) != before
    before = S.attributes(owner, (), {})
    m.seen.append(1)
    assert S.attributes(owner, (), {}) != before
    assert not S.hooked(owner, (), {})
    m.lin.register_forward_hook(lambda *a: None)
    assert S.hooked(owner, (), {})


def test_seeded_ops_and_running_outside():
    _gm, n = _nodes(lambda x: torch.ops.aten.bernoulli.default(x) + x)
    assert S.seeded(n["bernoulli_default"]) and not S.seeded(n["add"])
    with torch.no_grad():
        grad, name = S.outside(lambda: (torch.is_grad_enabled(),
                                        threading.current_thread().name), grad=True)
    assert grad and name == "spdsl-segment"
    with pytest.raises(KeyError, match="raised there"):
        S.outside(lambda: {}["raised there"], grad=False)
