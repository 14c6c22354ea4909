from __future__ import annotations

import dataclasses

import pytest
import torch

import spdsl
from spdsl.models.llama import Llama, LlamaConfig


@pytest.fixture(scope="package")
def tiny_plan() -> spdsl.ShardingPlan:
    """The tiny Llama (2 layers) at 64 tokens over 4 ranks, with labels (loss inside)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 64))
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(Llama(LlamaConfig.tiny())), ids, ids.clone())
    return dataclasses.replace(plan, title="tiny Llama")


@pytest.fixture(scope="package")
def deep_plan() -> spdsl.ShardingPlan:
    """Six layers on meta at bf16: folding and per-layer totals."""
    with torch.device("meta"):
        model = Llama(LlamaConfig.tiny().replace(n_layers=6)).to(torch.bfloat16)
    ids = torch.empty(1, 256, dtype=torch.long, device="meta")
    return spdsl.plan(spdsl.sp_shard(seq=4)(model), ids, ids.clone())
