"""The plan of an unchanged Hugging Face Llama with eager attention and a padding mask: two
all-to-alls per layer (q/k/v in, output back), at the analytic Ulysses floor; the 2-D padding
mask is gathered once (it is indexed by every key position), nothing else per layer."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import spdsl
from tests.hf.families import LAYERS, build, padded


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_llama_padded_plan_is_two_all_to_alls_per_layer_at_the_floor(attn):
    model = build("llama", attn)
    ids, labels, mask = padded(s=64)

    def loss_fn(i, l, a):
        return model(input_ids=i, labels=l, attention_mask=a, use_cache=False).loss

    plan = spdsl.plan(spdsl.sp_shard(seq=4)(loss_fn), ids, labels, mask)
    assert len(plan.attention) == LAYERS
    for site in plan.attention:
        moves = [c for c in plan.collectives if c.module == site.module]
        assert [c.kind for c in moves] == ["all_to_all", "all_to_all"], moves
        assert all(c.purpose == "ulysses" for c in moves)
        assert sum(c.bytes for c in moves) == site.floor
        assert sum(c.bytes_bwd for c in moves) == site.floor
    assert plan.totals.floor_fwd == sum(s.floor for s in plan.attention)
    # the padding mask, [B, S] integers, is the only value gathered before the layers
    gathers = [c for c in plan.collectives if c.kind == "all_gather" and "layers" in c.module]
    assert gathers == []
    assert any(c.kind == "all_gather" and c.values[0].startswith("bool[2,64@sp]")
               for c in plan.collectives)
