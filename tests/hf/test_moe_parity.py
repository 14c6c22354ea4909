"""Unchanged Hugging Face mixture-of-experts causal LMs under ``sp_shard(seq=P)``: loss, the
load-balancing loss inside it and every parameter gradient equal single-device PyTorch (fp32)
at SP 2 (at SP 4 one plain case per family). Mixtral and Qwen3-MoE in each experts implementation (``eager``,
``batched_mm``, ``grouped_mm``), under ``remat="full"``, on a padded batch and with sharded
state (``shard_state=True``); Qwen2-MoE, OLMoE, DeepSeek-V3, gpt-oss and the hybrids (Qwen3-Next,
Kimi-Linear, MiniMax, Jamba, Granite 4 hybrid, DeepSeek-V3.2) in their default experts. Each
rank runs the experts on its own tokens (one ``token_wise`` node per layer, no collective in
the MoE layers); the router's statistics are global (a load-balancing loss from one rank's
tokens would be 0.1-2.4% off, far outside the tolerance; transformers 5.23 counts them with
``histc``, 5.17 with ``bincount``). One launch per degree."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.dist import spawn
from tests.hf.cases import one_per_family
from tests.hf.families import LAYERS
from tests.hf.moe_cases import (
    BIAS_BALANCED,
    MOE_CASES,
    experts_modules,
    records_router_logits,
    run_moe_all,
)

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"sp{w}")
def results(request):
    world = request.param
    cases = MOE_CASES if world == 2 else one_per_family(MOE_CASES)
    return world, spawn(run_moe_all, world, cases, timeout=3000)


def _ran(world: int, per_rank: list, name: str) -> None:
    if name not in per_rank[0]:
        pytest.skip(f"SP {world} runs one plain case per family; SP 2 runs every case")


@pytest.mark.parametrize("name", [c.name for c in MOE_CASES])
def test_loss_aux_loss_and_gradients(results, name):
    world, per_rank = results
    _ran(world, per_rank, name)
    for r, res in enumerate(per_rank):
        out = res[name]
        assert "error" not in out, f"sp{world} rank {r}: {out['error']}"
        assert out["missing"] == [] and out["extra"] == [], out
        assert out["n_grads"] > 0
        assert out["loss"] <= LOSS_RTOL, f"sp{world} rank {r}: loss rel err {out['loss']:.2e}"
        assert out["aux"] <= LOSS_RTOL, f"sp{world} rank {r}: aux loss rel err {out['aux']:.2e}"
        assert out["grad"] <= GRAD_RTOL, \
            f"sp{world} rank {r}: grad rel err {out['grad']:.2e} ({out['worst']})"
    assert len({res[name]["loss_value"] for res in per_rank}) == 1


@pytest.mark.parametrize("name", [c.name for c in MOE_CASES])
def test_router_statistics_are_global(results, name):
    """The load-balancing loss from each rank's own tokens is measurably different: a run that
    reduced only local statistics would fail the parity test above."""
    world, per_rank = results
    _ran(world, per_rank, name)
    family = name.split("/")[0]
    if family in BIAS_BALANCED:
        pytest.skip(f"{family} has no load-balancing loss (it balances by a bias)")
    if not records_router_logits(family):
        import transformers
        pytest.skip(f"transformers {transformers.__version__} records no router logits for "
                    f"{family}: no load-balancing loss to compare")
    for res in per_rank:
        assert res[name]["aux_local"] > 100 * LOSS_RTOL, res[name]["aux_local"]


@pytest.mark.parametrize("name", [c.name for c in MOE_CASES])
def test_experts_run_token_wise_without_collectives(results, name):
    """Each layer's experts are one token_wise node; nothing in the MoE layers moves data
    (no all-gather of the sequence, no all-to-all): only their parameters' gradients are
    reduced, in the gradient buckets."""
    world, per_rank = results
    _ran(world, per_rank, name)
    for res in per_rank:
        assert res[name]["token_wise"] == experts_modules(name.split("/")[0], LAYERS)
        assert res[name]["moe_collectives"] == []
        # sharded state: the layers' parameters are gathered and their gradients scattered
        assert (res[name]["moe_state_collectives"] > 0) == ("shard_state" in name)
