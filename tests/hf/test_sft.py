"""``spdsl.hf.sequence_parallel`` on TRL's ``SFTTrainer`` with packing (``padding_free=True``:
two documents a row, position ids restarting) at SP 2 (2 gloo ranks) logs what the same job
logs in one process: losses, eval losses, gradient norms, learning rates, token counts and
TRL's entropy and mean token accuracy, and ends at the same weights
(``tests/hf/sft_job.py``). One launch."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate (pip install -e '.[hf]')")
pytest.importorskip("trl", reason="SFTTrainer is TRL's (pip install trl)")
pytest.importorskip("datasets", reason="SFTTrainer takes a datasets.Dataset")

import spdsl
from tests._util import assert_close
from tests.dist import spawn
from tests.hf.sft_job import make_trainer
from tests.hf.test_trainer import GRAD_NORM_RTOL, LOSS_RTOL, WEIGHT_RTOL, _pairs
from tests.hf.trainer_job import run

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


def _on_ranks(rank: int, world: int) -> dict:
    trainer = spdsl.hf.sequence_parallel(make_trainer(), seq=world, debug=True)
    out = run(trainer)
    out["programs"] = trainer._spdsl_loss.fused_step._traces
    return out


@pytest.fixture(scope="module")
def jobs():
    return run(make_trainer()), spawn(_on_ranks, 2, timeout=900)


def test_logs_match_one_process(jobs):
    one, ranks = jobs
    ref, got = one["logs"], ranks[0]["logs"]
    assert ranks[0]["programs"] == 2               # TRL's fused head, training and evaluation
    for key, rtol in (("loss", LOSS_RTOL), ("eval_loss", LOSS_RTOL), ("entropy", LOSS_RTOL),
                      ("eval_entropy", LOSS_RTOL), ("grad_norm", GRAD_NORM_RTOL)):
        for i, (a, b) in enumerate(_pairs(ref, got, key)):
            assert abs(a - b) <= rtol * abs(a), f"{key} #{i}: one process {a}, sp {b}"
    for key in ("learning_rate", "num_input_tokens_seen", "num_tokens", "mean_token_accuracy",
                "eval_mean_token_accuracy", "step"):
        assert _pairs(ref, got, key) == [(a, a) for a, _ in _pairs(ref, got, key)], key
    assert len(_pairs(ref, got, "loss")) == 6 and len(_pairs(ref, got, "eval_loss")) == 2
    assert ranks[1]["logs"] == got


def test_weights_match_one_process(jobs):
    one, ranks = jobs
    for name, expected in one["weights"].items():
        tol = WEIGHT_RTOL * float(expected.abs().max())
        assert_close(ranks[0]["weights"][name], expected, rtol=WEIGHT_RTOL, atol=tol, name=name)
