"""The planner in one process, no gloo ranks: a fake process group stands in for SP 2 and 4,
so these run at any degree on fake tensors."""

from __future__ import annotations

import math

import pytest
import torch

import spdsl
from spdsl.cli.memory import main
from spdsl.memory import plan_memory
from spdsl.memory.model import bytes_per_token_per_layer
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.remat import Remat

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sp4():
    """One tiny Llama traced once at SP 4; each remat mode planned from the same trace."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    ids = torch.zeros(1, 1024, dtype=torch.long)
    f = spdsl.sp_shard(seq=4)(model)
    modes = {"none": "none", "auto": "auto", "full": "full",
             "tiled": Remat("auto", tile_mlp=True, tile_loss=True)}
    return model, {k: plan_memory(f, ids, ids, remat=r) for k, r in modes.items()}


def test_breakdown_sums_to_peak_and_static_parts_are_exact(sp4):
    model, plans = sp4
    plan = plans["full"]
    assert plan.peak == plan.parameters + plan.gradients + plan.optimizer + plan.inputs + \
        plan.activations + plan.transient
    n = sum(p.numel() for p in model.parameters())
    assert plan.parameters >= 4 * n      # + the RoPE buffer
    assert plan.optimizer == 8 * n + 4 * len(list(model.parameters()))


def test_modes_order_and_tiling_helps(sp4):
    _, p = sp4
    assert p["full"].saved_activations < p["auto"].saved_activations < \
        p["none"].saved_activations
    assert p["tiled"].saved_activations < p["auto"].saved_activations
    assert p["full"].peak < p["none"].peak


def test_full_keeps_layer_input_and_collective_outputs_per_layer():
    """fp32, SP 2, tiny: a layer keeps its input (h) and the outputs of its two all-to-alls
    (q, k, v: h + 2 h_kv; o: h) — nothing else crosses from forward to backward but the CPU
    RNG state ``torch.utils.checkpoint`` stores per layer (a constant, not per token)."""
    cfg = LlamaConfig.tiny()
    per = bytes_per_token_per_layer(cfg, 2, "full", seq=2048, dtype=torch.float32,
                                    shard=spdsl.sp_shard)
    h, kv = cfg.dim, cfg.n_kv_heads * cfg.head_dim
    rng = torch.get_rng_state().numel()
    assert per == 4 * (h + (h + 2 * kv) + h) + rng / (2048 // 2)


def test_state_shards(sp4):
    plan = sp4[1]["full"]
    split = plan.with_state_shards(4)
    assert split.peak < plan.peak
    assert math.isclose(split.phases["optimizer"]["optimizer"], plan.optimizer // 4)


def test_cli_plans_one_length(capsys):
    assert main(["--model", "spdsl.models.llama:LlamaConfig.tiny", "--sp", "2", "--seq", "512",
                 "--dtype", "fp32", "--remat", "full"]) == 0
    out = capsys.readouterr().out
    assert "remat=full" in out and "peak" in out and "optimizer state" in out


def test_plan_memory_is_reachable_from_the_sharding_plan():
    import spdsl
    from spdsl.models.llama import Llama, LlamaConfig

    model = Llama(LlamaConfig.tiny())
    ids = torch.randint(0, 256, (1, 64))
    mem = spdsl.plan(spdsl.sp_shard(seq=2, remat="none")(model), ids, ids).memory
    state = [*model.parameters(), *model.buffers()]      # buffers (RoPE inv_freq) count too
    n_bytes = sum(t.numel() * t.element_size() for t in state)
    assert mem.parameters == n_bytes
    assert mem.peak == (mem.parameters + mem.gradients + mem.optimizer + mem.inputs
                        + mem.activations + mem.transient)
