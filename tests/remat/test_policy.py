"""Unit tests of the remat pieces that need no process group: parsing ``remat=``, op kinds,
the SAC policy's decisions, layer paths."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from spdsl.remat import Remat, SavePolicy, parse_bytes
from spdsl.remat.policy import OpClass, candidates, kind_of, op_key
from spdsl.remat.segments import layer_of

aten = torch.ops.aten


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2 ** 30
    assert parse_bytes("1.5 MiB") == 3 * 2 ** 19
    assert parse_bytes(123) == 123
    with pytest.raises(ValueError, match="80GiB"):
        parse_bytes("lots")


def test_remat_of():
    assert Remat.of(None).mode == "fit" and Remat.of(None).fit     # chosen from memory
    assert Remat.of("fit") == Remat("fit") and not Remat.of("auto").fit
    assert Remat.of("full") == Remat("full")
    assert Remat.of("2GiB") == Remat("auto", budget=2 * 2 ** 30)
    assert Remat.of(4096).budget == 4096
    assert 0 < Remat.of(0.5).budget
    with pytest.raises(ValueError, match="one of"):
        Remat("sometimes")
    with pytest.raises(TypeError, match="ambiguous"):
        Remat.of(True)


def test_kinds():
    assert kind_of(torch.ops._c10d_functional.all_to_all_single.default) == "collective"
    assert kind_of(torch.ops._c10d_functional.wait_tensor.default) == "collective"
    assert kind_of(aten._scaled_dot_product_flash_attention_for_cpu.default) == "attention"
    assert kind_of(aten.mm.default) == "matmul"
    for cheap in (aten.rsqrt.default, aten.mul.Tensor, aten._to_copy.default, aten.cat.default):
        assert kind_of(cheap) == "cheap"


def test_policy_never_recomputes_collectives():
    a = torch.randn(4, 8)
    b = torch.randn(8, 2)
    full = SavePolicy()
    assert full(None, torch.ops._c10d_functional.all_to_all_single.default, a, None, None,
                "0") == CheckpointPolicy.MUST_SAVE
    assert full(None, aten.mm.default, a, b) == CheckpointPolicy.PREFER_RECOMPUTE
    auto = SavePolicy(frozenset([op_key(aten.mm.default, (a, b))]))
    assert auto(None, aten.mm.default, a, b) == CheckpointPolicy.MUST_SAVE
    # another signature of the same op is another decision
    assert auto(None, aten.mm.default, b.T, a.T) == CheckpointPolicy.PREFER_RECOMPUTE
    assert auto(None, aten.rsqrt.default, a) == CheckpointPolicy.PREFER_RECOMPUTE
    # asked for: the all-to-alls of a checkpointed layer run again in backward
    again = SavePolicy(save_collectives=False)
    assert again(None, torch.ops._c10d_functional.all_to_all_single.default, a, None, None,
                 "0") == CheckpointPolicy.PREFER_RECOMPUTE


def test_candidates_rank_by_flops_per_byte_and_drop_cheap_ops():
    mm_small_k = OpClass(("a",), "matmul", 2, bytes=1000, flops=64_000)       # 64 per byte
    mm_big_k = OpClass(("b",), "matmul", 2, bytes=1000, flops=700_000)        # 700 per byte
    attn = OpClass(("c",), "attention", 2, bytes=1000, flops=4_000_000)       # grows with S
    cheap = OpClass(("d",), "matmul", 2, bytes=1000, flops=1000)              # 1 per byte
    assert [c.key for c in candidates([mm_small_k, cheap, attn, mm_big_k])] == \
        [("c",), ("b",), ("a",)]


def test_layer_of():
    assert layer_of("layers.3.feed_forward.w1") == "layers.3"
    assert layer_of("layers.10") == "layers.10"
    assert layer_of("model.layers.7.mlp.up_proj") == "model.layers.7"
    assert layer_of("lm_head") is None
    assert layer_of("") is None
