"""DTensor's strategies as an spdsl rule (``spdsl.propagate.rules.dtensor``), asked directly at
SP 4 with no process group: placements translated to DTensor's and back, a split kept where
DTensor keeps it and gathered where it runs along it, partial sums through linear ops only,
and no strategy (None) where the placement has no DTensor form or the op has global shape
arguments."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spdsl.propagate.placement import PARTIAL, REPLICATE, Shard
from spdsl.propagate.rules.dtensor import strategy_from_dtensor
from tests._util import dtensor_has_strategy
from tests.propagate._rule_ctx import ctx_of

X = torch.randn(2, 16, 8)            # [B, S@sp, D]
SEQ = Shard(1, 1, 16)
aten = torch.ops.aten


def _dtensor(fn, op, p=SEQ):
    ctx = ctx_of(fn, (X,), op, [p])
    return strategy_from_dtensor(ctx.node, ctx.inputs, ctx.placements, 4)


def test_a_split_off_the_repeated_dim_is_kept_and_named_for_dtensor():
    s = _dtensor(lambda x: x.repeat(1, 1, 2), "repeat")
    assert (s.inputs, s.output, s.rule, s.lowering) == ((SEQ,), Shard(1, 1, 16),
                                                       "dtensor:repeat", None)


def test_a_partial_sum_passes_a_linear_op_and_not_a_nonlinear_one():
    assert _dtensor(lambda x: x.repeat(1, 1, 2), "repeat", PARTIAL).output == PARTIAL
    s = _dtensor(F.gelu, "gelu", PARTIAL)
    assert (s.inputs, s.output) == ((REPLICATE,), REPLICATE)


@pytest.mark.skipif(not dtensor_has_strategy(aten.flip.default),
                    reason="DTensor has no flip strategy before torch 2.13")
def test_flip_along_the_split_gathers_it_and_elsewhere_keeps_it():
    assert _dtensor(lambda x: x.flip(2), "flip").output == SEQ
    s = _dtensor(lambda x: x.flip(1), "flip")
    assert (s.inputs, s.output) == ((REPLICATE,), REPLICATE)


def test_tuple_outputs_translate_each():
    s = _dtensor(lambda x: x.sort(2)[0], "sort")
    assert s.output == (SEQ, SEQ)


def test_no_strategy_for_a_split_inside_a_merged_dim():
    # [2x16@sp, 8]: DTensor's Shard(0) would be the batch-major chunk, not this
    x = torch.randn(32, 8)
    ctx = ctx_of(lambda x: x.repeat(1, 2), (x,), "repeat", [Shard(0, 2, 16)])
    assert strategy_from_dtensor(ctx.node, ctx.inputs, ctx.placements, 4) is None
    # nor for a piece of a dim (an uneven window of it)
    ctx = ctx_of(lambda x: x.repeat(1, 1, 2), (X,), "repeat", [Shard(1, 1, 15)])
    assert strategy_from_dtensor(ctx.node, ctx.inputs, ctx.placements, 4) is None


def test_no_strategy_for_ops_with_global_shape_arguments():
    assert _dtensor(lambda x: x.view(2, 128), "view") is None
