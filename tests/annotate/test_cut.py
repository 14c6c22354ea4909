"""The cut at each read (spdsl/annotate/cut.py), in one process through ``spdsl.plan`` (which
runs the segments on the real global arguments, no collective): a segment ends where Python
reads a value and hands on only what Python can still reach; the value read is the global one;
``x[mask]`` becomes an index by the mask's positions (so ``x``'s gradient still flows); a shape
from data runs whole, or is refused under ``strict=True``."""

from __future__ import annotations

import pytest
import torch

import spdsl


def test_a_segment_ends_at_each_read_and_hands_on_what_python_holds():
    seen = {}

    def f(x):
        a = x * 2                      # dropped before the read: not handed on
        b = a + 1
        del a
        if b.mean() > 0:               # read 1 (a bool)
            b = b * 3
        s = float(b.abs().max())      # read 2 (a number Python looks at)
        seen["s"] = s
        return (b / s).sum()

    x = torch.randn(1, 8, 4).abs() + 0.1
    plan = spdsl.plan(spdsl.sp_shard(seq=2)(f), x)
    assert [s.ops for s in plan.segments][:1] == [4]      # mul, add, mean, gt
    first = plan.segments[0]
    assert first.outputs == 2                              # b and the compared mean, not a
    assert [b.kind for b in plan.breaks] == ["bool", "item"]
    assert seen["s"] == pytest.approx(float((x * 2 + 1).mul(3).abs().max()))


def test_a_boolean_mask_becomes_an_index_and_keeps_the_gradient():
    def f(x):
        picked = x[x > 0]             # how many: data; read as the mask's positions
        return picked.sum() + x.pow(2).sum()

    x = torch.randn(1, 8, 4, requires_grad=True)
    plan = spdsl.plan(spdsl.sp_shard(seq=2)(f), x)
    assert [b.kind for b in plan.breaks] == ["x[mask]"]
    assert plan.breaks[0].whole               # the mask is gathered to be read


def test_a_shape_from_data_is_refused_under_strict():
    def f(x):
        used = torch.unique((x > 0).long())
        return x.sum() * used.numel()

    x = torch.randn(1, 8, 4)
    plan = spdsl.plan(spdsl.sp_shard(seq=2)(f), x)
    assert [b.kind for b in plan.breaks] == ["unique"]
    with pytest.raises(spdsl.ShardingError) as e:
        spdsl.plan(spdsl.sp_shard(seq=2, strict=True)(f), x)
    assert "[gather]" in str(e.value) and "strict=True" in str(e.value)


def test_a_segment_hands_on_no_tensor_only_a_backward_formula_saved():
    """The trace's own autograd graph never runs backward: a weight's transpose that ``addmm``
    saves, a ``relu`` output saved for its backward, are not handed on (each would be one more
    output to make whole, and a weight's gradient reduced apart from its bucket)."""
    lin = torch.nn.Linear(4, 4)

    def f(x):
        h = lin(x).relu()
        if h.mean() > 0:                 # h, the compared mean: what Python holds here
            h = h * 2
        return lin(h).pow(2).mean()

    x = torch.randn(1, 8, 4, requires_grad=True)
    plan = spdsl.plan(spdsl.sp_shard(seq=2)(f), x)
    assert plan.segments[0].outputs == 2, plan.segments[0]      # h and the comparison


def test_a_forward_that_runs_its_own_backward_is_refused_in_segments():
    lin = torch.nn.Linear(4, 4)

    def f(x):
        h = lin(x)
        (g,) = torch.autograd.grad(h.pow(2).sum(), x, create_graph=True)
        if h.mean() > 0:
            h = h * 2
        return (h + g).sum()

    x = torch.randn(1, 8, 4, requires_grad=True)
    with pytest.raises(spdsl.ShardingError) as e:
        spdsl.plan(spdsl.sp_shard(seq=2)(f), x)
    assert "backward of its own" in str(e.value)


def test_a_base_python_holds_through_a_view_is_handed_on_as_the_view():
    """Batch 2: a linear layer's ``[B*S, H]`` product, the base of the ``[B, S, H]`` view Python
    holds, is split on the inner factor of its merged dim, which a DTensor cannot describe: it
    was handed on gathered whole. The segment hands on the view; a later segment that reads the
    base (Python holds it here too) views the view back, and a read of the base reads it."""
    torch.manual_seed(0)
    lin, lin2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    seen = {}

    def f(x):
        flat = lin(x.reshape(-1, 4))           # [B*S, 4], held by Python
        h = flat.view(x.shape)                 # [B, S, 4]
        g = lin2(x)                            # a [B*S, 4] base only the view holds
        if h.mean() > 0:                       # read 1: hands on h and g, not their bases
            h = h * 2
        seen["top"] = float(flat.max())        # the base used after the read
        seen["nz"] = int(torch.nonzero(flat > 0).shape[0])     # and read whole
        return (h + g).pow(2).mean() + flat.pow(2).mean()

    x = torch.randn(2, 8, 4)
    plan = spdsl.plan(spdsl.sp_shard(seq=2)(f), x)
    assert plan.segments[0].outputs == 3, plan        # h, g, the comparison
    first = plan.segments[0].plan.collectives      # the bases were gathered to be handed on
    assert not [c for c in first if c.kind == "all_gather"], first
    with torch.no_grad():
        flat = lin(x.reshape(-1, 4))
        assert seen == {"top": pytest.approx(float(flat.max())),
                        "nz": int((flat > 0).sum())}
