"""``spdsl.hf.sequence_parallel`` at dp 2 x sp 2 (4 gloo ranks) logs what one process logs at
twice the batch (``tests/hf/trainer_job.py``; the fair reference, as plain DDP at dp 2 equals
it): every loss, eval loss, gradient norm, learning rate, token count and ``total_flos``, on
every rank, and ends at the same weights. Its evaluation set (10 rows) is not a multiple of
dp x batch (8): the last evaluation step is filled up with rows of the set, which must not
count. In the same launch, TRL's ``SFTTrainer`` with packing (``tests/hf/sft_job.py``) against
one process at twice the batch. One launch."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate (pip install -e '.[hf]')")

import torch

import spdsl
from tests._util import assert_close
from tests.dist import spawn
from tests.hf.test_trainer import GRAD_NORM_RTOL, LOSS_RTOL, WEIGHT_RTOL, _pairs
from tests.hf.trainer_job import make_trainer, run

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


EVAL_ROWS = 10          # not a multiple of dp x batch = 8


def _has_trl() -> bool:
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def _on_ranks(rank: int, world: int) -> dict:
    trainer = spdsl.hf.sequence_parallel(make_trainer(batch=4, eval_rows=EVAL_ROWS), seq=2,
                                         debug=True)
    out = run(trainer)
    if _has_trl():
        from tests.hf import sft_job
        out["sft"] = run(spdsl.hf.sequence_parallel(sft_job.make_trainer(eval_docs=16), seq=2))
    return out


@pytest.fixture(scope="module")
def jobs():
    return run(make_trainer(batch=8, eval_rows=EVAL_ROWS)), spawn(_on_ranks, 4, timeout=900)


@pytest.fixture(scope="module")
def sft_one():
    pytest.importorskip("trl", reason="SFTTrainer is TRL's (pip install trl)")
    pytest.importorskip("datasets", reason="SFTTrainer takes a datasets.Dataset")
    from tests.hf import sft_job
    return run(sft_job.make_trainer(batch=4, eval_docs=16))


def test_logs_match_one_process_at_twice_the_batch(jobs):
    one, ranks = jobs
    ref, got = one["logs"], ranks[0]["logs"]
    for key, rtol in (("loss", LOSS_RTOL), ("eval_loss", LOSS_RTOL),
                      ("grad_norm", GRAD_NORM_RTOL), ("train_loss", LOSS_RTOL)):
        for i, (a, b) in enumerate(_pairs(ref, got, key)):
            assert abs(a - b) <= rtol * abs(a), f"{key} #{i}: one process {a}, dp x sp {b}"
    for key in ("learning_rate", "num_input_tokens_seen", "step", "total_flos"):
        assert _pairs(ref, got, key) == [(a, a) for a, _ in _pairs(ref, got, key)], key
    assert len(_pairs(ref, got, "loss")) == 6 and len(_pairs(ref, got, "eval_loss")) == 2
    # dp groups that read the same rows would log 2 x 171 tokens at step 1, not 379
    assert all(r["logs"] == got for r in ranks)


def test_weights_match_one_process(jobs):
    one, ranks = jobs
    for name, expected in one["weights"].items():
        tol = WEIGHT_RTOL * float(expected.abs().max())
        for r in ranks:
            assert_close(r["weights"][name], expected, rtol=WEIGHT_RTOL, atol=tol, name=name)


def test_sft_matches_one_process_at_twice_the_batch(jobs, sft_one):
    """Packing at dp 2 x sp 2: 16 evaluation documents, 8 packed rows (a multiple of dp x 2)."""
    _, ranks = jobs
    ref, got = sft_one["logs"], ranks[0]["sft"]["logs"]
    for key, rtol in (("loss", LOSS_RTOL), ("eval_loss", LOSS_RTOL), ("entropy", LOSS_RTOL),
                      ("eval_entropy", LOSS_RTOL), ("grad_norm", GRAD_NORM_RTOL)):
        for i, (a, b) in enumerate(_pairs(ref, got, key)):
            assert abs(a - b) <= rtol * abs(a), f"{key} #{i}: one process {a}, dp x sp {b}"
    for key in ("learning_rate", "num_input_tokens_seen", "num_tokens", "mean_token_accuracy",
                "eval_mean_token_accuracy", "step"):
        assert _pairs(ref, got, key) == [(a, a) for a, _ in _pairs(ref, got, key)], key
    assert len(_pairs(ref, got, "loss")) == 6 and len(_pairs(ref, got, "eval_loss")) == 2
    assert all(r["sft"]["logs"] == got for r in ranks)
    for name, expected in sft_one["weights"].items():
        tol = WEIGHT_RTOL * float(expected.abs().max())
        for r in ranks:
            assert_close(r["sft"]["weights"][name], expected, rtol=WEIGHT_RTOL, atol=tol,
                         name=name)


def test_flos_summed_on_the_accelerator_device():
    """``store_flos`` hands the dp all-reduce a tensor on the Trainer's device (a GPU under
    NCCL, which reduces no CPU tensor), not a CPU one; checked in one process with a stand-in
    device and group."""
    from types import SimpleNamespace

    from spdsl.hf.trainer import _SequenceParallelTrainer
    seen = []

    class Group:
        def sum(self, t: torch.Tensor) -> torch.Tensor:
            seen.append((t.device, t.dtype))
            return torch.tensor(2 * 3.0e12, dtype=torch.float64)   # two dp groups

    trainer = object.__new__(type("T", (_SequenceParallelTrainer,), {}))
    trainer.args = SimpleNamespace(device=torch.device("meta"))
    trainer.state, trainer.current_flos = SimpleNamespace(total_flos=1.0), 3.0e12
    trainer._spdsl_layout = Group()
    trainer.store_flos()
    assert seen == [(torch.device("meta"), torch.float64)]
    assert trainer.state.total_flos == 1.0 + 6.0e12 and trainer.current_flos == 0


def test_filler_rows_of_the_last_evaluation_step_do_not_count():
    """dp 2, 4 rows a device, 2 rows left over: dp rank 0's last batch holds the 2 real rows
    then 2 filler rows, dp rank 1's only filler rows; a padding-free batch cannot say which
    tokens are filler, so it raises."""
    from types import SimpleNamespace

    from spdsl.errors import ShardingError
    from spdsl.hf.trainer import _Layout
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(gradient_state=SimpleNamespace(end_of_dataloader=True,
                                                                   remainder=2)),
        args=SimpleNamespace(per_device_eval_batch_size=4))
    labels = torch.arange(4 * 6).reshape(4, 6)
    first = _Layout(2, None, 0, None).real_rows({"labels": labels}, trainer)["labels"]
    assert torch.equal(first[:2], labels[:2]) and (first[2:] == -100).all()
    assert (_Layout(2, None, 1, None).real_rows({"labels": labels}, trainer)["labels"]
            == -100).all()
    assert torch.equal(labels, torch.arange(4 * 6).reshape(4, 6))      # not written in place
    trainer.accelerator.gradient_state.end_of_dataloader = False
    assert _Layout(2, None, 1, None).real_rows({"labels": labels}, trainer)["labels"] is labels
    trainer.accelerator.gradient_state.end_of_dataloader = True
    with pytest.raises(ShardingError, match="uneven evaluation set"):
        _Layout(2, None, 0, None).real_rows({"labels": labels.reshape(1, -1)}, trainer)
