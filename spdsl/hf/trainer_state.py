"""The Trainer's saving and resuming when ``sequence_parallel(..., shard_state=True)`` holds
each parameter as a DTensor split over every rank (``spdsl.sharded_state``).

What changes against the Trainer's own files, and why:

- ``save_model`` / ``save_pretrained`` (final model and the weights of every checkpoint):
  every rank gathers each sharded parameter whole (one all-gather each, a collective, so every
  rank takes part), and the main process writes an ordinary Hugging Face checkpoint
  (safetensors, whole tensors) that ``from_pretrained`` loads on one device.
- the optimizer state: the model's and the optimizer's shards go through spdsl's own
  checkpoint (``spdsl.save_checkpoint``: DCP, each rank writes its own rows and every shard's
  global offset is recorded) into the checkpoint's ``sharded_state`` folder, since the
  Trainer's ``optimizer.pt`` is written by the main process alone and would hold its rows
  only. The scheduler is the Trainer's ``scheduler.pt``.
- resuming: ``spdsl.load_checkpoint`` reads the weights and the optimizer state from that
  folder, resharded to the current ranks (any number of ranks and any ``seq``: the state is
  split over every rank in rank order), and runs no code from the files; the scheduler, the
  RNG states and the Trainer state load as usual. A checkpoint without the folder (the
  per-rank ``optimizer.rank<R>.pt`` files of earlier versions, or ``save_only_model``) is
  refused before anything loads.
"""

from __future__ import annotations

import os

import torch
from torch.distributed.tensor import DTensor

from spdsl.errors import ShardingError
from spdsl.sharded_state import is_sharded_state

SCHEDULER_NAME = "scheduler.pt"       # transformers.trainer's name for the file
STATE_DIR = "sharded_state"           # the save_checkpoint root inside a Trainer checkpoint


def has_sharded_state(model: torch.nn.Module) -> bool:
    return any(is_sharded_state(p) for p in model.parameters())


def whole_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every sharded parameter gathered whole (a collective: call
    it on every rank)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v
            for k, v in model.state_dict().items()}


def gathering_save_pretrained(model: torch.nn.Module):
    """``model.save_pretrained`` that gathers sharded parameters first when no ``state_dict``
    is given; call it on every rank (``is_main_process`` says which one writes)."""
    save = model.save_pretrained

    def save_pretrained(save_directory, *args, state_dict=None, **kwargs):
        if state_dict is None:
            state_dict = whole_state_dict(model)
        return save(save_directory, *args, state_dict=state_dict, **kwargs)
    return save_pretrained


def state_dir(checkpoint: str) -> str:
    """Where a Trainer checkpoint keeps the model's and optimizer's shards (a
    ``save_checkpoint`` root)."""
    return os.path.join(checkpoint, STATE_DIR)


def _torch_optimizer(optimizer):
    # accelerate's AcceleratedOptimizer wraps the torch optimizer, whose state DCP maps to names
    return getattr(optimizer, "optimizer", optimizer)


def save_state(trainer, output_dir: str) -> None:
    """The model's and optimizer's shards through ``save_checkpoint`` (every rank writes its
    own); the scheduler from the main process."""
    from spdsl.checkpoint import save_checkpoint  # DCP loads when a run first saves
    save_checkpoint(state_dir(output_dir), trainer.model, _torch_optimizer(trainer.optimizer),
                    step=trainer.state.global_step)
    if trainer.args.should_save:
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def holds_shards(checkpoint: str) -> bool:
    """``checkpoint`` keeps its optimizer state as shards (``save_state``), not as the
    Trainer's ``optimizer.pt``: a run without sharded state resumes it through ``load_state``
    too (the Trainer's own loading would find no optimizer state and start a fresh one)."""
    return os.path.isdir(state_dir(checkpoint)) and \
        not os.path.isfile(os.path.join(checkpoint, "optimizer.pt"))


class ResumingShards:
    """Mixed in before the class of a trainer (one process, or ranks without sharded state):
    a checkpoint of shards resumes through ``load_state``, resharded to its whole
    parameters."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None and holds_shards(checkpoint):
            return load_state(self, checkpoint)
        return super()._load_optimizer_and_scheduler(checkpoint)


def check_resumable(checkpoint: str) -> None:
    """A ``ShardingError`` unless ``checkpoint`` holds the shards ``save_state`` writes."""
    if os.path.isdir(state_dir(checkpoint)):
        return
    old = "per-rank optimizer.rank<R>.pt files of an earlier version" if any(
        f.startswith("optimizer.rank") for f in os.listdir(checkpoint)) else "no optimizer state"
    raise ShardingError(
        rule="sharded resume", value=checkpoint,
        detail=f"shard_state=True resumes from the checkpoint's {STATE_DIR} folder, and this "
               f"one holds {old}",
        fix="resume from a checkpoint this version wrote with shard_state=True (not "
            "save_only_model), or from its weights alone: from_pretrained, then train anew")


def load_state(trainer, checkpoint: str) -> None:
    """The weights and optimizer state, resharded to the current ranks; then the
    scheduler."""
    from spdsl.checkpoint import load_checkpoint
    check_resumable(checkpoint)
    if load_checkpoint(state_dir(checkpoint), trainer.model,
                       _torch_optimizer(trainer.optimizer)) is None:
        raise ShardingError(
            rule="sharded resume", value=state_dir(checkpoint),
            detail="the folder holds no complete checkpoint (its save was cut short)",
            fix="resume from an earlier checkpoint of the run")
    trainer.lr_scheduler.load_state_dict(
        torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
