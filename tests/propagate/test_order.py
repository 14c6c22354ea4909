"""The traced program's order made one over the ranks (``spdsl.propagate.order``): keys that
name what a node computes whatever it is called, a rank's nodes moved into another rank's
order, equal values merged (but not buffers written in place, nor random draws), and the
error where the programs differ. The ranks themselves: ``tests/annotate/test_order.py``."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spdsl.errors import ShardingError
from spdsl.propagate.order import digest, follow, merge_equal, structure_keys
from tests._util import assert_close


def _tables(order):
    """Two rotary-like tables computed in ``order`` (as ``for t in set(...)``), then used
    in a fixed order."""
    def fn(x, pos, inv_a, inv_b):
        inv = {"a": inv_a, "b": inv_b}
        tables = {}
        for name in order:
            f = pos[:, None].float() * inv[name][None, :]
            tables[name] = (f.cos(), f.sin())
        y = x * tables["a"][0] + x.flip(-1) * tables["a"][1]
        return y * tables["b"][0] + y.flip(-1) * tables["b"][1]
    return fn


def _inputs():
    torch.manual_seed(0)
    return (torch.randn(16, 8), torch.arange(16), torch.rand(8), torch.rand(8))


def _graphs():
    xs = _inputs()
    return make_fx(_tables("ab"))(*xs), make_fx(_tables("ba"))(*xs), xs


def test_keys_name_the_work_not_its_place():
    ga, gb, _ = _graphs()
    ka, kb = structure_keys(ga), structure_keys(gb)
    assert sorted(ka) == sorted(kb) and ka != kb
    assert digest(ka) != digest(kb)
    assert ka[:4] == kb[:4]                      # the inputs: by position


def test_follow_takes_the_other_order_and_computes_the_same():
    ga, gb, xs = _graphs()
    before = gb(*xs)
    merge_equal(ga), merge_equal(gb)      # both read pos[:, None].float(): kept once, alike
    assert follow(gb, structure_keys(ga))
    assert structure_keys(gb) == structure_keys(ga)
    assert not follow(gb, structure_keys(ga))
    assert_close(gb(*xs), before, rtol=0, atol=0, name="reordered")
    assert_close(gb(*xs), ga(*xs), rtol=0, atol=0, name="against the other order")


def test_equal_nodes_merged_only_where_they_are_values():
    def fn(x):
        a, b = x.new_empty(4), x.new_empty(4)        # two buffers, filled differently
        a.copy_(x[:4])
        b.copy_(x[4:])
        r1, r2 = torch.rand_like(x), torch.rand_like(x)        # two draws
        return (a + b).sum() * 0 + x.exp() + x.exp(), r1 - r2
    g = make_fx(fn)(torch.randn(8))
    assert merge_equal(g) == 1                    # the second x.exp() only
    x = torch.randn(8)
    out, diff = g(x)
    assert_close(out, 2 * x.exp(), rtol=1e-6, atol=0, name="merged")
    assert diff.abs().max() > 0


def test_different_programs_are_an_error():
    xs = _inputs()
    ga = make_fx(_tables("ab"))(*xs)
    gc = make_fx(lambda x, pos, ia, ib: _tables("ab")(x, pos, ia, ib) * 2)(*xs)
    with pytest.raises(ShardingError, match="one program on every rank") as e:
        follow(gc, structure_keys(ga))
    assert "PYTHONHASHSEED" in str(e.value)
