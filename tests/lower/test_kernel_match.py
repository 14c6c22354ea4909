"""``spdsl.lower.kernel_match`` on small traced graphs (one process): each matcher rewrites the
spellings it accepts into one kernel call computing the same values, and leaves near misses
alone. The whole kernel pass on models is tested in ``tests/lower/test_kernels_pass.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import spdsl.kernels as K
from spdsl.lower import kernel_match as M
from spdsl.lower.loss import tiled_nll
from tests._util import assert_close

aten = torch.ops.aten


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _rms_squared_by_mul_weight_first(x, w):
    return w * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6))


def _rms_over_dim0(x, w):
    return x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6) * w


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def _rope(x, cos, sin):
    return x * cos + _rotate_half(x) * sin


def _rope_chunked(x, cos, sin):
    a, b = x.chunk(2, dim=-1)
    return sin * torch.cat((-b, a), -1) + cos * x


def _swiglu(a, b):
    return F.silu(a) * b


def _run_match(fn, args, anchor, matcher):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    want = fn(*args)
    nodes = [n for n in gm.graph.nodes if n.target is anchor]
    assert len(nodes) == 1
    m = matcher(gm.graph, nodes[0])
    gm.recompile()
    return m, gm, want


@pytest.mark.parametrize("fn", [_rms, _rms_squared_by_mul_weight_first])
def test_rms_norm_spellings_become_one_kernel_call(fn):
    torch.manual_seed(0)
    x, w = torch.randn(2, 5, 8), torch.randn(8)
    m, gm, want = _run_match(fn, (x, w), aten.rsqrt.default, M.match_rms_norm)
    assert m is not None and m.kernel == "rms_norm" and m.node.target is K.rms_norm
    assert "aten.rsqrt" in m.replaces and "aten.mean" in m.replaces
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [K.rms_norm]
    assert_close(gm(x, w), want, rtol=1e-5, atol=1e-6, name="rms_norm")


def test_a_norm_over_another_dim_is_left_alone():
    x, w = torch.randn(4, 8), torch.randn(8)
    m, gm, _want = _run_match(_rms_over_dim0, (x, w), aten.rsqrt.default, M.match_rms_norm)
    assert m is None
    assert any(n.target is aten.rsqrt.default for n in gm.graph.nodes)


@pytest.mark.parametrize("fn", [_rope, _rope_chunked])
@pytest.mark.parametrize("table", [(6, 8), (1, 1, 6, 8)])
def test_rope_spellings_become_one_kernel_call(fn, table):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 8)
    cos, sin = torch.randn(table), torch.randn(table)
    m, gm, want = _run_match(fn, (x, cos, sin), aten.add.Tensor, M.match_rope)
    assert m is not None and m.kernel == "rope" and m.node.target is K.rope
    assert not any(n.target in (aten.cat.default, aten.neg.default) for n in gm.graph.nodes)
    assert_close(gm(x, cos, sin), want, rtol=1e-5, atol=1e-6, name="rope")


def test_rope_with_tables_of_another_length_is_left_alone():
    x, cos, sin = torch.randn(2, 3, 6, 8), torch.randn(1, 8), torch.randn(1, 8)
    m, _, _ = _run_match(_rope, (x, cos, sin), aten.add.Tensor, M.match_rope)
    assert m is None


def test_swiglu_becomes_one_kernel_call_and_broadcasting_does_not():
    torch.manual_seed(0)
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    m, gm, want = _run_match(_swiglu, (a, b), aten.mul.Tensor, M.match_swiglu)
    assert m is not None and m.replaces == ["aten.silu", "aten.mul"]
    assert_close(gm(a, b), want, rtol=1e-6, atol=1e-7, name="swiglu")
    m, _, _ = _run_match(_swiglu, (a, torch.randn(4)), aten.mul.Tensor, M.match_swiglu)
    assert m is None


def test_every_head_and_loss_becomes_the_fused_loss():
    torch.manual_seed(0)
    h, wt, t = torch.randn(6, 4), torch.randn(4, 10), torch.randint(0, 10, (6,))

    def two_losses(h, wt, t):
        return F.cross_entropy(h @ wt, t) + F.cross_entropy(h @ (2 * wt), t)

    gm = make_fx(two_losses, tracing_mode="fake")(h, wt, t)
    want = two_losses(h, wt, t)
    got = M.swap_losses(gm)
    gm.recompile()
    assert [m.kernel for m in got] == ["fused_linear_cross_entropy"] * 2
    assert all(m.node.target is tiled_nll and m.replaces[0] == "aten.mm" for m in got)
    assert_close(gm(h, wt, t), want, rtol=1e-5, name="loss")
