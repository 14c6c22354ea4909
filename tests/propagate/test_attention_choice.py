"""One device model per plan (``spdsl.propagate.attention_choice.device_model``): a plan on
the meta device is one for CUDA accelerators, and its attention choice, its timing and its
``remat="fit"`` budget all use the same ``Links``, the ones a CUDA run uses by default. One
process: the CUDA run's decision is the same function called with the device a CUDA run
passes (``choose_kind`` hands it ``q.device.type``)."""

from __future__ import annotations

import re

import pytest
import torch

import spdsl
from spdsl.memory import fit
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.propagate.attention_choice import AttentionConfig, Links, choose, device_model

P = 4
# 2 query and 2 kv heads of 16 over 4 ranks, 1,024 tokens: CPU figures pick a zigzag ring,
# CUDA figures a 2 x 2 hybrid (its all-to-alls cost little next to 4x slower ring blocks)
SMALL = LlamaConfig.tiny().replace(n_layers=1, dim=32, n_heads=2, n_kv_heads=2)
SEQ = 1024


def _meta_plan(config: LlamaConfig, seq: int, parts: int = P, **options):
    with torch.device("meta"):
        model = Llama(config).to(torch.bfloat16)
    ids = torch.empty(1, seq, dtype=torch.long, device="meta")
    return spdsl.plan(spdsl.sp_shard(seq=parts, **options)(model), ids, ids, fit=False)


def _decision(cfg: LlamaConfig, seq: int, parts: int, **kw):
    """``choose`` for one attention layer of ``cfg``, as ``choose_kind`` calls it."""
    d = cfg.dim // cfg.n_heads
    return choose(AttentionConfig(**kw.pop("config", {})), 1, cfg.n_heads, cfg.n_kv_heads, seq,
                  d, 2, parts, True, masked=False, **kw)


def test_a_meta_plan_is_priced_as_a_cuda_run():
    cuda_run = _decision(SMALL, SEQ, P, device="cuda")               # a CUDA run's default
    given = _decision(SMALL, SEQ, P, device="cuda", config={"links": Links.default("cuda")})
    cpu_run = _decision(SMALL, SEQ, P, device="cpu")
    assert cuda_run == given and cuda_run.costs == given.costs
    assert cpu_run.label != cuda_run.label, "the case must tell the two device models apart"
    plan = _meta_plan(SMALL, SEQ)
    assert [a.runs for a in plan.attention] == [cuda_run.label]
    explicit = _meta_plan(SMALL, SEQ, attention=AttentionConfig(links=Links.default("cuda")))
    assert [a.runs for a in explicit.attention] == [cuda_run.label]
    on_cpu = _meta_plan(SMALL, SEQ, attention=AttentionConfig(links=Links.default("cpu")))
    assert [a.runs for a in on_cpu.attention] == [cpu_run.label]
    # the timing runs on the links the choice priced
    assert plan.timing().links == device_model("meta") == Links.default("cuda")
    assert on_cpu.timing().links == Links.default("cpu")


def test_the_printed_costs_are_the_gpu_models():
    # two layers of Llama-3-8B at 131,072 tokens over 8 GPUs: one layer's Ulysses attention
    # 0.21 s on the GPU figures (on the CPU's: ~3,000 s), a part of the 0.75 s step
    cfg = LlamaConfig.llama3_8b().replace(n_layers=2)
    plan = _meta_plan(cfg, 131072, parts=8)
    assert [a.runs for a in plan.attention] == ["ulysses"] * 2
    costs = [float(x) / 1e3 for x in re.findall(r" ([0-9.e+]+) ms", plan.attention[0].why)]
    step = plan.timing().step_s
    assert costs and 2 * min(costs) < step, (costs, step)
    expected = _decision(cfg, 131072, 8, device="cuda").costs      # in the printed order
    assert costs == pytest.approx(list(expected.values()), rel=1e-2)


def test_a_meta_plan_budgets_against_its_device_model(monkeypatch):
    def host(*_):
        raise AssertionError("a meta plan read this host's free memory")
    monkeypatch.setattr(fit, "_mem_available", host)
    monkeypatch.delenv(fit.ENV, raising=False)
    cfg = LlamaConfig.tiny().replace(n_layers=1)
    with torch.device("meta"):
        model = Llama(cfg).to(torch.bfloat16)
    ids = torch.empty(1, 256, dtype=torch.long, device="meta")
    plan = spdsl.plan(spdsl.sp_shard(seq=P)(model), ids, ids, fit=True)
    reserve = sum(fit.reserve_parts(80 * 2 ** 30).values())
    assert plan.remat.budget == 80 * 2 ** 30 - reserve
    assert "device model" in plan.remat.budget_source
    h200 = AttentionConfig(links=Links.default("cuda").with_(memory=141 * 2 ** 30))
    plan = spdsl.plan(spdsl.sp_shard(seq=P, attention=h200)(model), ids, ids, fit=True)
    assert plan.remat.budget == 141 * 2 ** 30 - sum(fit.reserve_parts(141 * 2 ** 30).values())
