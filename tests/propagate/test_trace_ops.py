"""The ops a trace records (``spdsl.propagate.trace_ops``): SDPA, however it is called, becomes
one ``spdsl.attention`` node with its arguments, and computes what SDPA does; a constraint is
the identity on the value."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spdsl.propagate.trace import trace
from spdsl.propagate.trace_ops import keep_sdpa
from tests._util import assert_close

_ATTENTION = torch.ops.spdsl.attention.default


def _nodes(fn, *args):
    t = trace(fn, args, {})
    return t, [n for n in t.graph.graph.nodes if n.target is _ATTENTION]


def test_sdpa_is_one_attention_node_with_its_arguments():
    q, k, v = (torch.randn(1, 4, 16, 8) for _ in range(3))
    t, nodes = _nodes(lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=0.25), q, k, v)
    assert len(nodes) == 1
    assert nodes[0].args[3:] == (None, 0.0, True, 0.25, False)   # mask, dropout, causal, scale
    got = t.graph(q, k, v)[0]
    assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25),
                 rtol=1e-6, name="out")


def test_nn_multihead_attention_routes_its_inner_sdpa():
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 8, 16)
    _, nodes = _nodes(lambda x: m(x, x, x, need_weights=False)[0], x)
    assert len(nodes) == 1
    assert F.scaled_dot_product_attention is not keep_sdpa       # put back after the call


def test_keep_sdpa_binds_positions_and_defaults():
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    mask = torch.zeros(4, 4)
    assert_close(keep_sdpa(q, k, v, mask, 0.0, False),
                 F.scaled_dot_product_attention(q, k, v, mask), rtol=1e-6, name="positional")
    assert_close(keep_sdpa(q, k, v, is_causal=True),
                 F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-6,
                 name="keyword")


def test_constraint_is_the_value():
    x = torch.randn(3, 4)
    y = torch.ops.spdsl.constraint(x, "spec")
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
