"""All-to-alls at the cheapest point of a cast chain: q, k, v upcast right before attention
cross the exchange in their narrow dtype, and an output cast down right after it crosses back
narrow (``spdsl.propagate.attention_nodes.uncast_attention``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spdsl
from spdsl.propagate.attention_nodes import COMPUTE_DTYPE, OUT_DTYPE
from spdsl.propagate.trace import trace
from tests._util import assert_close


class UpcastAttention(nn.Module):
    """Attention computed in a wider dtype than the model's: q, k, v upcast before SDPA, the
    output cast back."""

    def __init__(self, dtype=torch.bfloat16, wide=torch.float32, heads: int = 8,
                 kv: int = 2, d: int = 16) -> None:
        super().__init__()
        self.h, self.kv, self.d, self.wide = heads, kv, d, wide
        self.q = nn.Linear(64, heads * d, dtype=dtype)
        # no key bias: its gradient is zero in exact arithmetic (softmax is shift-invariant)
        self.k = nn.Linear(64, kv * d, bias=False, dtype=dtype)
        self.v = nn.Linear(64, kv * d, dtype=dtype)

    def forward(self, x, down: bool = True):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.h, self.d).transpose(1, 2)
        k = self.k(x).view(B, S, self.kv, self.d).transpose(1, 2)
        v = self.v(x).view(B, S, self.kv, self.d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.to(self.wide), k.to(self.wide), v.to(self.wide),
                                           is_causal=True, enable_gqa=True)
        o = o.to(x.dtype) if down else o
        return o.float().pow(2).mean()


@pytest.mark.parametrize("down", [True, False])
def test_exchange_moves_the_narrow_dtype(down):
    model = UpcastAttention()
    x = torch.randn(2, 256, 64, dtype=torch.bfloat16)
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(lambda t: model(t, down)), x)
    a2a = [c for c in plan.collectives if c.kind == "all_to_all"]
    assert len(a2a) == 2 and len(plan.attention) == 1
    B, S, P = 2, 256, 4
    # bf16 q (8 heads), k and v (2 heads each, repeated up to the 4 ranks)
    qkv = B * S * (8 + 2 * 4) * 16 * 2 // P
    out = B * S * 8 * 16 * (2 if down else 4) // P      # bf16 if cast down after, else f32
    assert [c.bytes for c in a2a] == [qkv, out]
    assert sum(c.bytes for c in a2a) == plan.attention[0].floor
    assert a2a[0].values[0].startswith("bf16[")


def test_traced_graph_computes_the_same():
    torch.manual_seed(0)
    model = UpcastAttention(torch.float32, torch.float64)
    x = torch.randn(2, 32, 64)
    t = trace(model, (x,), {})
    att = [n for n in t.graph.graph.nodes if n.target is torch.ops.spdsl.attention.default]
    assert att[0].meta[COMPUTE_DTYPE] == torch.float64
    assert att[0].meta[OUT_DTYPE] == torch.float32
    assert att[0].args[0].meta["val"].dtype == torch.float32
    assert_close(t.graph(*t.state, x)[0], model(x), rtol=1e-7, name="loss")
