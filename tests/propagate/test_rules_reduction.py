"""The reduction rules (``spdsl.propagate.rules.reduction``) asked directly at SP 4: where the
split lands when other dims are reduced (``keepdim`` or not), which reductions over the split
leave a partial sum (sum and mean, the mean with its global-count lowering) and which need the
dim whole, partial sums through a sum, ops returning pairs, ops along one dim, layer norm.
The plans of the common cases: ``test_rules_families.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spdsl.propagate.placement import PARTIAL, REPLICATE, Shard
from tests.propagate._rule_ctx import ctx_of, strategies, table

X = torch.randn(2, 16, 8)            # [B, S@sp, D]
SEQ = Shard(1, 1, 16)
R, P = repr(REPLICATE), repr(PARTIAL)


def _one(fn, op, p=SEQ):
    return table(strategies(ctx_of(fn, (X,), op, [p])))


@pytest.mark.parametrize("fn, op, out", [
    (lambda x: x.sum(0), "sum", "Shard(0)"),                      # the dim before it goes
    (lambda x: x.sum(0, keepdim=True), "sum", "Shard(1)"),        # kept: the split stays put
    (lambda x: x.amax(-1), "amax", "Shard(1)"),          # amax's default overload has dims
    (lambda x: x.amin((0, 2), keepdim=True), "amin", "Shard(1)"),
    (lambda x: x.sum((0, 2)), "sum", "Shard(0)"),
    (lambda x: torch.linalg.vector_norm(x, dim=0), "linalg_vector_norm", "Shard(0)"),
    (lambda x: x.var(0), "var", "Shard(0)"),
])
def test_reducing_other_dims_keeps_the_split(fn, op, out):
    assert _one(fn, op) == [("reduce", ("Shard(1)",), out)]


def test_sum_and_mean_over_the_split_are_partial_sums():
    s = strategies(ctx_of(lambda x: x.sum(1), (X,), "sum", [SEQ]))
    assert [(t.rule, t.output, t.lowering) for t in s] == [
        ("reduce.partial", PARTIAL, None), ("reduce", REPLICATE, None)]
    m = strategies(ctx_of(lambda x: x.mean(1), (X,), "mean", [SEQ]))
    # a mean of local means is wrong on uneven pieces: the lowering divides by the global count
    assert m[0].lowering == "mean_partial" and m[0].output == PARTIAL


@pytest.mark.parametrize("fn, op", [
    (lambda x: x.amax(1), "amax"),
    (lambda x: x.var(1), "var"),
    (lambda x: x.logsumexp(1), "logsumexp"),
    (lambda x: x.prod(), "prod"),
    (lambda x: x.amax(), "amax"),                       # no dims: every dim
])
def test_other_reductions_over_the_split_need_it_whole(fn, op):
    assert _one(fn, op) == [("reduce", (R,), R)]


def test_a_partial_sum_summed_again_stays_partial_but_a_max_of_it_does_not():
    assert _one(lambda x: x.sum(-1), "sum", PARTIAL) == [("reduce", (P,), P)]
    assert _one(lambda x: x.amax(-1), "amax", PARTIAL) == [("reduce", (R,), R)]
    assert _one(lambda x: x.mean(-1), "mean", PARTIAL) == [("reduce", (R,), R)]


def test_pairs_carry_the_split_on_both_outputs():
    assert _one(lambda x: x.max(-1), "max") == [
        ("reduce", ("Shard(1)",), ("Shard(1)", "Shard(1)"))]
    assert _one(lambda x: x.min(1), "min") == [("reduce", (R,), (R, R))]
    assert _one(lambda x: torch.var_mean(x, 2, keepdim=True), "var_mean") == [
        ("reduce", ("Shard(1)",), ("Shard(1)", "Shard(1)"))]


@pytest.mark.parametrize("fn, op, kept", [
    (lambda x: x.softmax(-1), "_softmax", True),
    (lambda x: F.log_softmax(x, 1), "_log_softmax", False),
    (lambda x: x.cumsum(2), "cumsum", True),
    (lambda x: x.cumsum(1), "cumsum", False),
    (lambda x: x.topk(2, dim=-1)[0], "topk", True),
    (lambda x: x.topk(2, dim=1)[0], "topk", False),
])
def test_ops_along_one_dim_keep_a_split_elsewhere(fn, op, kept):
    got = _one(fn, op)
    assert len(got) == 1 and got[0][0] == "along_dim"
    want = "Shard(1)" if kept else R
    assert got[0][1][0] == want
    out = got[0][2]
    assert (out if isinstance(out, str) else out[0]) == want


def test_layer_norm_keeps_a_split_outside_the_normalised_dims():
    w, b = torch.ones(8), torch.zeros(8)
    ctx = ctx_of(lambda x, w, b: F.layer_norm(x, (8,), w, b), (X, w, b), "native_layer_norm",
                 [SEQ, REPLICATE, REPLICATE])
    assert table(strategies(ctx)) == [
        ("layer_norm", ("Shard(1)", R, R), ("Shard(1)",) * 3)]
    ctx = ctx_of(lambda x: F.layer_norm(x, (16, 8)), (X,), "native_layer_norm", [SEQ])
    assert table(strategies(ctx)) == [("layer_norm", (R,), (R, R, R))]
