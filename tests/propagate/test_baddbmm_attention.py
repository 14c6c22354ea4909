"""The ``baddbmm`` attention form (``spdsl.propagate.eager_attention.fuse_biased_attention``):
scores begun by ``baddbmm(bias, q, k^T, beta=, alpha=)`` on ``[B*H, S, D]`` with a per-head
ALiBi bias, a mask added after, a float32 softmax and a ``bmm`` with v (BLOOM's attention)
become one attention node per layer whose mask is a function of per-token and per-head
values; the plan moves q/k/v and the output by all-to-all at the analytic floor. A
``baddbmm`` that is not such attention keeps its ops. Exactness over ranks: BLOOM in
``tests/hf/test_hf_parity.py``."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spdsl
from spdsl.propagate.forms import FORM
from spdsl.propagate.trace import trace
from tests._util import assert_close

HEADS, DIM, SEQ = 4, 32, 16
ATTENTION = (torch.ops.spdsl.attention.default, torch.ops.spdsl.attention_fn.default)


def _slopes(h: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)])


class _AlibiBlock(nn.Module):
    """BLOOM's attention, written out: fused qkv, an ALiBi bias ``[B*H, 1, S]`` from the
    padding mask's running count, ``baddbmm`` with ``beta``/``alpha``, an additive causal and
    padding mask after, float32 softmax, ``bmm`` with v."""

    def __init__(self, beta: float = 1.0, learned_bias: bool = False,
                 softmax_dim: int = -1) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.beta, self.softmax_dim = beta, softmax_dim
        self.bias = nn.Parameter(torch.randn(HEADS, 1, SEQ)) if learned_bias else None

    def forward(self, x, pad):
        B, S, _ = x.shape
        d = DIM // HEADS
        q, k, v = self.qkv(x).view(B, S, HEADS, 3, d).unbind(3)
        q, k, v = (t.transpose(1, 2).reshape(B * HEADS, S, d) for t in (q, k, v))
        if self.bias is None:
            pos = ((pad.cumsum(-1) - 1) * pad)[:, None, :]                 # [B, 1, S]
            alibi = (_slopes(HEADS)[:, None] * pos).reshape(B * HEADS, 1, S)
        else:
            alibi = self.bias.repeat(B, 1, 1)
        scores = alibi.baddbmm(q, k.transpose(-1, -2), beta=self.beta, alpha=1 / math.sqrt(d))
        idx = torch.arange(S)
        keep = (idx.view(1, 1, 1, S) <= idx.view(1, 1, S, 1)) & pad.bool()[:, None, None, :]
        mask = torch.where(keep, 0.0, torch.finfo(torch.float32).min)      # [B, 1, S, S]
        w = F.softmax(scores.view(B, HEADS, S, S) + mask, dim=self.softmax_dim,
                      dtype=torch.float32)
        o = torch.bmm(w.view(B * HEADS, S, S), v).view(B, HEADS, S, d)
        return self.out(o.transpose(1, 2).reshape(B, S, DIM)).pow(2).mean()


def _inputs():
    torch.manual_seed(1)
    x = torch.randn(2, SEQ, DIM)
    pad = torch.ones(2, SEQ, dtype=torch.long)
    pad[1, :5] = 0                      # left padding: every key of a query masked
    return x, pad


def _attention_nodes(model, *args):
    gm = trace(model, args, {}).graph
    return [n for n in gm.graph.nodes if n.target in ATTENTION]


def _one_rank_step(model, *args):
    """Loss and every parameter gradient of ``sp_shard(seq=1)`` (the traced, rewritten and
    lowered step on one rank) beside the model's own on a copy."""
    ref = copy.deepcopy(model)
    want = ref(*args)
    want.backward()
    loss = spdsl.sp_shard(seq=1)(model)(*args)
    loss.backward()
    assert_close(loss, want, rtol=1e-5, name="loss")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6 * float(q.grad.abs().max()),
                     name=name)


@pytest.mark.parametrize("beta", [1.0, 0.5, 0.0])
def test_alibi_attention_is_one_node_computing_the_ops(beta, one_rank):
    """beta 0: the bias is not read (GPT-2's ``reorder_and_upcast_attn`` passes an empty
    tensor)."""
    torch.manual_seed(0)
    model = _AlibiBlock(beta=beta)
    nodes = _attention_nodes(model, *_inputs())
    assert len(nodes) == 1 and nodes[0].meta[FORM] == "baddbmm"
    # the bias went to the mask program as a per-head leaf [B, H, 1, S]
    assert nodes[0].target is torch.ops.spdsl.attention_fn.default
    assert [tuple(a.meta["val"].shape) for a in nodes[0].args[3]
            if a.meta["val"].dim() == 4 and a.meta["val"].shape[1] == HEADS] == \
        ([(2, HEADS, 1, SEQ)] if beta else [])
    _one_rank_step(model, *_inputs())


def test_plan_of_alibi_attention_is_at_the_floor():
    torch.manual_seed(0)
    model = _AlibiBlock()
    x, pad = _inputs()
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(model), x, pad)
    assert [a.kind for a in plan.attention] == ["baddbmm"]
    site = plan.attention[0]
    assert site.mask.startswith("function of"), site.mask
    a2a = [c for c in plan.collectives if c.kind == "all_to_all"]
    assert [c.purpose for c in a2a] == ["ulysses", "ulysses"], plan.collectives
    assert sum(c.bytes for c in a2a) == site.floor
    assert sum(c.bytes_bwd for c in a2a) == site.floor
    assert not [v.typed for v in plan.values if f"{SEQ},{SEQ}]" in v.typed or
                f"{SEQ}@sp,{SEQ}]" in v.typed], "a value of size S x S"


def _collectives(plan) -> list:
    return [(c.kind, c.purpose, c.bytes, c.bytes_bwd) for c in plan.collectives]


class _NotAttention(nn.Module):
    """``baddbmm`` as a batched affine map (a bias plus x @ w, scaled), then a softmax over
    its last dim: no ``bmm`` with values after it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, DIM, DIM))
        self.b = nn.Parameter(torch.randn(2, 1, DIM))

    def forward(self, x, pad):
        y = self.b.baddbmm(x, self.w, beta=0.5, alpha=0.25)
        return F.softmax(y, dim=-1).pow(2).mean() + pad.sum() * 0


_NOT_ALIBI = pytest.mark.parametrize("model", [
    _NotAttention, lambda: _AlibiBlock(learned_bias=True), lambda: _AlibiBlock(softmax_dim=-2)],
    ids=["affine", "learned_bias", "softmax_over_queries"])


@_NOT_ALIBI
def test_baddbmm_that_is_not_alibi_attention_keeps_its_ops(model, monkeypatch):
    """An affine ``baddbmm``, a bias that needs a gradient (a mask carries none), a softmax
    over the queries: no attention node, and the plan is the one the ops get with the
    attention passes off."""
    torch.manual_seed(0)
    model = model()
    x, pad = _inputs()
    assert _attention_nodes(model, x, pad) == []
    on = spdsl.plan(spdsl.sp_shard(seq=4)(model), x, pad)
    monkeypatch.setenv("SPDSL_FUSE_EAGER_ATTENTION", "0")
    off = spdsl.plan(spdsl.sp_shard(seq=4)(model), x, pad)
    assert not on.attention and _collectives(on) == _collectives(off)
    assert _collectives(on)


@_NOT_ALIBI
def test_baddbmm_left_as_ops_computes_them(model, one_rank):
    torch.manual_seed(0)
    _one_rank_step(model(), *_inputs())
