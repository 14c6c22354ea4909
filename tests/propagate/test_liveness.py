"""What a traced graph's output depends on (``spdsl.propagate.liveness``): ``sweep`` erases the
ops that reach nothing and keeps what the program must still do (a draw, an update of an
input, a write into a temporary that a live op reads through a view)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spdsl.propagate.liveness import live_nodes, sweep, view_family

aten = torch.ops.aten


def _calls(g: torch.fx.Graph) -> list:
    return [n.target for n in g.nodes if n.op == "call_function"]


def test_sweep_erases_what_reaches_nothing_and_keeps_effects():
    def f(x, buf):
        x.exp()                     # read by nothing
        y = x * 2
        y.mul_(3)                   # in place on a temporary nothing reads
        torch.rand(3)               # a draw: the stream advances as in the program
        buf.add_(1)                 # an update of an input
        return x + 1
    g = make_fx(f)(torch.randn(3), torch.zeros(3)).graph
    sweep(g)
    calls = _calls(g)
    assert aten.exp.default not in calls and aten.mul_.Tensor not in calls
    assert aten.mul.Tensor not in calls
    assert {aten.rand.default, aten.add_.Tensor, aten.add.Tensor} <= set(calls)


def test_writes_into_a_temporary_a_live_op_reads_are_kept():
    def f(x):
        t = x.new_empty(4)          # DeepSeek-V2's keys: filled slice by slice
        t[:2].copy_(x[:2])
        t[2:].copy_(x[2:] * 3)
        return t.sum()
    gm = make_fx(f)(torch.randn(4))
    sweep(gm.graph)
    assert _calls(gm.graph).count(aten.copy_.default) == 2
    gm.recompile()
    x = torch.arange(4.0)
    assert gm(x) == x[:2].sum() + 3 * x[2:].sum()


def test_view_family_is_every_view_of_the_base():
    def f(x):
        a = x.view(2, 2)
        b = a.t()
        c = x.view(4, 1)
        return b + 1, c * 2, x.exp()
    g = make_fx(f)(torch.randn(4)).graph
    x = next(n for n in g.nodes if n.op == "placeholder")
    b = next(n for n in g.nodes if n.target is aten.t.default)
    family = view_family(b)
    assert x in family and {n.target for n in family if n is not x} == \
        {aten.view.default, aten.t.default}
    assert len(family) == 4
    assert all(n in live_nodes(g) for n in g.nodes if n.op == "call_function")
