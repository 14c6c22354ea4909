"""Buffers filled slice by slice become the ``cat`` of their pieces (``spdsl.propagate.fills``):
the traced graph computes what the ops did, the pieces' sequence split carries through (the
plan of DeepSeek-V2's key construction moves nothing but the attention's all-to-alls), and
fills that do not tile the buffer are left as traced."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import spdsl
from spdsl.propagate.trace import trace
from tests._util import assert_close


class _Keys(nn.Module):
    """DeepSeek-V2's keys: per-head features and one shared rotary head, copied into a fresh
    buffer (``overlap``: the second write starts inside the first, so it is not a tiling)."""

    def __init__(self, overlap: bool = False) -> None:
        super().__init__()
        self.overlap = overlap
        self.q = nn.Linear(32, 4 * 12)
        self.k = nn.Linear(32, 4 * 8)
        self.rot = nn.Linear(32, 4)
        self.v = nn.Linear(32, 4 * 8)

    def forward(self, x):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, 4, 12).transpose(1, 2)
        k_pass = self.k(x).view(B, S, 4, 8).transpose(1, 2)
        k_rot = self.rot(x).view(B, 1, S, 4)
        v = self.v(x).view(B, S, 4, 8).transpose(1, 2)
        keys = k_pass.new_empty(B, 4, S, 12)
        keys[..., :8].copy_(k_pass)
        if self.overlap:
            keys[..., 6:].copy_(k_pass[..., 2:])
        else:
            keys[..., 8:].copy_(k_rot.expand(-1, 4, -1, -1))
        return F.scaled_dot_product_attention(q, keys, v, is_causal=True).sum()


def _run(model, x):
    t = trace(model, (x,), {})
    return t.graph, t.graph(*t.state, x)[0]


def test_filled_keys_are_a_cat_and_compute_the_same():
    torch.manual_seed(0)
    model, x = _Keys(), torch.randn(2, 16, 32)
    gm, out = _run(model, x)
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.aten.new_empty.default not in targets
    assert torch.ops.aten.copy_.default not in targets
    assert torch.ops.aten.cat.default in targets
    assert_close(out, model(x), rtol=1e-6, name="loss")


def test_plan_moves_only_the_attention():
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(_Keys()), torch.randn(2, 32, 32))
    kinds = [c.kind for c in plan.collectives]
    assert kinds.count("all_to_all") == 2 and "all_gather" not in kinds, kinds


def test_overlapping_fills_are_left_as_traced():
    torch.manual_seed(0)
    model, x = _Keys(overlap=True), torch.randn(2, 16, 32)
    gm, out = _run(model, x)
    assert torch.ops.aten.new_empty.default in [n.target for n in gm.graph.nodes]
    assert_close(out, model(x), rtol=1e-6, name="loss")
