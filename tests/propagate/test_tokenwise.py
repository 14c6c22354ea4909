"""Token-wise modules (``spdsl.propagate.tokenwise``): a plain PyTorch mixture of experts whose
experts loop in Python over the experts that received tokens. Unmarked, it runs in segments
split at each read of the routing (``spdsl.annotate.breaks``), the plan naming
``spdsl.token_wise`` as the way without breaks; marked (instance or class), each
call is one ``token_wise`` node that keeps the sequence split, with no collective inside the
block. Planned on fake tensors, one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spdsl
from spdsl.propagate import tokenwise


class LoopExperts(nn.Module):
    """Experts that run only where tokens were routed: Python reads the routing."""

    def __init__(self, dim: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(experts, dim, dim) / dim ** 0.5)

    def forward(self, x, idx, weight):               # [T, H], [T, k], [T, k]
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            tok, slot = torch.where(idx == e)
            out = out.index_add(0, tok, (x[tok] @ self.w[e]) * weight[tok, slot, None])
        return out


class Moe(nn.Module):
    def __init__(self, dim: int = 16, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = LoopExperts(dim, experts)
        self.k = k

    def forward(self, h):                            # [B, S, H]
        b, s, d = h.shape
        x = h.reshape(b * s, d)
        probs = F.softmax(self.gate(x), dim=-1)
        weight, idx = probs.topk(self.k, dim=-1)
        return h + self.experts(x, idx, weight).reshape(b, s, d)


class Model(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.moe = Moe(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, labels):
        logits = self.head(self.moe(self.embed(ids)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _plan(model):
    ids = torch.randint(0, 32, (2, 16))
    return spdsl.plan(spdsl.sp_shard(seq=4)(model), ids, ids)


def _check_token_wise(plan):
    nodes = [v for v in plan.values if v.origin == "token_wise" and v.op != "getitem"]
    assert [v.module for v in nodes] == ["moe.experts"]
    assert nodes[0].typed == "(f32[2x16@sp,16])", nodes[0].typed
    moved = [c for c in plan.collectives if c.module.startswith("moe") and
             c.purpose != "gradient"]
    assert moved == [], moved          # routed and computed on each rank's own tokens
    assert any("moe.experts.w" in c.carries for c in plan.collectives
               if c.purpose == "gradient"), "the experts' gradient is not reduced"


def test_unmarked_loop_runs_in_segments_naming_token_wise():
    torch.manual_seed(0)
    plan = _plan(Model())            # reads the routing in Python: segments, split at reads
    assert plan.breaks and all(b.module == "moe.experts" for b in plan.breaks), plan
    assert any(b.whole for b in plan.breaks)           # the whole sequence on every rank
    assert "spdsl.token_wise(model.get_submodule('moe.experts'))" in str(plan)


def test_marked_instance_runs_token_wise():
    torch.manual_seed(0)
    model = Model()
    assert spdsl.token_wise(model.moe.experts) is model.moe.experts
    _check_token_wise(_plan(model))


def test_marked_class_runs_token_wise():
    torch.manual_seed(0)
    spdsl.token_wise(LoopExperts)
    try:
        _check_token_wise(_plan(Model()))
    finally:
        del tokenwise._MARKED_CLASSES[LoopExperts]


def test_block_over_batch_and_sequence_with_token_dims_2():
    """A whole block on ``[B, S, H]`` marked with ``token_dims=2``: split on the sequence in
    and out."""
    torch.manual_seed(0)
    model = Model()
    spdsl.token_wise(model.moe, token_dims=2)
    plan = _plan(model)
    node = next(v for v in plan.values if v.origin == "token_wise" and v.op != "getitem")
    assert node.module == "moe" and node.typed == "(f32[2,16@sp,16])", node


def test_marking_something_else_is_an_error():
    with pytest.raises(spdsl.ShardingError, match="token-wise module"):
        spdsl.token_wise(lambda x: x)
    with pytest.raises(spdsl.ShardingError, match="token_dims"):
        spdsl.token_wise(nn.Linear(2, 2), token_dims=0)
