"""A checkpoint saved with parameters split over a dp=2 x sp=2 mesh (4 ranks) loads on
dp=1 x sp=4, on sp=2 (2 ranks) and in one process into plain tensors, every value exactly as
saved; training resumed on the same mesh is bitwise the uninterrupted run, and on another mesh
within 1e-5 of it (fp32, a few AdamW steps)."""

from __future__ import annotations

import pytest
import torch

import spdsl
from tests.checkpoint._train import build, full_state, optimizer, sharded, train, weights
from tests.dist import spawn

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

SAVED_AT, LAST = 3, 6
ACROSS_MESH_RTOL = 1e-5


def _resume(root: str, dp: int, sp: int) -> dict:
    model = build(seed=5)          # other weights: the load must overwrite every one
    step_fn = sharded(model, dp, sp) if dp * sp > 1 else model
    opt = optimizer(model)
    start = spdsl.load_checkpoint(root, model, opt)
    loaded = full_state(model, opt)
    train(step_fn, model, opt, start + 1, LAST)
    return {"start": start, "loaded": loaded, "final": weights(model)}


def run_four(rank: int, world: int, root: str) -> dict | None:
    model = build()
    step_fn = sharded(model, 2, 2)
    opt = optimizer(model)
    train(step_fn, model, opt, 1, SAVED_AT)
    spdsl.save_checkpoint(root, model, opt, step=SAVED_AT)
    saved = full_state(model, opt)
    train(step_fn, model, opt, SAVED_AT + 1, LAST)
    out = {"saved": saved, "final": weights(model),
           "dp2_sp2": _resume(root, 2, 2), "dp1_sp4": _resume(root, 1, 4)}
    return out if rank == 0 else None


def run_two(rank: int, world: int, root: str) -> dict | None:
    out = _resume(root, 1, 2)
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    four = spawn(run_four, 4, root)[0]
    two = spawn(run_two, 2, root)[0]
    one = _resume(root, 1, 1)              # this process: no process group, plain tensors
    return {"reference": four, "dp2_sp2": four["dp2_sp2"], "dp1_sp4": four["dp1_sp4"],
            "sp2": two, "single": one}


MESHES = ["dp2_sp2", "dp1_sp4", "sp2", "single"]


@pytest.mark.parametrize("mesh", MESHES)
def test_loaded_state_equals_saved_state(runs, mesh):
    saved, got = runs["reference"]["saved"], runs[mesh]
    assert got["start"] == SAVED_AT
    assert got["loaded"].keys() == saved.keys()
    n_tensors = 0
    for k, want in saved.items():
        have = got["loaded"][k]
        if isinstance(want, torch.Tensor):
            n_tensors += 1
            assert have.shape == want.shape and torch.equal(have, want), k
        else:
            assert have == want, k
    assert n_tensors >= 3 * len(runs["reference"]["final"])   # weights, exp_avg, exp_avg_sq


def test_resumed_on_the_same_mesh_is_bitwise(runs):
    want, have = runs["reference"]["final"], runs["dp2_sp2"]["final"]
    assert [n for n in want if not torch.equal(have[n], want[n])] == []


@pytest.mark.parametrize("mesh", ["dp1_sp4", "sp2", "single"])
def test_resumed_on_another_mesh_matches(runs, mesh):
    want, have = runs["reference"]["final"], runs[mesh]["final"]
    for n in want:
        err = ((have[n] - want[n]).abs().max() / want[n].abs().max()).item()
        assert err <= ACROSS_MESH_RTOL, f"{mesh} {n}: rel err {err:.2e}"
