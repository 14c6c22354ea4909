"""``plan.explain``: the chain of rules behind a placement."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spdsl
from spdsl import P


def test_attention_placement_starts_at_the_input_spec(tiny_plan):
    att = [v for v in tiny_plan.values if v.op == "spdsl.attention.default"][1]
    e = tiny_plan.explain(att.name)
    assert e.target is att and e.steps[-1] is att
    assert e.root.op == "input" and e.root.origin.startswith("in_specs[")
    rules = e.rules
    assert rules.index("embedding") < rules.index("matmul.rows") < rules.index("attention.ulysses")
    # the RoPE table meets the split q: it is sliced locally, and the step says so
    assert any(m[1] == "Replicate()" and m[2] == "Shard(0)" for v in e.steps for m in v.moves)
    text = str(e)
    assert text.startswith(f"{att.name}: f32[2,4,64@sp,16]  Shard(2)  (layers.1.attention")
    assert "because: " in text and "by in_specs[" in text
    assert text.endswith("issues all_to_all (ulysses) of f32[2,4,64@sp,16]")
    assert [c.purpose for c in e.collectives] == ["ulysses", "ulysses"]


def test_long_chains_fold(deep_plan):
    text = str(deep_plan.explain("layers.5.attention"))
    assert "more steps keep Shard(1) (pointwise x" in text
    assert len(text.splitlines()) < 30


def test_explain_accepts_names_nodes_values_and_module_paths(tiny_plan):
    v = tiny_plan.value("arange")
    assert tiny_plan.explain(v).target is v
    assert tiny_plan.explain(type("N", (), {"name": "arange"})()).target is v
    e = tiny_plan.explain("arange")
    assert e.steps == (v,) and "made Replicate() by rule 'factory'" in str(e)
    assert tiny_plan.explain("layers.0.feed_forward.w2").target.module == \
        "layers.0.feed_forward.w2"
    with pytest.raises(KeyError, match="no value or module 'nope'"):
        tiny_plan.explain("nope")


class _Pinned(nn.Module):
    def forward(self, x):
        h = spdsl.with_sharding_constraint(x * 2, P(None, None, "sp"))
        return (h + 1).sum()


def test_a_constraint_ends_the_chain():
    plan = spdsl.plan(spdsl.sp_shard(seq=2)(_Pinned()), torch.randn(2, 8, 4))
    add = next(v for v in plan.values if v.op == "aten.add.Tensor")
    e = plan.explain(add.name)
    assert e.root.origin == "constraint" and e.root.placement == "Shard(2)"
    text = str(e)
    assert "because: with_sharding_constraint at " in text and "test_explain.py:" in text
    assert "moves mul Shard(1) -> Shard(2)" in text      # the all-to-all it asked for
