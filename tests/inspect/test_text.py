"""``print(plan)``: compact, identical layers folded, totals beside the Ulysses floor."""

from __future__ import annotations

from spdsl.inspect.layers import block_of
from spdsl.inspect.text import fmt_bytes


def test_identical_layers_fold_into_one_block(deep_plan):
    names = [b.name for b in deep_plan.layers]
    assert names == ["rope", "tok_embeddings", "layers.0-5", "norm", "lm_head", ""]
    layers = deep_plan.layers[2]
    assert layers.count == 6 and layers.members[-1] == "layers.5"
    # one layer of the tiny Llama at bf16, 256 tokens over 4 ranks: q+k+v+o = 4 x 8 KiB
    assert layers.bytes_fwd == layers.floor == 4 * 256 * 64 * 2 // 4
    assert layers.ratio == 1.0
    text = str(deep_plan)
    assert "layers.0-5 (x6)" in text and "floor 32.0 KiB (1.00x)" in text
    assert len(text.splitlines()) < 40


def test_rows_show_module_outputs_and_collectives(tiny_plan):
    text = str(tiny_plan)
    assert "layers.0-1 (x2)" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("wq "))
    assert "f32[2,64@sp,64]" in row
    # the gradients are reduced in one bucket for the whole model, not per layer
    assert "16.0 KiB" not in row
    assert "> all_to_all ulysses  24.0 KiB fwd / 24.0 KiB bwd  f32[2,4,64@sp,16]" in text
    # the labels' shift: rank 0 hands its 15 kept rows of 2 x 16 int64 labels to the exchange
    assert "> halo_exchange halo  240 B fwd" in text and "> all_reduce loss  8 B fwd" in text
    assert "input   i64[2,64@sp]" in text and "in_specs[0]" in text
    assert "output  f32[]" in text and "loss.nll.global_mean" in text


def test_totals_beside_the_floor(tiny_plan):
    t = tiny_plan.totals
    assert t.floor_fwd == 2 * 32 * 1024 and t.floor_bwd == t.floor_fwd
    assert t.bytes_fwd == t.floor_fwd + 240 + 8      # + labels' halo and the loss' sum/count
    grads = [c for c in tiny_plan.collectives if c.purpose == "gradient"]
    assert len(grads) == 1 and t.grad_bwd == grads[0].bytes_bwd      # one bucket
    assert len(grads[0].carries) == 21 and grads[0].carries[0] == "lm_head.weight"
    floor, remat, comm = str(tiny_plan).splitlines()[-3:]
    assert remat.startswith("  remat:              fit, chosen when the step is built")
    assert "Ulysses floor" in floor and "1.00x forward, 1.00x backward" in floor
    assert comm.startswith("  communication:") and "exposed" in comm


def test_block_of_and_bytes():
    assert block_of("layers.3.attention.wq") == "layers.3"
    assert block_of("blocks.0.mlp.2") == "blocks.0"
    assert block_of("0.attn") == "0"
    assert block_of("tok_embeddings") == "tok_embeddings" and block_of("") == ""
    assert fmt_bytes(20 * 1024) == "20.0 KiB" and fmt_bytes(8) == "8 B"
