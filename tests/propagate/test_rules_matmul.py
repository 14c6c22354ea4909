"""The matmul rule (``spdsl.propagate.rules.matmul``) asked directly at SP 4: which factor of
``a[b,m,k] @ b[b,k,n]`` carries a split to the output, the Ulysses batch split of a score whose
two operands carry the sequence on their free dims, the partial sum of a split contraction and
its price, and a bias that follows the columns."""

from __future__ import annotations

import torch

from spdsl.propagate.placement import PARTIAL, REPLICATE, Shard
from tests.propagate._rule_ctx import ctx_of, strategies, table

R, P = repr(REPLICATE), repr(PARTIAL)


def test_rows_of_merged_batch_and_sequence_stay_split_inside():
    # [2, 16@sp, 8] -> [2x16@sp, 8]: the split is the inner factor of the merged rows
    ctx = ctx_of(lambda a, w: a.reshape(32, 8) @ w, (torch.randn(2, 16, 8), torch.randn(8, 8)),
                 "mm", [Shard(0, 2, 16), REPLICATE])
    got = table(strategies(ctx))
    assert got[0] == ("matmul.rows", ("Shard(0, outer=2)", R), "Shard(0, outer=2)")
    assert [g[0] for g in got] == ["matmul.rows", "matmul", "matmul.cols", "matmul.contract"]


def test_score_of_two_sequence_splits_goes_to_heads():
    # q [H, S@sp, d] @ k^T [H, d, S@sp]: neither rows nor columns, the heads (Ulysses)
    ctx = ctx_of(torch.bmm, (torch.randn(8, 16, 4), torch.randn(8, 4, 16)), "bmm",
                 [Shard(1, 1, 16), Shard(2, 1, 16)])
    got = table(strategies(ctx))
    assert got[0] == ("matmul.batch", ("Shard(0)", "Shard(0)"), "Shard(0)")
    assert {g[0] for g in got} == {"matmul.batch", "matmul", "matmul.contract"}


def test_one_free_split_keeps_rows_and_columns():
    ctx = ctx_of(torch.bmm, (torch.randn(8, 16, 4), torch.randn(8, 4, 16)), "bmm",
                 [Shard(1, 1, 16), REPLICATE])
    rules = [g[0] for g in table(strategies(ctx))]
    assert "matmul.rows" in rules and "matmul.cols" in rules


def test_split_contraction_is_a_partial_sum_priced_at_its_all_reduce():
    # x^T [8, 16@sp] @ x [16@sp, 8]: each rank sums its tokens; an 8x8 fp32 output (256 B)
    # is all-reduced later, 2 * 256 * 3/4 bytes at SP 4
    ctx = ctx_of(lambda a, b: a.t() @ b, (torch.randn(16, 8), torch.randn(16, 8)), "mm",
                 [Shard(1, 1, 16), Shard(0, 1, 16)])
    ss = strategies(ctx)
    contract = [s for s in ss if s.rule == "matmul.contract"]
    assert len(contract) == 1
    s = contract[0]
    assert (s.inputs, s.output) == ((Shard(1, 1, 16), Shard(0, 1, 16)), PARTIAL)
    assert s.extra_cost == 2 * 256 * 3 / 4
    assert all(t.extra_cost == 0 for t in ss if t is not s)


def test_a_partial_operand_stays_partial_through_the_product():
    ctx = ctx_of(torch.bmm, (torch.randn(8, 16, 4), torch.randn(8, 4, 16)), "bmm",
                 [PARTIAL, REPLICATE])
    got = table(strategies(ctx))
    assert ("matmul.partial", (P, R), P) in got
    ctx = ctx_of(torch.bmm, (torch.randn(8, 16, 4), torch.randn(8, 4, 16)), "bmm",
                 [REPLICATE, PARTIAL])
    assert ("matmul.partial", (R, P), P) in table(strategies(ctx))


def test_addmm_bias_follows_the_columns_and_never_goes_partial():
    ctx = ctx_of(torch.addmm, (torch.randn(12), torch.randn(16, 8), torch.randn(8, 12)),
                 "addmm", [REPLICATE, REPLICATE, Shard(1, 1, 12)])
    got = table(strategies(ctx))
    assert ("matmul.cols", ("Shard(0)", R, "Shard(1)"), "Shard(1)") in got
    assert ("matmul.rows", (R, "Shard(0)", R), "Shard(0)") in got
    assert not [g for g in got if g[2] == P]


def test_no_row_split_where_the_rows_do_not_divide():
    # 6 rows over 4 ranks, one atom: nothing to split evenly, so no rows strategy
    ctx = ctx_of(lambda a, w: a @ w, (torch.randn(6, 8), torch.randn(8, 8)), "mm")
    assert "matmul.rows" not in [g[0] for g in table(strategies(ctx))]
