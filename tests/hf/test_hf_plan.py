"""The plan of an unchanged Hugging Face Llama with eager attention and a padding mask: two
all-to-alls per layer (q/k/v in, output back), at the analytic Ulysses floor; the 2-D padding
mask is gathered once (it is indexed by every key position), nothing else per layer."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch

import spdsl
from tests.hf.families import ATTN, FAMILIES, LAYERS, build, padded


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


def test_unpacked_batch_attends_with_is_causal_not_a_full_mask():
    """HF checks position ids for packed documents by their values; on the traced (fake)
    tensors it would build a full [S, S] mask. Positions HF makes itself are evaluated for real
    while spdsl traces: no mask, SDPA's is_causal, nothing of size S x S. Packed position ids
    passed by the caller keep their document mask, as a function of the positions
    (``spdsl.propagate.masks``): no value of size S x S either."""
    from tests.hf.families import packed
    model = build("llama", "sdpa")
    S = 256
    ids = torch.randint(1, 128, (1, S))

    def loss_fn(i, l):
        return model(input_ids=i, labels=l, use_cache=False).loss

    plan = spdsl.plan(spdsl.sp_shard(seq=4)(loss_fn), ids, ids)
    assert not [v.typed for v in plan.values if f"{S},{S}]" in v.typed or f"{S}@sp,{S}]" in
                v.typed], "a value of size S x S"
    assert len(plan.attention) == LAYERS
    ids, labels, pos = packed()
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(
        lambda i, l, p: model(input_ids=i, labels=l, position_ids=p, use_cache=False).loss),
        ids, labels, pos)
    assert not any("32,32" in v.typed for v in plan.values), "a value of size S x S"
    masks = [a.mask for a in plan.attention]
    assert len(masks) == LAYERS and all(m.startswith("function of") for m in masks), masks


def test_a_returned_key_value_cache_is_a_clear_error():
    """An HF model called as it is returns its DynamicCache (use_cache=True): an error that
    names it and the fix, not an FX error."""
    model = build("llama", "sdpa")
    model.config.use_cache = True
    ids = torch.randint(1, 128, (1, 32))
    with pytest.raises(spdsl.ShardingError, match=r"\[output type\].*DynamicCache") as e:
        spdsl.plan(spdsl.sp_shard(seq=2)(model), ids)
    assert "use_cache=False" in str(e.value)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_attends_at_the_floor(family):
    """Every family of the matrix, plain batch, eager attention where it has it (the
    written-out path) else SDPA: per attention layer the two Ulysses all-to-alls at the
    analytic floor, and no other collective inside the layers (Gemma 3's and Cohere's rotary
    tables were gathered once per step or exchanged per layer, DeepSeek-V2's keys gathered whole,
    Gemma 2's capped scores left as ops, before the fixes)."""
    from tests.hf.cases import inputs, loss_fn
    names, xs = inputs("plain")
    attn = "eager" if "eager" in ATTN[family] else ATTN[family][0]
    plan = spdsl.plan(spdsl.sp_shard(seq=2)(loss_fn(build(family, attn), names)), *xs)
    assert plan.attention
    for site in plan.attention:
        moves = [c for c in plan.collectives if c.module == site.module]
        assert [c.kind for c in moves] == ["all_to_all", "all_to_all"], (site.module, moves)
        assert sum(c.bytes for c in moves) == site.floor
        assert sum(c.bytes_bwd for c in moves) == site.floor
    # a convolution along the sequence (LFM2's) exchanges a halo, one per layer that has one
    halos = [c for c in plan.collectives if c.kind == "halo_exchange" and c.purpose == "halo"]
    assert len(halos) == FAMILIES[family].halo_layers, halos
    # a scalar computed from parameters and used on the split sequence (Apertus's xIELU:
    # softplus of a learned alpha) has a partial gradient, reduced where it is computed: bytes
    # of the scalar, not of the sequence
    scalars = [c for c in plan.collectives if "layers" in c.module and
               c.purpose == "gradient" and c.bytes == 0 and c.bytes_bwd <= 8]
    inside = [c for c in plan.collectives if "layers" in c.module and
              c.purpose != "ulysses" and c not in halos and c not in scalars]
    assert inside == [], inside
    # outside them, forward gathers only labels, masks and positions (integers, booleans);
    # learned position embeddings (GPT-2, OPT, GPT-BigCode) gather their [S, D]
    # gradient once in backward
    floats = [c for c in plan.collectives if c.kind == "all_gather" and c.bytes and
              c.values[0].startswith(("f32", "f16", "bf16", "complex"))]
    assert floats == [], floats


@pytest.mark.parametrize("data", ["plain", "packed_seq_idx"])
def test_lfm2_convolution_exchanges_a_halo(data):
    """LFM2's short convolution (kernel 3), captured as ``causal_conv1d_fn``: split, rank 0
    sending its last 2 tokens (and, given ``seq_idx``, their document indices), nothing of the
    sequence gathered."""
    from tests.hf.cases import inputs, loss_fn
    from tests.hf.families import unsupported
    why = unsupported("lfm2", "sdpa", data)
    if why:
        pytest.skip(why)
    names, xs = inputs(data)
    plan = spdsl.plan(spdsl.sp_shard(seq=2)(loss_fn(build("lfm2", "sdpa"), names)), *xs)
    assert [v.origin for v in plan.values if v.origin.startswith("mixer.")] == \
        ["mixer.causal_conv1d.state"]
    halos = [c for c in plan.collectives if c.kind == "halo_exchange"]
    B, C = xs[0].shape[0], FAMILIES["lfm2"].kwargs["hidden_size"]
    docs = [("model.layers.0.conv", "halo", B * 2 * 4)] if data == "packed_seq_idx" else []
    assert [(c.module, c.purpose, c.bytes) for c in halos] == [
        ("model.layers.0.conv", "halo", B * C * 2 * 4)] + docs
    assert not [c for c in plan.collectives if c.kind == "all_gather" and
                c.values[0].startswith("f32")]
