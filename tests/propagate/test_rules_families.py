"""Each rule family on its own: the placement a value gets from its inputs', the
redistributions its rule asks for, and the collectives that follow (planned at SP 4 on fake
tensors, one op at a time). The index/gather family: ``test_rules_index.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spdsl

X = torch.randn(2, 16, 8)          # [B, S@sp, D]
W = torch.randn(8, 8)
IDS = torch.randint(0, 8, (2, 16))


def _last(fn, op: str):
    """The plan, and the last value computed by ``op`` (``aten.<op>``)."""
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(fn), X)
    vals = [v for v in plan.values if v.op.removeprefix("aten.").split(".")[0] == op]
    assert vals, [v.op for v in plan.values]
    return plan, vals[-1]


def _kinds(plan) -> list[tuple[str, str]]:
    """The rules' collectives: not the same-inputs check every call runs first
    (tests/annotate/test_same_inputs.py)."""
    return [(c.kind, c.purpose) for c in plan.collectives if c.purpose != "check"]


# family, function, op, typed output, rule, moves of its inputs, collectives
CASES = [
    ("pointwise", lambda x: x + x.exp(), "add", "f32[2,16@sp,8]", "pointwise", (), []),
    ("pointwise broadcast", lambda x: x * W[0], "mul", "f32[2,16@sp,8]", "pointwise", (), []),
    ("pointwise, a replicated operand split for free",
     lambda x: x + torch.arange(16).view(1, 16, 1), "add", "f32[2,16@sp,8]", "pointwise",
     (("Replicate()", "Shard(1)"),), []),
    ("view splits a dim", lambda x: x.view(2, 16, 2, 4), "view", "f32[2,16@sp,2,4]", "view",
     (), []),
    ("view merges batch and sequence", lambda x: (x.reshape(32, 8) @ W).view(2, 16, 8), "mm",
     "f32[2x16@sp,8]", "matmul.rows", (), []),
    ("permute", lambda x: x.transpose(1, 2).contiguous(), "transpose", "f32[2,8,16@sp]",
     "permute", (), []),
    ("matmul over features", lambda x: x @ W, "mm", "f32[2x16@sp,8]", "matmul.rows", (), []),
    ("matmul contracting the sequence", lambda x: x.transpose(1, 2) @ x, "bmm",
     "f32[2,8,8]{sum@sp}", "matmul.contract", (), [("all_reduce", "output")]),
    ("reduction over features", lambda x: x.sum(-1), "sum", "f32[2,16@sp]", "reduce", (), []),
    ("reduction over the sequence", lambda x: x.sum(1), "sum", "f32[2,8]{sum@sp}",
     "reduce.partial", (), [("all_reduce", "output")]),
    ("mean over the sequence", lambda x: x.mean(1), "mean", "f32[2,8]{sum@sp}",
     "reduce.partial", (), [("all_reduce", "output")]),
    ("max of every element gathers the sequence", lambda x: x.max() * x[:, :1], "max", "f32[]",
     "reduce", (("Shard(1)", "Replicate()"),), [("all_gather", "reshard")]),
    ("min of positions split over the sequence (Hugging Face's packed-row check)",
     lambda x: x[..., 0].long().min() + x[..., 0].long(), "min", "i64[]", "reduce",
     (("Shard(1)", "Replicate()"),), [("all_gather", "reshard")]),
    ("softmax over features", lambda x: x.softmax(-1), "_softmax", "f32[2,16@sp,8]",
     "along_dim", (), []),
    ("softmax over the sequence gathers it", lambda x: x.softmax(1), "_softmax",
     "f32[2,16,8]", "along_dim", (("Shard(1)", "Replicate()"),),
     [("all_gather", "reshard")]),
    ("factory", lambda x: x[..., :1] * torch.ones(16, 16).tril().sum(-1).view(1, 16, 1),
     "mul", "f32[2,16@sp,1]", "pointwise", (("Replicate()", "Shard(1)"),), []),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_rule_family(case):
    _name, fn, op, typed, rule, moves, collectives = case
    plan, v = _last(fn, op)
    assert v.typed == typed
    assert v.origin == rule
    assert tuple((a, b) for _, a, b in v.moves) == moves
    assert _kinds(plan) == collectives


def test_loss_family_global_mean():
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(
        lambda x: F.cross_entropy(x.reshape(32, 8), IDS.reshape(32))), X)
    v = next(v for v in plan.values if v.op.startswith("aten.nll_loss_forward"))
    assert v.origin == "loss.nll.global_mean"
    assert _kinds(plan) == [("all_reduce", "loss")]
    c = plan.collectives[0]
    assert (c.bytes, c.values) == (8, ("f32[2]{sum@sp}",))     # (sum, count) in one


def test_attention_family_ulysses():
    x = torch.randn(2, 16, 4, 8)                        # [B, S@sp, H, D]

    def attend(t):
        t = t.transpose(1, 2)
        return F.scaled_dot_product_attention(t, t, t, is_causal=True)
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(attend), x)
    v = next(v for v in plan.values if v.op == "spdsl.attention.default")
    assert (v.typed, v.origin) == ("f32[2,4,16@sp,8]", "attention.ulysses")
    assert _kinds(plan) == [("all_to_all", "ulysses")] * 2
