"""``spdsl.hf.sequence_parallel`` at dp 2 x sp 2 (4 gloo ranks) logs what one process logs at
twice the batch (``tests/hf/trainer_job.py``; the fair reference, as plain DDP at dp 2 equals
it): every loss, eval loss, gradient norm, learning rate, token count and ``total_flos``, on
every rank, and ends at the same weights. One launch."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate (pip install -e '.[hf]')")

import spdsl
from tests._util import assert_close
from tests.dist import spawn
from tests.hf.test_trainer import GRAD_NORM_RTOL, LOSS_RTOL, WEIGHT_RTOL, _pairs
from tests.hf.trainer_job import make_trainer, run

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


def _on_ranks(rank: int, world: int) -> dict:
    trainer = spdsl.hf.sequence_parallel(make_trainer(batch=4), seq=2, debug=True)
    return run(trainer)


@pytest.fixture(scope="module")
def jobs():
    return run(make_trainer(batch=8)), spawn(_on_ranks, 4, timeout=900)


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
