"""Grouped kv heads repeated the Hugging Face way before attention (``repeat_kv``:
``x[:, :, None].expand(...).reshape(...)``) cross the all-to-all unrepeated: a Llama-3.1-8B
shaped layer plans at exactly the analytic Ulysses floor."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import spdsl

MiB = 2 ** 20


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    b, h, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class HFStyleAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.h, self.kv, self.d = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, heads * self.d, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.d, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.d, bias=False)
        self.o = nn.Linear(heads * self.d, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.h, self.d).transpose(1, 2)
        k = self.k(x).view(b, s, self.kv, self.d).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv, self.d).transpose(1, 2)
        k, v = repeat_kv(k, self.h // self.kv), repeat_kv(v, self.h // self.kv)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(o.transpose(1, 2).reshape(b, s, -1))


class Stack(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(HFStyleAttention(dim, heads, kv_heads)
                                    for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.float().pow(2).mean()


def _ulysses_fwd(plan) -> int:
    return sum(c.bytes for c in plan.collectives if c.purpose == "ulysses")


def test_llama3_8b_shaped_gqa_with_repeat_kv_plans_at_the_floor():
    with torch.device("meta"):
        model = Stack(4096, 32, 8, 2).to(torch.bfloat16)
        x = torch.empty(1, 131072, 4096, dtype=torch.bfloat16)
    plan = spdsl.plan(spdsl.sp_shard(seq=8)(model), x)
    # q and o: 131072 x 32 x 128 x 2 B / 8 = 128 MiB each; k and v with 8 heads: 32 MiB each
    assert _ulysses_fwd(plan) == 2 * 320 * MiB
    assert _ulysses_fwd(plan) == plan.totals.floor_fwd        # 1.00x the analytic floor


def test_mqa_repeats_kv_heads_only_up_to_the_degree():
    with torch.device("meta"):
        model = Stack(512, 8, 1, 1)
        x = torch.empty(1, 1024, 512)
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(model), x)
    q = 1024 * 8 * 64 * 4 // 4
    kv = 2 * 1024 * 4 * 64 * 4 // 4          # one kv head repeated to 4, not to 8
    assert _ulysses_fwd(plan) == q + kv + q
    assert _ulysses_fwd(plan) == plan.totals.floor_fwd        # 1.00x the analytic floor
