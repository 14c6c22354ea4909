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


def test_any_class_transformers_wraps_is_token_wise():
    """Found by transformers' ``use_experts_implementation`` decorator, not by a list of class
    names: a family spdsl has never heard of is captured too. (``functools.wraps`` hides the
    decorator from the forward's ``__qualname__``; its code object still names it.)"""
    pytest.importorskip("transformers")
    from transformers.integrations import use_experts_implementation

    class NewFamilyExperts(LoopExperts):
        def __init__(self, config) -> None:
            super().__init__()

    assert "NewFamilyExperts" not in tokenwise._HF_NAMES
    assert tokenwise.marked(NewFamilyExperts(None)) is None
    wrapped = use_experts_implementation(NewFamilyExperts)
    assert tokenwise.marked(wrapped(None)) == tokenwise.Marked(1, None)


class GroupedExperts(nn.Module):
    """Experts as one ``torch._grouped_mm`` over tokens sorted by expert, groups sized by
    ``histc`` of the routing (Hugging Face's ``grouped_mm`` implementation, written out)."""

    def __init__(self, dim: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(experts, dim, dim) / dim ** 0.5)

    def forward(self, x, idx, weight):               # [T, H], [T, k], [T, k]
        k = idx.shape[-1]
        ids, perm = idx.reshape(-1).sort()
        counts = torch.histc(ids.float(), bins=self.w.shape[0], min=0, max=self.w.shape[0] - 1)
        offs = counts.cumsum(0, dtype=torch.int32)
        y = torch._grouped_mm(x[perm // k], self.w, offs=offs) * weight.reshape(-1)[perm, None]
        out = torch.empty_like(y)
        out[perm] = y
        return out.view(-1, k, x.shape[-1]).sum(1)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="no torch._grouped_mm")
def test_unmarked_grouped_mm_in_fp32_says_to_mark_the_module():
    """fp32 ``grouped_mm`` has no fake kernel: the trace stops with spdsl's error naming the
    fix, not PyTorch's ``Expected inputs of BF16 type``; marked, the same module plans."""
    torch.manual_seed(0)
    model = Model()
    model.moe.experts = GroupedExperts()
    with pytest.raises(spdsl.ShardingError, match=r"\[grouped_mm traced\]") as err:
        _plan(model)
    assert "f32[64,16], f32[4,16,16]" in str(err.value)
    assert "test_tokenwise.py" in err.value.where and "_grouped_mm" in err.value.where
    assert "spdsl.token_wise" in err.value.fix
    spdsl.token_wise(model.moe.experts)
    _check_token_wise(_plan(model))
