"""Counting rules (``spdsl.propagate.rules.counts``), planned at SP 4 on fake tensors. The
counts' values against single-device PyTorch at SP 2 and 4: the load-balancing losses of
``tests/hf/test_moe_parity.py`` on transformers 5.23, which count experts with ``histc``."""

from __future__ import annotations

import torch

import spdsl

X = torch.randn(2, 16, 8)          # [B, S@sp, E] router logits


def _plan(fn):
    return spdsl.plan(spdsl.sp_shard(seq=4)(fn), X)


def _histc(plan):
    vals = [v for v in plan.values if v.op == "aten.histc.default"]
    assert len(vals) == 1, [v.op for v in plan.values]
    return vals[0]


def _balance(x: torch.Tensor, **bounds) -> torch.Tensor:
    """Hugging Face's load-balancing loss on one layer: counts of each token's top-2 experts
    times the mean router probability of each expert."""
    probs = x.reshape(-1, 8).softmax(-1)                      # [B*S, E]
    _, top = probs.topk(2, dim=-1)
    counts = torch.histc(top.reshape(-1).float(), bins=8, **bounds)
    return (counts / probs.shape[0] * probs.mean(0)).sum() * 8


def test_counts_over_split_tokens_are_partial_sums():
    plan = _plan(lambda x: _balance(x, min=0, max=8))
    h = _histc(plan)
    assert h.typed == "f32[8]{sum@sp}"
    assert h.origin == "count.partial"
    assert h.moves == ()
    # nothing of the tokens gathered: the counts and the probability sums are all-reduced
    assert [c.kind for c in plan.collectives if c.kind == "all_gather"] == []
    assert any(c.kind == "all_reduce" for c in plan.collectives)


def test_counts_split_on_a_later_dim_are_partial_sums_too():
    def f(x):
        top = x.argmax(0).float()                             # [S@sp, E]
        return torch.histc(top, bins=2, min=0, max=2).sum()

    h = _histc(_plan(f))
    assert (h.typed, h.origin) == ("f32[2]{sum@sp}", "count.partial")


def test_bounds_from_the_data_gather_the_input():
    # min == max: PyTorch takes the range from the whole input, which no rank holds alone
    plan = _plan(lambda x: _balance(x))
    h = _histc(plan)
    assert h.typed == "f32[8]"
    assert h.origin == "count"
    assert h.moves and h.moves[0][2] == "Replicate()"
    assert [c.values for c in plan.collectives if c.kind == "all_gather"] == [
        ("f32[2x16@spx2]",)]
