"""``spdsl.remat.tiling`` on small graphs (one process): a region run in sequence chunks gives
the untiled outputs and gradients, which regions qualify, and the rewrite of a traced
feed-forward block into one ``TiledRows`` call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from spdsl.remat import policy
from spdsl.remat.tiling import TiledRows, _chunk_shape, mlp_regions, tile_region
from tests._util import assert_close

aten = torch.ops.aten


def _mlp(x, w1, w3, w2):
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def _weights(d=6, f=10):
    torch.manual_seed(0)
    return [torch.randn(f, d, dtype=torch.float64, requires_grad=True),
            torch.randn(f, d, dtype=torch.float64, requires_grad=True),
            torch.randn(d, f, dtype=torch.float64, requires_grad=True)]


def _grads(fn, x, ws):
    x = x.detach().requires_grad_()
    y = fn(x, *ws)
    torch.manual_seed(1)
    y.backward(torch.randn_like(y))
    out = [y.detach(), x.grad] + [w.grad for w in ws]
    for w in ws:
        w.grad = None
    return out


@pytest.mark.parametrize("shape,dim,chunks", [((2, 7, 6), 1, 3), ((9, 6), 0, 4),
                                              ((2, 5, 6), 1, 8)])
def test_tiled_rows_give_the_untiled_outputs_and_gradients(shape, dim, chunks):
    region = torch.fx.symbolic_trace(_mlp)
    ws = _weights()
    x = torch.randn(*shape, dtype=torch.float64)
    want = _grads(region, x, ws)
    got = _grads(TiledRows(region, chunks, dim), x, ws)
    for name, a, e in zip(["y", "dx", "dw1", "dw3", "dw2"], got, want):
        assert_close(a, e, rtol=1e-12, atol=1e-12, name=name)


def test_chunks_run_one_at_a_time_marked_as_tiled():
    seen = []

    class Region(torch.nn.Module):
        def forward(self, x, w):
            seen.append((x.shape[1], policy._IN_TILE[0]))
            return (x @ w).relu() @ w.t()

    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 6, 4, requires_grad=True)
    y = TiledRows(Region(), 3, 1)(x, w)
    assert seen == [(2, 1)] * 3 and policy._IN_TILE[0] == 0
    y.sum().backward()      # backward recomputes each chunk
    assert seen[3:] == [(2, 0)] * 3
    seen.clear()
    TiledRows(Region(), 1, 1)(x, w)          # one chunk: the region itself, not marked
    assert seen == [(6, 0)]


def test_chunk_shape_marks_the_sequence_dim():
    assert _chunk_shape([2, 8, 16], 2) == [2, -1, 16]
    assert _chunk_shape([16, 16], 2) == [-1, 16]          # [B * S, D]: the rows
    assert _chunk_shape([1, 8, 4, 4], 1) == [1, -1, 4, 4]
    with pytest.raises(ValueError, match="no sequence dim"):
        _chunk_shape([2, 1], 2)


def _traced(fn, x, *ws, module="layers.0.feed_forward"):
    """``fn`` as aten ops stamped with ``module``, its views as make_fx writes them (a chunk
    of a ``[B, S, D]`` input along S is not contiguous: the tiled region reshapes)."""
    gm = make_fx(lambda *a: fn(a[-1], *a[:-1]), tracing_mode="fake")(*ws, x)
    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.meta["spdsl_module"] = module
    return gm


def test_a_traced_feed_forward_block_becomes_one_tiled_call():
    ws = _weights()
    x = torch.randn(2, 8, 6, dtype=torch.float64)
    gm = _traced(_mlp, x, *ws)
    regions = mlp_regions(gm, n_state=3)
    assert len(regions) == 1
    r = regions[0]
    assert (r["dim"], r["seq"], r["outer"]) == (1, 8, 2)
    assert r["x"].op == "placeholder" and r["ffn_bytes"] == 2 * 8 * 10 * 8
    # weight-side nodes stay outside: the region reads t(W), not W's placeholder
    assert all(w.target is aten.t.default for w in r["ws"]) and len(r["ws"]) == 3
    want = _grads(lambda x, *ws: gm(*ws, x), x, ws)
    tile_region(gm, r, 4, "tiled_mlp")
    gm.recompile()
    assert isinstance(gm.tiled_mlp, TiledRows) and gm.tiled_mlp.chunks == 4
    assert not any(n.target is aten.mm.default for n in gm.graph.nodes)
    got = _grads(lambda x, *ws: gm(*ws, x), x, ws)
    for name, a, e in zip(["y", "dx", "dw1", "dw3", "dw2"], got, want):
        assert_close(a, e, rtol=1e-12, atol=1e-12, name=name)


def test_regions_that_do_not_qualify():
    ws = _weights()
    x = torch.randn(2, 8, 6, dtype=torch.float64)
    # softmax is not a per-token op in the list: left alone
    gm = _traced(lambda x, w1, w3, w2: F.linear(torch.softmax(F.linear(x, w1), -1), w2),
                 x, *ws)
    assert mlp_regions(gm, n_state=3) == []
    # one matmul: nothing to gain
    assert mlp_regions(_traced(lambda x, w1, w3, w2: F.linear(x, w1).relu().sum(-1,
                                                                            keepdim=True),
                               x, *ws), n_state=3) == []
    # outside a numbered layer
    assert mlp_regions(_traced(_mlp, x, *ws, module="lm_head"), n_state=3) == []
    # output shape differs from the input's
    assert mlp_regions(_traced(lambda x, w1, w3, w2: F.linear(F.linear(x, w1).relu() @ w3, w1),
                               x, *ws), n_state=3) == []
