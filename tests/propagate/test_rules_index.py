"""Index and gather rules (``spdsl.propagate.rules.index``), planned on fake tensors."""

from __future__ import annotations

import torch

import spdsl


def _plan(fn, *args):
    return spdsl.plan(spdsl.sp_shard(seq=4)(fn), *args)


def _typed(plan, op):
    return [v.typed for v in plan.values if v.op == op]


def test_padding_mask_indexed_by_key_positions_is_gathered_once():
    def f(mask, x):
        b = torch.arange(mask.shape[0])[:, None, None, None]
        kv = torch.arange(mask.shape[1])[None, None, None, :]
        m4 = mask.bool()[b, kv]                          # [B, 1, 1, S], Hugging Face's way
        return (x.unsqueeze(1).unsqueeze(-1) * m4.float()).sum()

    mask, x = torch.ones(2, 16, dtype=torch.long), torch.randn(2, 16)
    plan = _plan(f, mask, x)
    assert _typed(plan, "aten.index.Tensor") == ["bool[2,1,1,16]"]
    gathers = [c for c in plan.collectives if c.kind == "all_gather"]
    assert [c.values for c in gathers] == [("bool[2,16@sp]",)]


def test_table_lookup_follows_split_positions():
    table = torch.randn(64, 8)

    def f(pos, x):
        return (table[pos] * x.unsqueeze(-1)).sum()      # [B, S, 8], split like pos

    pos, x = torch.zeros(2, 16, dtype=torch.long), torch.randn(2, 16)
    plan = _plan(f, pos, x)
    assert _typed(plan, "aten.index.Tensor") == ["f32[2,16@sp,8]"]
    assert [c for c in plan.collectives if c.kind == "all_gather"] == []


def test_split_dim_not_indexed_carries_through():
    def f(x):
        rows = torch.tensor([0, 2])
        return x[rows].sum(0).sum()                      # index dim 0, split dim 1

    plan = _plan(f, torch.randn(4, 16))
    assert _typed(plan, "aten.index.Tensor") == ["f32[2,16@sp]"]
    assert [c for c in plan.collectives if c.kind == "all_gather"] == []


def test_gather_along_other_dim_and_along_split_index():
    def f(x, idx):
        return torch.gather(x, 2, idx).sum()             # both split on dim 1

    x, idx = torch.randn(2, 16, 8), torch.zeros(2, 16, 3, dtype=torch.long)
    plan = _plan(f, x, idx)
    assert _typed(plan, "aten.gather.default") == ["f32[2,16@sp,3]"]

    table = torch.randn(2, 64)

    def g(pos):
        return torch.gather(table, 1, pos).sum()         # rows looked up by split positions

    plan = _plan(g, torch.zeros(2, 16, dtype=torch.long))
    assert _typed(plan, "aten.gather.default") == ["f32[2,16@sp]"]
    assert [c for c in plan.collectives if c.kind == "all_gather"] == []
