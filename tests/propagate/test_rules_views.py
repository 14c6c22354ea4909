"""The view and data-movement rules (``spdsl.propagate.rules.views``) asked directly at SP 4:
the split follows its factor through view, expand, permute, transpose, (un)squeeze, cat, stack
and split; a slice of the split dim re-chunks it, priced as its halo; one index of the split dim
is its owner's partial sum; triangles, dropout, embedding and index_select keep or drop it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spdsl.propagate.placement import PARTIAL, REPLICATE, Shard
from tests.propagate._rule_ctx import ctx_of, strategies, table

X = torch.randn(2, 16, 8)            # [B, S@sp, D]
SEQ = Shard(1, 1, 16)
R, P = repr(REPLICATE), repr(PARTIAL)


def _dropout(x):
    return torch.ops.aten.native_dropout(x, 0.1, True)[0]


def _rules(fn, op, args=(X,), placements=(SEQ,), **kw):
    return table(strategies(ctx_of(fn, args, op, placements, **kw)))


def test_view_merging_batch_and_sequence_keeps_the_split_inside():
    got = _rules(lambda x: x.view(32, 8), "view")
    assert got == [("view", ("Shard(1)",), "Shard(0, outer=2)"), ("view", (R,), R)]


def test_view_that_cuts_the_split_factor_unevenly_offers_only_whole():
    # [2, 6, 8] -> [12, 8] at SP 4: 6 tokens do not divide, nor does the merged dim
    got = _rules(lambda x: x.reshape(2, 3, 16), "view", (torch.randn(2, 6, 8),),
                 (Shard(1, 1, 6),))
    assert got == [("view", (R,), R)]


def test_view_of_a_partial_sum_stays_partial():
    assert _rules(lambda x: x.view(32, 8), "view", placements=(PARTIAL,))[0] == \
        ("view", (P,), P)


def test_expand_moves_the_split_by_the_dims_added():
    got = _rules(lambda x: x.expand(3, 2, 16, 8), "expand")
    assert got[0] == ("expand", ("Shard(1)",), "Shard(2)")


def test_dim_maps():
    assert _rules(lambda x: x.permute(2, 0, 1), "permute")[0][2] == "Shard(2)"
    assert _rules(lambda x: x.transpose(0, 1), "transpose")[0][2] == "Shard(0)"
    assert _rules(lambda x: x.transpose(0, 2), "transpose")[0][2] == "Shard(1)"
    assert _rules(lambda x: x.unsqueeze(1), "unsqueeze")[0][2] == "Shard(2)"
    assert _rules(lambda x: x.unsqueeze(-1), "unsqueeze")[0][2] == "Shard(1)"
    x = torch.randn(1, 16, 1, 8)
    assert _rules(lambda x: x.squeeze(), "squeeze", (x,))[0][2] == "Shard(0)"
    assert _rules(lambda x: x.squeeze(2), "squeeze", (x,))[0][2] == "Shard(1)"
    # t() of a 2-d value swaps the dims
    assert _rules(lambda x: x.t(), "t", (torch.randn(16, 8),), (Shard(0, 1, 16),))[0][2] == \
        "Shard(1)"


def test_a_shifted_slice_of_the_sequence_is_a_window_priced_as_its_halo():
    # x[:, 1:] of 16 tokens over 4 ranks: the 15 left re-chunked as [1,5) [5,9) [9,13)
    # [13,16), so ranks 1-3 each send their first token on: one row of 2 x 8 fp32 (64 B)
    ss = strategies(ctx_of(lambda x: x[:, 1:], (X,), "slice", [SEQ]))
    assert [(s.rule, s.lowering, s.output) for s in ss] == [
        ("slice.window", "slice_window", Shard(1, 1, 15)), ("slice", None, REPLICATE)]
    assert ss[0].extra_cost == 64
    trim = strategies(ctx_of(lambda x: x[:, :13], (X,), "slice", [SEQ]))
    assert trim[0].extra_cost == 0          # chunks of 4 again: every rank holds its rows


def test_slices_of_other_dims_keep_the_split_and_strided_ones_gather():
    assert _rules(lambda x: x[..., 2:], "slice") == [("slice", ("Shard(1)",), "Shard(1)")]
    assert _rules(lambda x: x[:, ::2], "slice") == [("slice", (R,), R)]
    assert _rules(lambda x: x[..., 2:], "slice", placements=(PARTIAL,)) == [
        ("slice", (P,), P)]


def test_select_of_one_position_is_its_owners_partial_sum():
    assert _rules(lambda x: x[:, 3], "select") == [("select.owner", ("Shard(1)",), P)]
    assert _rules(lambda x: x[0], "select") == [("permute", ("Shard(1)",), "Shard(0)")]
    merged = (Shard(0, 2, 16),)
    assert _rules(lambda x: x[5], "select", (torch.randn(32, 8),), merged) == [
        ("select", (R,), R)]


def test_cat_keeps_a_split_off_its_dim_and_passes_an_empty_cache():
    y = X * 2
    assert _rules(lambda a, b: torch.cat([a, b], -1), "cat", (X, y), (SEQ, SEQ))[0] == \
        ("cat", ("Shard(1)", "Shard(1)"), "Shard(1)")
    along = _rules(lambda a, b: torch.cat([a, b], 1), "cat", (X, y), (SEQ, SEQ))
    assert along == [("cat", (R, R), R)]
    # an empty 1-d operand (a key/value cache before its first update) is skipped, whatever
    # the dim
    got = _rules(lambda a, b: torch.cat([a, b], 1), "cat", (torch.empty(0), X),
                 (REPLICATE, SEQ))
    assert ("cat", (R, "Shard(1)"), "Shard(1)") in got


def test_stack_and_split():
    y = X * 2
    assert _rules(lambda a, b: torch.stack([a, b], 1), "stack", (X, y), (SEQ, SEQ))[0][2] == \
        "Shard(2)"
    assert _rules(lambda a, b: torch.stack([a, b], 2), "stack", (X, y), (SEQ, SEQ))[0][2] == \
        "Shard(1)"
    assert _rules(lambda x: x.split(4, -1), "split")[0][2] == ("Shard(1)",) * 2
    assert _rules(lambda x: x.split(4, 1), "split")[0][2] == (R,) * 4
    assert _rules(lambda x: x.unbind(0), "unbind")[0][2] == ("Shard(0)",) * 2


def test_triangle_dropout_embedding_index_select():
    scores = torch.randn(4, 16, 16)
    assert _rules(lambda s: s.tril(), "tril", (scores,), (Shard(0, 1, 4),))[0][2] == "Shard(0)"
    assert _rules(lambda s: s.tril(), "tril", (scores,), (Shard(1, 1, 16),))[0][2] == R
    assert _rules(_dropout, "native_dropout")[0][2] == ("Shard(1)",) * 2
    assert _rules(_dropout, "native_dropout", placements=(PARTIAL,))[0] == \
        ("dropout", (R,), (R, R))                   # a mask on shares of a sum is wrong
    ids = torch.randint(0, 10, (2, 16))
    assert _rules(lambda w, i: F.embedding(i, w), "embedding", (torch.randn(10, 8), ids),
                  (REPLICATE, SEQ))[0] == ("embedding", (R, "Shard(1)"), "Shard(1)")
    idx = torch.tensor([0, 2])
    assert _rules(lambda x, i: x.index_select(2, i), "index_select", (X, idx),
                  (SEQ, REPLICATE))[0] == ("index_select", ("Shard(1)", R), "Shard(1)")
    assert _rules(lambda x, i: x.index_select(1, i), "index_select", (X, idx),
                  (SEQ, REPLICATE))[0] == ("index_select", (R, R), R)
