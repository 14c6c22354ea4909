"""The factory rule (``spdsl.propagate.rules.factory``): a value made from nothing (arange,
ones, full, eye, ...) is replicated, every rank building the global tensor, and is sliced for
free where it meets the split sequence (no collective)."""

from __future__ import annotations

import pytest
import torch

import spdsl
from spdsl.propagate.placement import REPLICATE
from tests.propagate._rule_ctx import ctx_of, strategies, table

X = torch.randn(2, 16, 8)            # [B, S@sp, D]
R = repr(REPLICATE)


@pytest.mark.parametrize("fn, op", [
    (lambda x: x + torch.arange(8.0), "arange"),
    (lambda x: x + torch.ones(8), "ones"),
    (lambda x: x + torch.full((8,), 2.0), "full"),
    (lambda x: x[0] @ torch.eye(8), "eye"),
])
def test_made_from_nothing_is_replicated_with_the_factory_lowering(fn, op):
    ss = strategies(ctx_of(fn, (X,), op))
    assert [(s.inputs, s.output, s.lowering, s.rule) for s in ss] == [
        ((), REPLICATE, "factory", "factory")]


def test_a_replicated_table_meets_the_split_sequence_without_a_collective():
    # a causal row count [16] per token, built whole, taken per rank where it meets x
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(
        lambda x: x * torch.ones(16, 16).tril().sum(-1).view(1, 16, 1)), X)
    made = [v for v in plan.values if v.origin == "factory"]
    assert [v.typed for v in made] == ["f32[16,16]"]
    assert [c for c in plan.collectives if c.purpose != "check"] == []


def test_new_ones_of_a_replicated_value_is_whole():
    ctx = ctx_of(lambda x: x * x.new_ones(8), (X,), "new_ones")
    assert table(strategies(ctx)) == [("factory", (R,), R)]


def test_new_ones_of_a_split_value_moves_nothing():
    """Only ``x``'s dtype and device are read: a split ``x`` is not gathered for it."""
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(lambda x: x * x.new_ones(8)), X)
    v = next(v for v in plan.values if v.op == "aten.new_ones.default")
    assert v.moves == ()
