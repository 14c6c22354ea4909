"""Plans of whole models, built in one process from fake tensors (no process group)."""

from __future__ import annotations

import pytest
import torch

import spdsl
from spdsl.models.llama import Llama, LlamaConfig


def _llama_plan(cfg: LlamaConfig, b: int, s: int, parts: int):
    torch.manual_seed(0)
    model = Llama(cfg)
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    return spdsl.plan(spdsl.sp_shard(seq=parts)(model), ids, ids)


@pytest.mark.parametrize("parts,n_kv", [(2, 2), (4, 2), (4, 1), (4, 4)])
def test_llama_collectives_are_exactly_ulysses(parts, n_kv):
    cfg = LlamaConfig.tiny().replace(n_layers=3, n_kv_heads=n_kv)
    b, s = 2, 64
    plan = _llama_plan(cfg, b, s, parts)
    fwd = [c for c in plan.collectives if c.bytes > 0 and c.purpose != "check"]
    ulysses = [c for c in fwd if c.purpose == "ulysses"]
    # per layer: one fused q/k/v all-to-all and one output all-to-all
    assert [c.kind for c in ulysses] == ["all_to_all"] * (2 * cfg.n_layers)
    hd, f32 = cfg.head_dim, 4
    kv_heads = max(n_kv, parts)         # kv heads repeated up to the degree when fewer
    qkv = b * s * (cfg.n_heads + 2 * kv_heads) * hd * f32 // parts
    out = b * s * cfg.n_heads * hd * f32 // parts
    for layer in range(cfg.n_layers):
        assert ulysses[2 * layer].bytes == qkv
        assert ulysses[2 * layer + 1].bytes == out
        assert ulysses[2 * layer].module == f"layers.{layer}.attention"
        assert ulysses[2 * layer].bytes_bwd == qkv     # the same again in backward
    others = [c for c in fwd if c.purpose != "ulysses"]
    # the loss: one all-reduce of (sum, count); the in-model label shift: one halo exchange
    # of int64 labels (the labels move, never the logits): rank 0 hands over the s/P - 1
    # labels per row it keeps, rank 1 sends it one
    assert sorted((c.kind, c.bytes) for c in others) == sorted(
        [("all_reduce", 2 * f32), ("halo_exchange", b * (s // parts - 1) * 8)])
    grads = [c for c in plan.collectives if c.purpose == "gradient"]
    n_params = sum(p.numel() for p in Llama(cfg).parameters())
    assert sum(c.bytes_bwd for c in grads) == n_params * f32
    assert all(c.bytes == 0 for c in grads)


def test_llama_placements_read_in_dsl_notation():
    plan = _llama_plan(LlamaConfig.tiny(), 2, 64, 4)
    by_name = {v.name: v for v in plan.values}
    assert by_name["embedding"].typed == "f32[2,64@sp,64]"
    att = [v for v in plan.values if v.op == "spdsl.attention.default"]
    assert [v.typed for v in att] == ["f32[2,4,64@sp,16]"] * 2
    assert att[0].module == "layers.0.attention"
    assert att[0].source.startswith("spdsl/models/llama.py:")
    assert att[0].origin == "attention.ulysses"
    # the RoPE table is built whole from torch.arange and sliced where it meets q
    assert by_name["arange"].placement == "Replicate()"
    # the loss: exact global mean, every rank the same value
    losses = [v for v in plan.values if v.typed == "f32[]"]
    assert losses and all(v.placement == "Replicate()" for v in losses)
    text = str(plan)
    assert "layers.0-1 (x2)" in text and "all_to_all ulysses" in text


def test_plan_of_an_8b_model_on_meta_is_fast_and_analytic():
    with torch.device("meta"):
        model = Llama(LlamaConfig.llama3_8b())
    s, parts = 8192, 8
    ids = torch.empty(1, s, dtype=torch.long, device="meta")
    plan = spdsl.plan(spdsl.sp_shard(seq=parts)(model), ids, ids)
    per_layer = sum(c.bytes for c in plan.collectives if c.purpose == "ulysses") / 32
    # DESIGN.md: 20 KiB per token per layer in bf16 (q, k, v, o); here fp32, so 40 KiB
    assert per_layer == s * 40 * 1024 / parts


def test_retrace_only_when_shapes_change():
    model = Llama(LlamaConfig.tiny().replace(n_layers=1))
    f = spdsl.sp_shard(seq=2)(model)
    ids = torch.randint(0, 256, (1, 16))
    a = f.build((ids, ids), {})
    assert f.build((ids.clone(), ids.clone()), {}) is a
    assert f.build((ids[:, :8].contiguous(), ids[:, :8].contiguous()), {}) is not a
