"""The longest-sequence search: the full-depth simulation decides, the default reserve is the
sum of its documented parts, and ``best`` searches its grid."""

from __future__ import annotations

import torch

from spdsl import sp_shard
from spdsl.memory.host import pinned_bytes
from spdsl.memory.model import model_plan
from spdsl.memory.reserve import default_reserve, reserve_parts
from spdsl.memory.search import Estimator, best_grid, max_seq
from spdsl.models.llama import LlamaConfig
from spdsl.remat import Remat

MiB, GiB = 2 ** 20, 2 ** 30


def test_full_depth_decides_the_answer():
    """The answer fits at full depth and one granule more does not, whatever the 1-2 layer
    extrapolation proposed."""
    cfg = LlamaConfig.tiny().replace(n_layers=5)
    est = Estimator(cfg, 2, Remat("full"), dtype=torch.float32, shard=sp_shard)
    budget = 40 * MiB
    seq, plan = max_seq(est, budget, granularity=1024, probes=(2048, 8192), verify=True)
    assert seq > 0 and plan is not None
    assert plan.peak <= budget
    at = model_plan(cfg, seq, 2, Remat("full"), dtype=torch.float32, shard=sp_shard)
    assert at.peak == plan.peak
    assert model_plan(cfg, seq + 1024, 2, Remat("full"), dtype=torch.float32,
                      shard=sp_shard).peak > budget


def test_host_budget_with_pinned_copies():
    """Pinned copies are a staircase in the sequence: the answer's host bytes, rounded, fit."""
    cfg = LlamaConfig.tiny().replace(n_layers=3)
    lean = Remat("full", recompute_collectives=True, offload=True)
    est = Estimator(cfg, 2, lean, dtype=torch.float32, pinned_host=True, shard=sp_shard)
    seq, plan = max_seq(est, GiB, granularity=1024, probes=(2048, 8192), verify=True,
                        host_budget=3 * MiB)
    per_layer = seq // 2 * cfg.dim * 4
    assert plan.host_requested == cfg.n_layers * per_layer
    assert plan.host == cfg.n_layers * pinned_bytes(per_layer) <= 3 * MiB
    # one granule more crosses the power of two a layer's copy is rounded to
    longer = model_plan(cfg, seq + 1024, 2, lean, dtype=torch.float32, pinned_host=True,
                        shard=sp_shard)
    assert longer.host > 3 * MiB


def test_default_reserve_for_an_80gib_card():
    parts = reserve_parts(80 * GiB)
    assert set(parts) == {"capacity", "CUDA context", "NCCL", "fragmentation"}
    assert parts["fragmentation"] == 4 * GiB
    assert abs(default_reserve(80 * GiB) - 7.9 * GiB) < 0.01 * GiB


def test_best_grid():
    grid = best_grid(True, 8, 32)
    assert len(grid) == 5 * 2 * 2 * 2
    assert {n for _, n in grid} == {8, 32}
    assert {(r.mode, r.budget, r.tile_mlp) for r, _ in grid} == {
        ("auto", None, None), ("auto", None, True), ("auto", 0, None), ("full", None, None),
        ("full", None, True)}
    assert len(best_grid(False, 8, 8)) == 5 * 2
