"""Checkpoints in one process, without a process group (DCP's no-dist path): what is saved
comes back exactly, training resumed from a checkpoint is bitwise the uninterrupted run, and
only complete checkpoints are ever loaded."""

from __future__ import annotations

import os

import pytest
import torch

import spdsl
from spdsl.checkpoint import latest_checkpoint
from tests.checkpoint._train import build, full_state, optimizer, train, weights


def _equal(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor)
                                 else a[k] == b[k])]


def test_round_trip_restores_every_tensor(tmp_path):
    model = build()
    opt = optimizer(model)
    train(model, model, opt, 1, 2)
    path = spdsl.save_checkpoint(tmp_path, model, opt, step=2, extra={"tokens": 128})
    assert os.path.basename(path) == "step_00000002"
    saved = full_state(model, opt)
    model2 = build(seed=1)
    opt2 = optimizer(model2)
    extra = {"tokens": 0}
    assert spdsl.load_checkpoint(tmp_path, model2, opt2, extra=extra) == 2
    assert extra == {"tokens": 128}
    assert _equal(full_state(model2, opt2), saved) == []


def test_resumed_training_is_bitwise_the_uninterrupted_run(tmp_path):
    ref = build()
    ref_opt = optimizer(ref)
    train(ref, ref, ref_opt, 1, 5)

    model = build()
    opt = optimizer(model)
    train(model, model, opt, 1, 2)
    spdsl.save_checkpoint(tmp_path, model, opt, step=2)
    del model, opt
    model = build(seed=7)
    opt = optimizer(model)
    start = spdsl.load_checkpoint(tmp_path, model, opt)
    train(model, model, opt, start + 1, 5)
    assert _equal(weights(model), weights(ref)) == []


def test_a_checkpoint_before_the_first_step_changes_nothing(tmp_path):
    # get_state_dict fills an empty AdamW state (step=1); saving must not leave that behind
    ref = build()
    ref_opt = optimizer(ref)
    train(ref, ref, ref_opt, 1, 3)
    model = build()
    opt = optimizer(model)
    spdsl.save_checkpoint(tmp_path, model, opt, step=0)
    assert not opt.state
    train(model, model, opt, 1, 3)
    assert _equal(weights(model), weights(ref)) == []
    again = build(seed=3)
    opt = optimizer(again)
    assert spdsl.load_checkpoint(tmp_path / "step_00000000", again, opt) == 0
    assert not opt.state
    train(again, again, opt, 1, 3)
    assert _equal(weights(again), weights(ref)) == []


def test_rng_state_comes_back(tmp_path):
    model = build()
    torch.manual_seed(123)
    spdsl.save_checkpoint(tmp_path, model, step=1)
    want = torch.rand(5)
    torch.manual_seed(0)
    spdsl.load_checkpoint(tmp_path, model)
    assert torch.equal(torch.rand(5), want)


def test_only_complete_checkpoints_are_loaded(tmp_path):
    model = build()
    opt = optimizer(model)
    assert latest_checkpoint(tmp_path) is None
    assert spdsl.load_checkpoint(tmp_path, model, opt) is None
    train(model, model, opt, 1, 1)
    spdsl.save_checkpoint(tmp_path, model, opt, step=5)
    # a save that died before its rename, and a directory without DCP's metadata: newer, ignored
    (tmp_path / ".step_00000009.tmp").mkdir()
    (tmp_path / ".step_00000009.tmp" / ".metadata").write_bytes(b"")
    (tmp_path / "step_00000010").mkdir()
    assert latest_checkpoint(tmp_path) == str(tmp_path / "step_00000005")
    other = build(seed=1)
    assert spdsl.load_checkpoint(tmp_path, other, optimizer(other)) == 5
    # the next save clears the crashed one; keep=2 prunes the oldest complete ones
    for step in (6, 7, 8):
        spdsl.save_checkpoint(tmp_path, model, opt, step=step, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step_00000007", "step_00000008", "step_00000010"]


def test_saving_the_same_step_again_replaces_it(tmp_path):
    model = build()
    opt = optimizer(model)
    train(model, model, opt, 1, 1)
    spdsl.save_checkpoint(tmp_path, model, opt, step=1)
    train(model, model, opt, 2, 2)
    spdsl.save_checkpoint(tmp_path, model, opt, step=1)
    other = build(seed=2)
    spdsl.load_checkpoint(tmp_path, other)
    assert _equal(weights(other), weights(model)) == []


def test_a_sharded_module_wrapper_is_accepted(tmp_path):
    model = build()
    spdsl.save_checkpoint(tmp_path, spdsl.sp_shard(seq=2)(model), step=1)
    other = build(seed=4)
    assert spdsl.load_checkpoint(tmp_path, spdsl.sp_shard(seq=2)(other)) == 1
    assert _equal(weights(other), weights(model)) == []


def test_loading_optimizer_state_that_was_not_saved_says_so(tmp_path):
    model = build()
    spdsl.save_checkpoint(tmp_path, model, step=1)
    with pytest.raises(spdsl.ShardingError, match="no optimizer state"):
        spdsl.load_checkpoint(tmp_path, model, optimizer(model))


def test_scheduler_state_travels_in_extra(tmp_path):
    model = build()
    opt = optimizer(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        train(model, model, opt, 1, 1)
        sched.step()
    spdsl.save_checkpoint(tmp_path, model, opt, step=3, extra={"sched": sched.state_dict()})
    other = build(seed=1)
    opt2 = optimizer(other)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    extra = {"sched": sched2.state_dict()}
    spdsl.load_checkpoint(tmp_path, other, opt2, extra=extra)
    sched2.load_state_dict(extra["sched"])
    assert sched2.state_dict() == sched.state_dict()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 1e-2 * 0.5
