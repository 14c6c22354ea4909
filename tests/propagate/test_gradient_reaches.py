"""``gradient_reaches``: the nodes of a traced graph a gradient can flow back into. The lowering
moves any other value detached (no backward collective, no zero gradient for what made it), so
a node wrongly left out loses its gradient and one wrongly kept costs a collective."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spdsl.propagate.engine import gradient_reaches


def _names(fn, *args) -> tuple[torch.fx.Graph, set[str]]:
    gm = make_fx(fn)(*args)
    return gm.graph, {n.name for n in gradient_reaches(gm.graph)}


def _by_target(graph: torch.fx.Graph, target) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.target is target]


def test_indices_and_detached_values_carry_no_gradient():
    aten = torch.ops.aten

    def f(x, w):
        scores = x @ w
        idx = scores.topk(2, dim=-1).indices          # only the indices are read
        side = (x * 3).detach()
        return x.gather(-1, idx).sum() + side.sum()

    graph, live = _names(f, torch.randn(4, 6), torch.randn(6, 6))
    mm, = _by_target(graph, aten.mm.default)
    mul, = _by_target(graph, aten.mul.Tensor)
    assert mm.name not in live and mul.name not in live
    assert "x_1" in live and "w_1" not in live


def test_a_write_into_a_view_carries_the_gradient_of_what_reads_the_buffer():
    aten = torch.ops.aten

    def f(x, g):
        buf = torch.zeros(3, 4)
        for i in range(3):                 # a chunked recurrence filling its output
            buf[i] = x[i] * g.exp()        # copy_ into select(buf): its result is never read
        return buf.sum()

    graph, live = _names(f, torch.randn(3, 4), torch.randn(4))
    copies = _by_target(graph, aten.copy_.default)
    assert len(copies) == 3 and all(c.name in live for c in copies)
    exps = _by_target(graph, aten.exp.default)
    assert len(exps) == 3 and all(e.name in live for e in exps)
    assert "g_1" in live and "x_1" in live


def test_a_write_into_a_buffer_nothing_reads_carries_none():
    aten = torch.ops.aten

    def f(x, g):
        scratch = torch.zeros(4)
        scratch[0] = (g * 2).sum()         # written, never read
        return x.sum() + scratch.detach().sum()

    graph, live = _names(f, torch.randn(4), torch.randn(4))
    copy, = _by_target(graph, aten.copy_.default)
    assert copy.name not in live and "g_1" not in live and "x_1" in live


def test_a_write_into_a_piece_of_a_split_counts_too():
    aten = torch.ops.aten

    def f(x, g):
        buf = torch.zeros(4, 4)
        top, _ = buf.split(2)
        top.copy_(x * g)                   # written through split's first piece
        return buf.sum()

    graph, live = _names(f, torch.randn(2, 4), torch.randn(4))
    copy, = _by_target(graph, aten.copy_.default)
    assert copy.name in live and "g_1" in live
