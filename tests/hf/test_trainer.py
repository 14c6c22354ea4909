"""``spdsl.hf.sequence_parallel`` on a Hugging Face ``Trainer`` at SP 2 (2 gloo ranks) logs
what the same job logs in one process: every loss, eval loss, gradient norm, learning rate
and token count, and ends at the same weights (``tests/hf/trainer_job.py``: a tiny Llama,
padded rows, two micro-batches a step, warm-up + cosine, clipping, evaluation on rows of a
length two ranks do not divide). The plain Trainer on the same two ranks (DDP: the ranks read
different rows) does not, so the comparison can fail.

In the same launch (``tests/hf/trainer_state_job.py``): a run resumed from the Trainer's own
checkpoint logs and ends where the uninterrupted run does, bit for bit; ``save_model`` writes
an ordinary Hugging Face checkpoint (whole tensors in safetensors) that ``from_pretrained``
loads in one process, also with ``shard_state=True``, which logs the one-process numbers too;
and a LoRA model (``peft``) logs the one-process numbers, with the same LoRA gradients at
step 1 and the same final LoRA weights, with and without ``shard_state=True``. One launch.

A second launch on 3 ranks (``seq=3``: every parameter split unevenly, over other ranks than
it was saved from) resumes the ``shard_state=True`` run from its step-3 checkpoint: its
``sharded_state`` folder reshards, and steps 4-6 log the numbers of the uninterrupted 2-rank
run and end at its weights; an earlier version's per-rank files are refused."""

from __future__ import annotations

import os
import tempfile

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate (pip install -e '.[hf]')")

import torch
from packaging.version import Version

import spdsl
from tests._util import assert_close
from tests.dist import spawn
from tests.hf.trainer_job import MAX_GRAD_NORM, make_trainer, run
from tests.hf.trainer_state_job import (
    first_gradients,
    lora_model,
    lora_run,
    on_other_ranks,
    on_ranks,
)

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

LOSS_RTOL, GRAD_NORM_RTOL, WEIGHT_RTOL = 1e-4, 1e-3, 1e-3
# a run resumed at step 3 of 6 logs train_loss as the sum of the losses of steps 4-6 divided by
# the steps trained since the resume (transformers 5.19 and later) or the global step (5.17,
# 5.18)
_RESUMED_STEPS = 3 if Version(transformers.__version__) >= Version("5.19") else 6


def _on_ranks(rank: int, world: int, root: str) -> dict:
    out = on_ranks(world, root)
    for kind, kw in (("degree", {"seq": 3}), ("mesh", {"seq": 2, "batch": "global"})):
        try:                                          # settings that must raise
            spdsl.hf.sequence_parallel(make_trainer(), **kw)
        except Exception as e:  # noqa: BLE001 - the test reads the type and the message
            out[kind] = (type(e).__name__, str(e))
    out["sp"] = out["whole"]
    out["ddp"] = run(make_trainer(max_steps=2))["logs"]
    return out


@pytest.fixture(scope="module")
def jobs():
    one = run(make_trainer())
    ranks = spawn(_on_ranks, 2, _ROOT.name, timeout=1500)
    return one, ranks


_ROOT = tempfile.TemporaryDirectory()      # the ranks' checkpoints and saved models


def _on_other_ranks(rank: int, world: int, root: str) -> dict:
    return on_other_ranks(world, root)


@pytest.fixture(scope="module")
def other_ranks(jobs):
    """The 2-rank checkpoints of ``jobs`` resumed on 3 ranks."""
    return spawn(_on_other_ranks, 3, _ROOT.name, timeout=1500)


@pytest.fixture(scope="module")
def lora_one():
    pytest.importorskip("peft", reason="LoRA models are peft's (pip install peft)")
    grads = first_gradients()
    return lora_run(make_trainer(model=lora_model(), callbacks=[grads]), grads)


def _pairs(one: list, other: list, key: str) -> list[tuple[float, float]]:
    a = [e[key] for e in one if key in e]
    b = [e[key] for e in other if key in e]
    assert len(a) == len(b), f"{key}: {len(a)} logged in one process, {len(b)} on sp ranks"
    return list(zip(a, b))


def test_logs_match_one_process(jobs):
    one, ranks = jobs
    ref, sp = one["logs"], ranks[0]["sp"]["logs"]
    assert ranks[0]["sp"]["programs"] == 2            # a training and an evaluation program
    for key, rtol in (("loss", LOSS_RTOL), ("eval_loss", LOSS_RTOL),
                      ("grad_norm", GRAD_NORM_RTOL), ("train_loss", LOSS_RTOL)):
        for i, (a, b) in enumerate(_pairs(ref, sp, key)):
            assert abs(a - b) <= rtol * abs(a), f"{key} #{i}: one process {a}, sp {b}"
    for key in ("learning_rate", "num_input_tokens_seen", "step", "total_flos"):
        assert _pairs(ref, sp, key) == [(a, a) for a, _ in _pairs(ref, sp, key)], key
    # the job is not trivial: 6 losses, 2 evaluations, clipping bites, warm-up then decay
    assert len(_pairs(ref, sp, "loss")) == 6 and len(_pairs(ref, sp, "eval_loss")) == 2
    assert all(a > MAX_GRAD_NORM for a, _ in _pairs(ref, sp, "grad_norm"))
    lrs = [a for a, _ in _pairs(ref, sp, "learning_rate")]
    assert lrs[0] < lrs[2] and lrs[2] > lrs[5] > 0
    assert ranks[1]["sp"]["logs"] == sp


def test_tokens_counted_once(jobs):
    _, ranks = jobs
    train = make_trainer().train_dataset
    seen = [e["num_input_tokens_seen"] for e in ranks[0]["sp"]["logs"]
            if "loss" in e and "num_input_tokens_seen" in e]
    # 6 steps x 2 micro-batches x 4 rows, every non-padding token once
    assert seen[-1] <= sum(int(r["attention_mask"].sum()) for r in train.rows)
    assert seen[-1] > 6 * 2 * 4 * 16


def test_weights_match_one_process(jobs):
    one, ranks = jobs
    for name, expected in one["weights"].items():
        tol = WEIGHT_RTOL * float(expected.abs().max())
        assert_close(ranks[0]["sp"]["weights"][name], expected, rtol=WEIGHT_RTOL, atol=tol,
                     name=name)
        assert torch.equal(ranks[0]["sp"]["weights"][name], ranks[1]["sp"]["weights"][name])
    start = make_trainer().model.state_dict()
    assert any((one["weights"][k] - start[k]).abs().max() > 1e-3 for k in start)


def test_plain_trainer_on_two_ranks_differs(jobs):
    """DDP splits the rows over the ranks: not the one-process job (what the SP run must not
    do)."""
    one, ranks = jobs
    a, b = one["logs"][0], ranks[0]["ddp"][0]              # step 1 of each
    assert abs(a["loss"] - b["loss"]) > 5 * LOSS_RTOL * a["loss"]   # measured: 8.1e-4 relative
    # the two ranks read the rows of one process's steps 1 and 2 (both counted)
    assert b["num_input_tokens_seen"] == one["logs"][1]["num_input_tokens_seen"]


def test_settings_that_raise(jobs):
    _, ranks = jobs
    kind, msg = ranks[0]["degree"]
    assert kind == "ShardingError" and "seq=3 with 2 ranks" in msg
    kind, msg = ranks[0]["mesh"]
    assert kind == "ShardingError" and "leave out mesh= and batch=" in msg


def _same_logs(ref: list, got: list, what: str) -> None:
    for key, rtol in (("loss", LOSS_RTOL), ("eval_loss", LOSS_RTOL),
                      ("grad_norm", GRAD_NORM_RTOL), ("train_loss", LOSS_RTOL)):
        for i, (a, b) in enumerate(_pairs(ref, got, key)):
            assert abs(a - b) <= rtol * abs(a), f"{what} {key} #{i}: one process {a}, sp {b}"
    for key in ("learning_rate", "num_input_tokens_seen", "step", "total_flos"):
        assert _pairs(ref, got, key) == [(a, a) for a, _ in _pairs(ref, got, key)], (what, key)
    assert len(_pairs(ref, got, "loss")) == 6 and len(_pairs(ref, got, "eval_loss")) == 2


def _same_weights(ref: dict, got: dict, what: str) -> None:
    assert set(got) >= set(ref), what
    for name, expected in ref.items():
        tol = WEIGHT_RTOL * float(expected.abs().max())
        assert_close(got[name], expected, rtol=WEIGHT_RTOL, atol=tol, name=f"{what} {name}")


def test_resume_equals_the_uninterrupted_run(jobs):
    _, ranks = jobs
    full, resumed = ranks[0]["whole"], ranks[0]["whole_resumed"]
    after = [dict(e) for e in full["logs"] if e["step"] > 3]
    new = [dict(e) for e in resumed["logs"] if e["step"] > 3]   # 1-3: the checkpoint's state
    # train_loss: the Trainer's, from the losses of steps 4-6 (one process too)
    tail = [e["loss"] for e in after if "loss" in e]
    assert abs(new[-1].pop("train_loss") - sum(tail) / _RESUMED_STEPS) <= LOSS_RTOL * tail[0]
    after[-1].pop("train_loss")
    assert new == after and len(tail) == 3
    for k, v in full["weights"].items():
        assert torch.equal(resumed["weights"][k], v), k


def test_sharded_resume_on_other_ranks(jobs, other_ranks):
    """Saved on 2 ranks, resumed on 3: steps 4-6 are the uninterrupted 2-rank run's (the
    step is exact at any number of ranks, so within the parity tolerances, not bit for
    bit)."""
    _, ranks = jobs
    name = "sharded"
    full, resumed = ranks[0][name], other_ranks[0][name]
    # the shards in spdsl's checkpoint, no optimizer.pt
    assert "sharded_state" in full["files"] and "optimizer.pt" not in full["files"]
    after = [e for e in full["logs"] if e["step"] > 3]
    new = [e for e in resumed["logs"] if e["step"] > 3]
    assert [sorted(e) for e in new] == [sorted(e) for e in after] and len(new) == 5
    for key, rtol in (("loss", LOSS_RTOL), ("eval_loss", LOSS_RTOL),
                      ("grad_norm", GRAD_NORM_RTOL)):
        for i, (a, b) in enumerate(_pairs(after, new, key)):
            assert abs(a - b) <= rtol * abs(a), f"{name} {key} #{i}: 2 ranks {a}, 3 ranks {b}"
    for key in ("learning_rate", "num_input_tokens_seen", "step", "total_flos"):
        assert _pairs(after, new, key) == [(a, a) for a, _ in _pairs(after, new, key)], key
    tail = [e["loss"] for e in after if "loss" in e]
    assert abs(new[-1]["train_loss"] - sum(tail) / _RESUMED_STEPS) <= LOSS_RTOL * tail[0]
    _same_weights(full["weights"], resumed["weights"], f"{name} on 3 ranks")
    assert other_ranks[2][name]["logs"] == resumed["logs"]


def test_sharded_checkpoint_resumes_in_one_process(jobs):
    """Saved with shard_state=True on 2 ranks, resumed in one process (where
    ``sequence_parallel`` changes nothing else): the optimizer state comes from the shards,
    resharded whole, so steps 4-6 are the uninterrupted run's; the Trainer's own loading would
    find no optimizer.pt and go on with a fresh optimizer."""
    from tests.hf.trainer_job import result
    _, ranks = jobs
    full = ranks[0]["sharded"]
    trainer = spdsl.hf.sequence_parallel(
        make_trainer(out=os.path.join(_ROOT.name, "sharded_one")), seq=2, shard_state=True)
    trainer.train(resume_from_checkpoint=os.path.join(_ROOT.name, "sharded", "checkpoint-3"))
    resumed = result(trainer)
    after = [e for e in full["logs"] if e["step"] > 3]
    new = [e for e in resumed["logs"] if e["step"] > 3]
    assert len(new) == len(after) == 5
    for key, rtol in (("loss", LOSS_RTOL), ("eval_loss", LOSS_RTOL),
                      ("grad_norm", GRAD_NORM_RTOL)):
        for i, (a, b) in enumerate(_pairs(after, new, key)):
            assert abs(a - b) <= rtol * abs(a), f"{key} #{i}: 2 ranks {a}, one process {b}"
    _same_weights(full["weights"], resumed["weights"], "sharded, resumed in one process")


def test_earlier_sharded_checkpoint_refused(other_ranks):
    kind, msg = other_ranks[0]["old"]
    assert kind == "ShardingError" and "[sharded resume]" in msg
    assert "optimizer.rank<R>.pt files of an earlier version" in msg


def test_sharded_state_matches_one_process(jobs):
    one, ranks = jobs
    _same_logs(one["logs"], ranks[0]["sharded"]["logs"], "shard_state")
    _same_weights(one["weights"], ranks[0]["sharded"]["weights"], "shard_state")
    assert ranks[1]["sharded"]["logs"] == ranks[0]["sharded"]["logs"]


@pytest.mark.parametrize("name", ["whole", "sharded"])
def test_saved_model_loads_in_one_process(jobs, name):
    from transformers import AutoModelForCausalLM
    _, ranks = jobs
    final = os.path.join(_ROOT.name, name, "final")
    assert "model.safetensors" in os.listdir(final)
    saved = AutoModelForCausalLM.from_pretrained(final).state_dict()
    trained = ranks[0][name]["weights"]
    assert set(saved) == set(trained)
    for k, v in saved.items():
        assert v.shape == trained[k].shape and torch.equal(v, trained[k]), k


@pytest.mark.parametrize("name", ["lora", "lora_sharded"])
def test_lora_matches_one_process(jobs, lora_one, name):
    _, ranks = jobs
    ref, got = lora_one, ranks[0][name]
    assert got["sharded"] == (name == "lora_sharded")
    if got["sharded"]:
        assert {"adapter_model.safetensors", "sharded_state"} <= set(got["files"])
    _same_logs(ref["logs"], got["logs"], name)
    assert ref["grads"] and set(ref["grads"]) == set(got["grads"])
    assert all("lora_" in n for n in got["grads"])           # the base model stays frozen
    for n, g in ref["grads"].items():
        assert g.abs().max() > 0, n
        assert_close(got["grads"][n], g, rtol=GRAD_NORM_RTOL,
                     atol=GRAD_NORM_RTOL * float(g.abs().max()), name=n)
    _same_weights(ref["weights"], got["weights"], name)
    start = lora_model().state_dict()
    assert any((ref["weights"][k] - start[k]).abs().max() > 1e-3 for k in ref["weights"])
