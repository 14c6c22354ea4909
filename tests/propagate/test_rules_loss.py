"""The loss rules (``spdsl.propagate.rules.loss``) asked directly at SP 4: a token-mean
negative log-likelihood over split tokens is one global mean (its own lowering), a sum a partial
sum, ``reduction='none'`` per-token losses split as the labels; labels and logits meet on the
same tokens (the class dim of a 2-d loss never carries the split); elementwise losses the same;
a sharding constraint is the placement it names."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spdsl.propagate.placement import PARTIAL, REPLICATE, Shard
from spdsl.propagate.rules.loss import reduction_of
from tests.propagate._rule_ctx import ctx_of, strategies, table

LOGITS = torch.randn(32, 10)            # [B*S, V], the tokens of [2, 16@sp]
LABELS = torch.randint(0, 10, (32,))
TOKENS = Shard(0, 2, 16)
R, P = repr(REPLICATE), repr(PARTIAL)
WHOLE = [("loss.nll", (R, R), (R, R))]


def _nll(reduction: str, placements):
    return strategies(ctx_of(lambda x, t: F.cross_entropy(x, t, reduction=reduction),
                             (LOGITS, LABELS), "nll_loss_forward", placements))


@pytest.mark.parametrize("reduction, rule, lowering, out", [
    ("mean", "loss.nll.global_mean", "nll_mean", (REPLICATE, REPLICATE)),
    ("sum", "loss.nll", None, (PARTIAL, PARTIAL)),
    ("none", "loss.nll", None, (TOKENS, PARTIAL)),
])
def test_nll_over_split_tokens(reduction, rule, lowering, out):
    ss = _nll(reduction, [TOKENS, TOKENS])
    assert (ss[0].rule, ss[0].lowering, ss[0].output) == (rule, lowering, out)
    assert ss[0].inputs == (TOKENS, TOKENS)
    assert table(ss[1:]) == WHOLE          # the fallback: whole inputs


def test_labels_split_alone_bring_the_logits_to_their_tokens():
    ss = _nll("mean", [REPLICATE, TOKENS])
    assert ss[0].inputs == (TOKENS, TOKENS)
    ss = _nll("mean", [TOKENS, REPLICATE])
    assert ss[0].inputs == (TOKENS, TOKENS)


def test_nothing_split_is_whole():
    assert table(_nll("mean", [REPLICATE, REPLICATE])) == WHOLE


def test_a_2d_loss_maps_the_split_past_the_class_dim():
    # logits [B, V, S@sp] against labels [B, S@sp]
    x, t = torch.randn(2, 10, 16), torch.randint(0, 10, (2, 16))
    ctx = ctx_of(lambda x, t: F.nll_loss(x.unsqueeze(-1), t.unsqueeze(-1)), (x, t),
                 "nll_loss2d_forward", [Shard(2, 1, 16), REPLICATE])
    ss = strategies(ctx)
    assert ss[0].inputs == (Shard(2, 1, 16), Shard(1, 1, 16))
    ctx = ctx_of(lambda x, t: F.nll_loss(x.unsqueeze(-1), t.unsqueeze(-1)), (x, t),
                 "nll_loss2d_forward", [REPLICATE, Shard(1, 1, 16)])
    assert strategies(ctx)[0].inputs == (Shard(2, 1, 16), Shard(1, 1, 16))
    # a split of the classes: no token split for the labels to follow
    v = torch.randn(2, 16, 8)
    ctx = ctx_of(lambda x, t: F.nll_loss(x.unsqueeze(-1), t.unsqueeze(-1)),
                 (v, torch.randint(0, 16, (2, 8))), "nll_loss2d_forward",
                 [Shard(1, 1, 16), REPLICATE])
    assert table(strategies(ctx)) == WHOLE


@pytest.mark.parametrize("reduction, rule, lowering, out", [
    ("mean", "loss.global_mean", "loss_mean", PARTIAL),
    ("sum", "loss.sum", None, PARTIAL),
    ("none", "loss", None, TOKENS),
])
def test_elementwise_losses(reduction, rule, lowering, out):
    y = torch.randn(32, 10)
    ss = strategies(ctx_of(lambda a, b: F.mse_loss(a, b, reduction=reduction), (LOGITS, y),
                           "mse_loss", [TOKENS, REPLICATE]))
    assert (ss[0].rule, ss[0].lowering, ss[0].output) == (rule, lowering, out)
    assert ss[0].inputs == (TOKENS, TOKENS)
    assert table(ss[1:]) == [("loss", (R, R), R)]


def test_an_elementwise_loss_with_nothing_split_is_whole():
    ss = strategies(ctx_of(lambda a, b: F.huber_loss(a, b), (LOGITS, LOGITS * 2), "huber_loss"))
    assert table(ss) == [("loss", (R, R), R)]


def test_reduction_read_from_args_kwargs_or_default():
    def node(fn, *args):
        return ctx_of(fn, args, "mse_loss").node
    x = torch.randn(4)
    assert reduction_of(node(lambda a, b: F.mse_loss(a, b, reduction="sum"), x, x)) == 2
    assert reduction_of(node(lambda a, b: torch.ops.aten.mse_loss(a, b), x, x)) == 1
    assert reduction_of(node(lambda a, b: torch.ops.aten.mse_loss(a, b, reduction=0),
                             x, x)) == 0


def test_a_constraint_is_the_placement_it_names():
    x = torch.randn(2, 16, 8)
    ctx = ctx_of(lambda x: torch.ops.spdsl.constraint(x, "sp"), (x,), torch.ops.spdsl.constraint,
                 [REPLICATE])
    ctx.constraint = Shard(1, 1, 16)
    assert table(strategies(ctx)) == [("constraint", ("Shard(1)",), "Shard(1)")]
    ctx.constraint = None                          # names another axis: left as it comes
    ctx.placements = [Shard(2, 1, 8)]
    assert table(strategies(ctx)) == [("constraint", ("Shard(2)",), "Shard(2)")]
