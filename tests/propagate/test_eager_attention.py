"""Written-out attention recognised as attention (``spdsl.propagate.eager_attention``): the
traced graph holds one ``spdsl.attention`` node per attention and computes what the ops did;
the plan moves q/k/v and the output by all-to-all at the analytic floor."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spdsl
from spdsl.propagate.trace import trace
from tests._util import assert_close


def _written_out(q, k, v, mask):
    """Hugging Face's eager attention: repeat_kv, scaled scores, additive mask, float32
    softmax, dropout p=0, weights @ v."""
    n_rep = q.shape[1] // k.shape[1]
    B, H, S, D = k.shape
    k = k[:, :, None].expand(B, H, n_rep, S, D).reshape(B, H * n_rep, S, D)
    v = v[:, :, None].expand(B, H, n_rep, S, D).reshape(B, H * n_rep, S, D)
    w = torch.matmul(q, k.transpose(2, 3)) * (1 / math.sqrt(D)) + mask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    w = F.dropout(w, p=0.0, training=True)
    return torch.matmul(w, v).transpose(1, 2)


class _Block(nn.Module):
    def __init__(self, hq: int = 4, hkv: int = 2, d: int = 8) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = hq, hkv, d
        self.q = nn.Linear(32, hq * d)
        self.kv = nn.Linear(32, 2 * hkv * d)

    def forward(self, x, mask):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.hq, self.d).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2, self.hkv, self.d).permute(2, 0, 3, 1, 4)
        return _written_out(q, k, v, mask).sum()


def _attention_nodes(fn, *args):
    gm = trace(fn, args, {}).graph
    # spdsl.attention, or attention_fn where its mask went to the blockwise kernel (masks.py)
    return gm, [n for n in gm.graph.nodes if n.target in (
        torch.ops.spdsl.attention.default, torch.ops.spdsl.attention_fn.default)]


def _scale(node):
    return node.args[7 if node.target is torch.ops.spdsl.attention_fn.default else 6]


def _run_traced(fn, *args):
    t = trace(fn, args, {})
    leaves = [a for a in args if isinstance(a, torch.Tensor)]
    return t.graph(*t.state, *leaves)[0]


@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_fused_graph_computes_the_written_out_attention(hkv):
    torch.manual_seed(0)
    block = _Block(hkv=hkv)
    x = torch.randn(2, 16, 32)
    mask = torch.zeros(2, 1, 16, 16).masked_fill(torch.ones(16, 16).triu(1).bool(), -1e9)
    _, nodes = _attention_nodes(block, x, mask)
    assert len(nodes) == 1
    _q, k = (a.meta["val"] for a in nodes[0].args[:2])
    assert k.shape[1] == hkv          # kv heads cross unrepeated
    assert _scale(nodes[0]) == pytest.approx(1 / math.sqrt(8))
    assert_close(_run_traced(block, x, mask), block(x, mask), rtol=1e-5, name="loss")


class _FilledKeys(_Block):
    """Keys in the manner of DeepSeek-V2's: a fresh buffer filled by ``copy_`` into two slices
    of the head dim (a per-head part and a part shared by every head), read by written-out
    attention. Zeros, not ``new_empty``: an empty one becomes a ``cat`` before this pass
    (``spdsl.propagate.fills``), and the writes are what is checked here."""

    def forward(self, x, mask):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.hq, self.d).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2, self.hkv, self.d).permute(2, 0, 3, 1, 4)
        keys = k.new_zeros(B, self.hkv, S, self.d)
        keys[..., : self.d // 2].copy_(k[..., : self.d // 2])
        keys[..., self.d // 2:].copy_(k[:, :1, :, self.d // 2:].expand(-1, self.hkv, -1, -1))
        return _written_out(q, keys, v, mask).sum()


def test_keys_written_into_a_temporary_are_kept():
    """The copies into the temporary are the keys' values: the written-out attention's
    leftovers are swept, the writes that attention reads are not (before, they went, and the
    keys were uninitialised memory: NaN losses on DeepSeek-V2 in eager attention)."""
    torch.manual_seed(0)
    block = _FilledKeys(hkv=4)
    x = torch.randn(2, 16, 32)
    mask = torch.zeros(2, 1, 16, 16).masked_fill(torch.ones(16, 16).triu(1).bool(), -1e9)
    gm, nodes = _attention_nodes(block, x, mask)
    assert len(nodes) == 1
    assert sum(n.target is torch.ops.aten.copy_.default for n in gm.graph.nodes) == 2
    assert_close(_run_traced(block, x, mask), block(x, mask), rtol=1e-5, name="loss")


class _Capped(_Block):
    """Gemma 2's eager attention: scaled scores capped as ``c * tanh(s / c)``, then the mask."""

    def forward(self, x, mask):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.hq, self.d).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2, self.hkv, self.d).permute(2, 0, 3, 1, 4)
        k = k.repeat_interleave(self.hq // self.hkv, dim=1)
        v = v.repeat_interleave(self.hq // self.hkv, dim=1)
        w = torch.matmul(q, k.transpose(2, 3)) * (1 / math.sqrt(self.d))
        w = torch.tanh(w / 0.5) * 0.5                  # a cap low enough to bite
        w = F.softmax(w + mask, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(w, v).transpose(1, 2).sum()


def test_capped_scores_run_in_the_mask_kernel():
    """The cap is recognised with the attention (before, the scores stayed ops: ``[S, S]``
    per head on every rank) and goes to the mask kernel with the program; the traced graph
    computes what the ops did, and the plan moves only q/k/v and the output."""
    from spdsl.kernels.masked_attn import softcap_of
    torch.manual_seed(0)
    block = _Capped()
    x = torch.randn(2, 16, 32)
    mask = torch.zeros(2, 1, 16, 16).masked_fill(torch.ones(16, 16).triu(1).bool(), -1e9)
    _, nodes = _attention_nodes(block, x, mask)
    assert len(nodes) == 1 and nodes[0].target is torch.ops.spdsl.attention_fn.default
    assert softcap_of(nodes[0].args[4]) == 0.5
    assert _scale(nodes[0]) == pytest.approx(1 / math.sqrt(8))     # c * tanh(s / c), s = qk * scale
    assert_close(_run_traced(block, x, mask), block(x, mask), rtol=1e-5, name="loss")
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(block), torch.randn(2, 32, 32),
                      torch.zeros(2, 1, 32, 32))
    assert [c.kind for c in plan.collectives].count("all_to_all") == 2
    assert "all_gather" not in [c.kind for c in plan.collectives]


def test_plan_of_written_out_attention_is_at_the_floor():
    block = _Block(hq=4, hkv=2)
    x, mask = torch.randn(2, 32, 32), torch.zeros(2, 1, 32, 32)
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(block), x, mask)
    a2a = [c for c in plan.collectives if c.kind == "all_to_all"]
    assert len(a2a) == 2 and len(plan.attention) == 1
    assert sum(c.bytes for c in a2a) == plan.attention[0].floor
    assert not [c for c in plan.collectives if c.kind == "all_gather"
                and c.values[0].startswith("f32")]


class _MHA(nn.Module):
    def __init__(self, encoder: bool) -> None:
        super().__init__()
        self.encoder = encoder
        self.att = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True) \
            if encoder else nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        S = x.shape[1]
        mask = torch.triu(torch.full((S, S), float("-inf")), 1)
        if self.encoder:
            return self.att(x, src_mask=mask, is_causal=True).sum()
        return self.att(x, x, x, attn_mask=mask)[0].sum()   # need_weights=True: bmm path


@pytest.mark.parametrize("encoder", [False, True], ids=["MultiheadAttention",
                                                         "TransformerEncoderLayer"])
def test_torch_attention_modules_are_ulysses(encoder):
    torch.manual_seed(0)
    m = _MHA(encoder).train()
    x = torch.randn(2, 32, 32)
    _, nodes = _attention_nodes(m, x)
    assert len(nodes) == 1
    assert_close(_run_traced(m, x), m(x), rtol=1e-5, name="output")
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(m), x)
    a2a = [c for c in plan.collectives if c.kind == "all_to_all"]
    assert len(a2a) == 2 and sum(c.bytes for c in a2a) == plan.attention[0].floor


def test_dropout_and_off_switch_leave_the_ops(monkeypatch):
    def dropped(q, k, v):
        w = F.dropout(torch.softmax(q @ k.transpose(-1, -2), -1), p=0.1, training=True)
        return (w @ v).sum()

    q = torch.randn(1, 2, 8, 4)
    assert _attention_nodes(dropped, q, q, q)[1] == []
    monkeypatch.setenv("SPDSL_FUSE_EAGER_ATTENTION", "0")
    block = _Block()
    assert _attention_nodes(block, torch.randn(1, 8, 32), torch.zeros(1, 1, 8, 8))[1] == []


def test_three_d_operands_with_a_per_batch_mask():
    """q, k, v only ever ``[B*H, S, D]``; the mask is added to the scores viewed as
    ``[B, H, S, S]``: attended as ``[1, B*H, S, D]`` with the mask expanded to match."""
    def f(q, k, v, mask):
        B, H = mask.shape[0], q.shape[0] // mask.shape[0]
        s = torch.bmm(q, k.transpose(1, 2)).view(B, H, q.shape[1], k.shape[1]) / 4.0 + mask
        w = torch.softmax(s, -1).view(B * H, q.shape[1], k.shape[1])
        return torch.bmm(w, v).sum(-1)

    q, k, v = (torch.randn(6, 8, 16) for _ in range(3))
    mask = torch.randn(2, 1, 8, 8)
    _, nodes = _attention_nodes(f, q, k, v, mask)
    assert len(nodes) == 1
    assert_close(_run_traced(f, q, k, v, mask), f(q, k, v, mask), rtol=1e-5, name="out")
