"""What ``spdsl.hf.sequence_parallel`` changes on the trainer it is given, in one process: the
trainer's class becomes a subclass made for it, whose namespace holds the trainer's state (no
attribute of spdsl's set on the trainer afterwards); its model, arguments and accelerator change
only on ranks (``_attach``), and a cached ``TrainingArguments`` device swapped for a load comes
back."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import spdsl
from spdsl.hf.trainer import _attach, _Layout, _SequenceParallelTrainer, _unindexed_cpu
from spdsl.hf.trainer_state import ResumingShards
from tests.hf.trainer_job import make_trainer


def _untouched(trainer) -> dict:
    accel = trainer.accelerator
    return {"forward": trainer.model.forward, "save": trainer.model.save_pretrained,
            "prepare": accel.prepare_model, "loader": accel.prepare_data_loader,
            "gather": accel.gather, "average": trainer.args.average_tokens_across_devices}


def test_one_process_adds_only_the_resume_of_shards():
    trainer = make_trainer()
    cls, before, own = type(trainer), _untouched(trainer), dict(vars(trainer))
    assert spdsl.hf.sequence_parallel(trainer, seq=2) is trainer
    assert type(trainer).__bases__ == (ResumingShards, cls)
    assert type(trainer)._load_optimizer_and_scheduler is \
        ResumingShards._load_optimizer_and_scheduler
    assert _untouched(trainer) == before and vars(trainer) == own


def test_the_state_is_in_the_class_made_for_the_trainer():
    first, second = make_trainer(), make_trainer()
    cls, own = type(first), dict(vars(first))
    runner = SimpleNamespace(forward=lambda **kw: None)
    layout = _Layout(1, None, 0, None)
    assert _attach(first, _SequenceParallelTrainer, "SequenceParallel", runner, layout) is first
    _attach(second, _SequenceParallelTrainer, "SequenceParallel", runner, layout)
    made = type(first)
    assert made.__name__ == f"SequenceParallel{cls.__name__}"
    assert made.__bases__ == (_SequenceParallelTrainer, cls) and type(second) is not made
    assert {k: made.__dict__[k] for k in ("_spdsl_loss", "_spdsl_layout", "_spdsl_sharded")} \
        == {"_spdsl_loss": runner, "_spdsl_layout": layout, "_spdsl_sharded": False}
    assert vars(first).keys() == own.keys()               # nothing of spdsl's on the trainer
    assert first.model.forward is runner.forward
    assert first.accelerator.gather == layout.gather
    assert first.args.average_tokens_across_devices is False


def test_an_indexed_cpu_device_is_plain_cpu_for_a_load_then_back():
    args = make_trainer().args
    assert args.device == torch.device("cpu")
    with _unindexed_cpu(args):                    # not indexed: nothing to do
        assert args.device == torch.device("cpu")
    args.__dict__["_setup_devices"] = torch.device("cpu", 0)      # a CPU rank's device
    with _unindexed_cpu(args):
        assert args.device == torch.device("cpu")
    assert args.device == torch.device("cpu", 0)
    try:
        with _unindexed_cpu(args):
            raise KeyError("load failed")
    except KeyError:
        pass
    assert args.device == torch.device("cpu", 0)
