"""The Trainer's saving and resuming when ``sequence_parallel(..., shard_state=True)`` holds
each parameter as a DTensor split over every rank (``spdsl.state``).

What changes against the Trainer's own files, and why:

- ``save_model`` / ``save_pretrained`` (final model and the weights of every checkpoint):
  every rank gathers each sharded parameter whole (one all-gather each, a collective, so every
  rank takes part), and the main process writes an ordinary Hugging Face checkpoint
  (safetensors, whole tensors) that ``from_pretrained`` loads on one device.
- the optimizer state: each rank writes its own shards (``optimizer.rank<R>.pt``: plain
  tensors, the rank's rows), since the Trainer's ``optimizer.pt`` is written by the main
  process alone and would hold its rows only. A resume needs the same ranks and ``seq``.
- resuming: the weights are read whole from the checkpoint and split again as the parameters
  are (``distribute_tensor``); the optimizer's rows go back into DTensors of their
  parameters' placements; the scheduler, the RNG states and the Trainer state load as usual.
"""

from __future__ import annotations

import json
import os

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from spdsl.errors import ShardingError
from spdsl.state import is_sharded_state

SCHEDULER_NAME = "scheduler.pt"       # transformers.trainer's names for the files it writes
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


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


def optimizer_file(checkpoint: str, rank: int) -> str:
    return os.path.join(checkpoint, f"optimizer.rank{rank}.pt")


def save_optimizer(trainer, output_dir: str) -> None:
    """Each rank's optimizer rows; the scheduler from the main process."""
    os.makedirs(output_dir, exist_ok=True)
    state = trainer.optimizer.state_dict()
    state["state"] = {i: {k: v.to_local() if isinstance(v, DTensor) else v
                          for k, v in s.items()} for i, s in state["state"].items()}
    torch.save(state, optimizer_file(output_dir, trainer.args.process_index))
    if trainer.args.should_save:
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def load_optimizer(trainer, checkpoint: str) -> None:
    path = optimizer_file(checkpoint, trainer.args.process_index)
    if not os.path.isfile(path):
        raise ShardingError(
            rule="sharded optimizer state", value=path,
            detail="resuming with shard_state=True, but this rank's optimizer rows are missing",
            fix="resume from a checkpoint written with shard_state=True on the same ranks and seq")
    state = torch.load(path, weights_only=True)
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    for i, s in state["state"].items():
        p = params[i]
        if isinstance(p, DTensor):
            state["state"][i] = {
                k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape,
                                      stride=p.stride(), run_check=False)
                if torch.is_tensor(v) and v.shape == p.to_local().shape and v.dim() else v
                for k, v in s.items()}
    trainer.optimizer.load_state_dict(state)
    trainer.lr_scheduler.load_state_dict(
        torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))


def load_weights(model: torch.nn.Module, checkpoint: str) -> None:
    """The checkpoint's whole weights, split again as ``model``'s parameters are."""
    from safetensors.torch import load_file
    index = os.path.join(checkpoint, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(checkpoint, SAFE_WEIGHTS_NAME)):
        files = [SAFE_WEIGHTS_NAME]
    else:
        raise ShardingError(
            rule="sharded resume", value=checkpoint,
            detail="shard_state=True resumes from model.safetensors (or its index) only",
            fix="resume from a checkpoint the Trainer wrote with save_safetensors=True")
    whole: dict[str, torch.Tensor] = {}
    for name in files:
        whole.update(load_file(os.path.join(checkpoint, name)))
    own = model.state_dict()
    state = {}
    for k, v in whole.items():
        if k in own and isinstance(own[k], DTensor):
            v = distribute_tensor(v.to(own[k].dtype), own[k].device_mesh, own[k].placements)
        state[k] = v
    model.load_state_dict(state, strict=False)
