"""The elementwise rule (``spdsl.propagate.rules.pointwise``) asked directly at SP 4: the output
keeps an input's split (dims counted from the right, as broadcasting does), other operands follow
it or are used whole where they broadcast, two operands split alike give one strategy, and a
partial sum passes only through ops linear in it."""

from __future__ import annotations

import pytest
import torch

from spdsl.propagate.placement import PARTIAL, REPLICATE, Shard
from spdsl.propagate.rules import lookup
from spdsl.propagate.rules.pointwise import pointwise
from tests.propagate._rule_ctx import ctx_of, strategies, table

X = torch.randn(2, 16, 8)            # [B, S@sp, D]
SEQ = Shard(1, 1, 16)
R, P = repr(REPLICATE), repr(PARTIAL)
aten = torch.ops.aten


def _rules(fn, op, args, placements):
    return table(strategies(ctx_of(fn, args, op, placements)))


def test_a_broadcast_operand_is_used_whole_and_a_full_one_follows_the_split():
    assert _rules(torch.mul, "mul", (X, torch.randn(8)), [SEQ, REPLICATE]) == [
        ("pointwise", ("Shard(1)", R), "Shard(1)"), ("pointwise", (R, R), R)]
    assert _rules(torch.mul, "mul", (X, torch.randn(2, 1, 8)), [SEQ, REPLICATE])[0] == \
        ("pointwise", ("Shard(1)", R), "Shard(1)")
    assert _rules(torch.add, "add", (torch.randn(16, 8), X), [REPLICATE, SEQ])[0] == \
        ("pointwise", ("Shard(0)", "Shard(1)"), "Shard(1)")


def test_a_lower_rank_split_input_names_the_output_dim_from_the_right():
    # [16@sp, 8] + [2, 16, 8]: the split of dim 0 is dim 1 of the output
    got = _rules(torch.add, "add", (torch.randn(16, 8), X), [Shard(0, 1, 16), REPLICATE])
    assert got[0] == ("pointwise", ("Shard(0)", "Shard(1)"), "Shard(1)")


def test_two_operands_split_alike_give_one_strategy():
    got = _rules(torch.add, "add", (X, X * 2), [SEQ, SEQ])
    assert got == [("pointwise", ("Shard(1)", "Shard(1)"), "Shard(1)"), ("pointwise", (R, R), R)]


def test_operands_split_on_different_dims_offer_each():
    got = _rules(torch.add, "add", (X, X * 2), [SEQ, Shard(2, 1, 8)])
    assert [g[2] for g in got] == ["Shard(1)", "Shard(2)", R]


@pytest.mark.parametrize("fn, op, placements, linear", [
    (torch.add, "add", [PARTIAL, PARTIAL], (P, P)),          # a sum of two sums
    (torch.sub, "sub", [PARTIAL, PARTIAL], (P, P)),
    (torch.mul, "mul", [PARTIAL, REPLICATE], (P, R)),         # scaled by a whole value
    (torch.div, "div", [PARTIAL, REPLICATE], (P, R)),
    (torch.add, "add", [PARTIAL, REPLICATE], None),           # every rank would add it
    (torch.mul, "mul", [PARTIAL, PARTIAL], (P, R)),           # the second summed first
    (torch.div, "div", [REPLICATE, PARTIAL], None),           # 1 / sum is not linear
])
def test_a_partial_sum_passes_only_linear_ops(fn, op, placements, linear):
    got = _rules(fn, op, (X, X * 2), placements)
    lin = [g for g in got if g[0] == "pointwise.linear"]
    assert lin == ([("pointwise.linear", linear, P)] if linear else [])
    assert got[-1] == ("pointwise", (R, R), R)


def test_a_number_added_to_a_partial_sum_needs_it_whole():
    # x + 1 on a partial sum: each of the P shares would get the 1
    assert _rules(lambda x: x + 1, "add", (X,), [PARTIAL]) == [("pointwise", (R,), R)]
    assert _rules(lambda x: x * 3, "mul", (X,), [PARTIAL])[0][0] == "pointwise.linear"
    assert _rules(lambda x: x.exp(), "exp", (X,), [PARTIAL]) == [("pointwise", (R,), R)]


def test_ops_tagged_pointwise_find_the_rule_without_registering():
    assert lookup(aten.sigmoid.default) is pointwise
    assert lookup(aten.where.self) is pointwise            # registered by name
    assert lookup(aten.mm.default) is not pointwise
