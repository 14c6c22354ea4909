"""A checkpoint saved with parameters split over a dp=2 x sp=2 mesh (4 ranks) loads on
dp=1 x sp=4, on sp=2 (2 ranks) and in one process into plain tensors, every value exactly as
saved; training resumed on the same mesh is bitwise the uninterrupted run, and on another mesh
within 1e-5 of it (fp32, a few AdamW steps). A checkpoint of replicated plain parameters
saved by 4 ranks loads split over 2."""

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
    draw = torch.rand(3)                   # from the generator state the load restored
    loaded = full_state(model, opt)
    train(step_fn, model, opt, start + 1, LAST)
    return {"start": start, "loaded": loaded, "final": weights(model), "draw": draw}


def _load_only(root: str, dp: int, sp: int) -> dict:
    model = build(seed=5)
    if dp * sp > 1:
        sharded(model, dp, sp)
    opt = optimizer(model)
    spdsl.load_checkpoint(root, model, opt)
    return full_state(model, opt)


def run_four(rank: int, world: int, root: str, plain_root: str) -> dict | None:
    # replicated plain parameters, as sp_shard without shard_state holds them
    plain = build()
    plain_opt = optimizer(plain)
    train(plain, plain, plain_opt, 1, 2)
    spdsl.save_checkpoint(plain_root, plain, plain_opt, step=2)
    plain_saved = full_state(plain, plain_opt)

    model = build()
    step_fn = sharded(model, 2, 2)
    opt = optimizer(model)
    train(step_fn, model, opt, 1, SAVED_AT)
    torch.manual_seed(1000 + rank)         # a generator state of its own on every rank
    spdsl.save_checkpoint(root, model, opt, step=SAVED_AT)
    draw = torch.rand(3)
    saved = full_state(model, opt)
    train(step_fn, model, opt, SAVED_AT + 1, LAST)
    final = weights(model)
    # back into the same model and optimizer, whose program is already traced
    spdsl.load_checkpoint(root, model, opt)
    train(step_fn, model, opt, SAVED_AT + 1, LAST)
    out = {"saved": saved, "final": final, "in_place": {"final": weights(model)},
           "plain_saved": plain_saved,
           "dp2_sp2": _resume(root, 2, 2), "dp1_sp4": _resume(root, 1, 4)}
    rng = torch.equal(out["dp2_sp2"]["draw"], draw) and torch.equal(out["dp1_sp4"]["draw"], draw)
    return out if rank == 0 else {"rng_restored": rng}


def run_two(rank: int, world: int, root: str, plain_root: str) -> dict | None:
    out = _resume(root, 1, 2)
    out["plain_loaded"] = _load_only(plain_root, 1, 2)
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root, plain_root = (str(tmp_path_factory.mktemp(n)) for n in ("ckpt", "plain"))
    per_rank = spawn(run_four, 4, root, plain_root)
    four = per_rank[0]
    four["rng_restored"] = [r["rng_restored"] for r in per_rank[1:]]
    two = spawn(run_two, 2, root, plain_root)[0]
    one = _resume(root, 1, 1)              # this process: no process group, plain tensors
    return {"reference": four, "dp2_sp2": four["dp2_sp2"], "dp1_sp4": four["dp1_sp4"],
            "in_place": four["in_place"], "sp2": two, "single": one}


MESHES = ["dp2_sp2", "dp1_sp4", "sp2", "single"]


def _assert_same_state(have: dict, want: dict, n_params: int) -> None:
    assert have.keys() == want.keys()
    n_tensors = 0
    for k, w in want.items():
        if isinstance(w, torch.Tensor):
            n_tensors += 1
            assert have[k].shape == w.shape and torch.equal(have[k], w), k
        else:
            assert have[k] == w, k
    assert n_tensors >= 3 * n_params          # weights, exp_avg, exp_avg_sq (and steps)


@pytest.mark.parametrize("mesh", MESHES)
def test_loaded_state_equals_saved_state(runs, mesh):
    assert runs[mesh]["start"] == SAVED_AT
    _assert_same_state(runs[mesh]["loaded"], runs["reference"]["saved"],
                       len(runs["reference"]["final"]))


def test_every_rank_gets_its_own_rng_state_back(runs):
    assert runs["reference"]["rng_restored"] == [True, True, True]     # ranks 1-3 of 4
    want = torch.rand(3, generator=torch.Generator().manual_seed(1000))   # rank 0's
    for mesh in MESHES:
        assert torch.equal(runs[mesh]["draw"], want), mesh


def test_replicated_parameters_load_into_sharded_ones(runs):
    # saved by 4 ranks holding plain (replicated) parameters, loaded split over 2
    _assert_same_state(runs["sp2"]["plain_loaded"], runs["reference"]["plain_saved"],
                       len(runs["reference"]["final"]))


@pytest.mark.parametrize("run", ["dp2_sp2", "in_place"])
def test_resumed_on_the_same_mesh_is_bitwise(runs, run):
    want, have = runs["reference"]["final"], runs[run]["final"]
    assert [n for n in want if not torch.equal(have[n], want[n])] == []


@pytest.mark.parametrize("mesh", ["dp1_sp4", "sp2", "single"])
def test_resumed_on_another_mesh_matches(runs, mesh):
    want, have = runs["reference"]["final"], runs[mesh]["final"]
    errs = {n: ((have[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want}
    worst = max(errs, key=errs.get)
    print(f"{mesh}: max weight rel err after {LAST - SAVED_AT} steps {errs[worst]:.1e} ({worst})")
    assert errs[worst] <= ACROSS_MESH_RTOL, f"{mesh} {worst}: rel err {errs[worst]:.2e}"
