"""Unchanged Hugging Face causal LMs under ``sp_shard(seq=P)``: loss and every parameter
gradient equal single-device PyTorch (fp32): at SP 2 in SDPA and eager attention, on plain,
padded (right and left) and packed batches, at SP 4 one plain batch per family; the Ulysses all-to-alls really run (counted
at the process group), two per layer forward and two backward. One launch per degree."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")

from tests.dist import spawn
from tests.hf.cases import TEST_CASES, expected_all_to_alls, one_per_family, run_all

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"sp{w}")
def results(request):
    world = request.param
    only = os.environ.get("SPDSL_HF_ONLY")      # rerun a subset: the names containing it
    skip = os.environ.get("SPDSL_HF_SKIP")      # or leave out the names containing this
    cases = [c for c in TEST_CASES if (not only or only in c.name)
             and not (skip and skip in c.name)]
    if world > 2:
        cases = one_per_family(cases)
    per_rank = spawn(run_all, world, cases, timeout=3000)
    save(world, per_rank)
    return world, per_rank


def save(world: int, per_rank: list) -> None:
    """With ``SPDSL_HF_RESULTS=dir``, keep the raw results for ``python -m tests.hf.matrix
    --from dir`` (the docs table of what the tests ran)."""
    out = os.environ.get("SPDSL_HF_RESULTS")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"sp{world}_{len(per_rank[0])}.json"), "w") as fh:
            json.dump(per_rank, fh)


def check(world: int, per_rank: list, name: str) -> None:
    if name not in per_rank[0]:
        pytest.skip(f"SP {world} runs one plain case per family; SP 2 runs every case")
    if "skip" in per_rank[0][name]:
        pytest.skip(per_rank[0][name]["skip"])
    for r, res in enumerate(per_rank):
        out = res[name]
        assert "error" not in out, f"sp{world} rank {r}: {out['error']}"
        assert out["missing"] == [] and out["extra"] == [], out
        assert out["n_grads"] > 0
        assert out["loss"] <= LOSS_RTOL, f"sp{world} rank {r}: loss rel err {out['loss']:.2e}"
        assert out["grad"] <= GRAD_RTOL, \
            f"sp{world} rank {r}: grad rel err {out['grad']:.2e} ({out['worst']})"
        assert out["all_to_all"] == expected_all_to_alls(name, world), \
            f"sp{world} rank {r}: {out['all_to_all']} all-to-alls ran"
    assert len({res[name]["loss_value"] for res in per_rank}) == 1


@pytest.mark.parametrize("name", [c.name for c in TEST_CASES])
def test_loss_gradients_and_all_to_alls(results, name):
    world, per_rank = results
    check(world, per_rank, name)


def test_dropout_trains(results):
    """Dropout under SP draws from a different random stream than one device (each rank
    masks its own local piece): not the same bits, but it trains."""
    _world, per_rank = results
    for res in per_rank:
        out = res["dropout"]
        assert "error" not in out, out.get("error")
        assert out["last"] < 0.5 * out["first"], out
