"""How often each kv head crosses the Ulysses all-to-all (``spdsl.propagate.heads``): once where
the kv heads split over the axis, ``P / H_kv`` times where fewer kv heads divide the degree, as
the program repeated them otherwise; and a grouped-query attention's plan lists exactly that."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spdsl
from spdsl.propagate.heads import kv_repeat


@pytest.mark.parametrize("hq, hk, parts, want", [
    (32, 8, 4, 1),        # kv heads split over the axis: each crosses once
    (32, 8, 8, 1),
    (8, 2, 4, 2),         # 2 kv heads, 4 ranks: each rank needs the kv head of its queries
    (8, 1, 4, 4),         # multi-query: every rank gets the one kv head
    (16, 8, 16, 2),
    (12, 6, 4, 2),        # 6 kv heads neither split over 4 nor divide it: as written (12/6)
    (12, 12, 8, 1),       # ... the program's own repeat is 1 here
])
def test_kv_repeat(hq, hk, parts, want):
    assert kv_repeat(hq, hk, parts) == want


def _attend(q, k, v):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("hk, note, nbytes", [
    (1, " repeated x4", 512 + 2 * 4 * 64),
    (2, " repeated x2", 512 + 2 * 2 * 128),
    (4, "", 512 + 2 * 256),
])
def test_the_plan_moves_each_kv_head_as_often_as_kv_repeat_says(hk, note, nbytes):
    # q [1, 16@sp, 8, 4] fp32: 512 B a rank; k, v [1, 16@sp, hk, 4]: 64 * hk B a rank
    q, k = torch.randn(1, 16, 8, 4), torch.randn(1, 16, hk, 4)
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(_attend), q, k, k)
    c = next(c for c in plan.collectives if c.purpose == "ulysses")
    assert c.values == ("f32[1,8,16@sp,4]", f"f32[1,{hk},16@sp,4]{note}",
                        f"f32[1,{hk},16@sp,4]{note}")
    assert c.bytes == nbytes
