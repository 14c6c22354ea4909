"""The Trainer job of ``tests/hf/trainer_job.py`` with what a run keeps: checkpoints and a
resume, the saved model, sharded state (``shard_state=True``) and a LoRA adapter (``peft``),
each run the same way in one process and on sp ranks."""

from __future__ import annotations

import os

import torch
from torch.distributed.tensor import DTensor

from tests.hf.families import build
from tests.hf.trainer_job import make_trainer, result, run


def lora_model():
    """The job's tiny Llama with LoRA on the attention's q and v projections; both factors
    drawn at random (``init_lora_weights=False``), so every LoRA gradient of step 1 is
    non-zero."""
    from peft import LoraConfig, get_peft_model
    model = build("llama")
    torch.manual_seed(3)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                     init_lora_weights=False)
    return get_peft_model(model, cfg)


def first_gradients():
    """A Trainer callback keeping the trainable parameters' gradients of the first optimizer
    step (after clipping), whole, in ``.grads``."""
    from transformers import TrainerCallback

    class FirstGradients(TrainerCallback):
        def __init__(self) -> None:
            self.grads: dict[str, torch.Tensor] = {}

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if state.global_step == 0:
                self.grads = {
                    n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                    .detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return FirstGradients()


def lora_run(trainer, grads) -> dict:
    out = run(trainer)
    out["weights"] = {k: v for k, v in out["weights"].items() if "lora_" in k}
    out["grads"] = grads.grads
    return out


def as_old_checkpoint(checkpoint: str, old: str) -> None:
    """``checkpoint`` copied to ``old`` as an earlier version wrote it: per-rank
    ``optimizer.rank<R>.pt`` files (empty here) instead of the ``sharded_state`` folder. On
    every rank: a barrier after rank 0's copy."""
    import shutil

    import torch.distributed as dist
    if dist.get_rank() == 0:
        shutil.copytree(checkpoint, old, ignore=shutil.ignore_patterns("sharded_state"))
        for r in range(dist.get_world_size()):
            torch.save({}, os.path.join(old, f"optimizer.rank{r}.pt"))
    dist.barrier()


def on_ranks(world: int, root: str) -> dict:
    """The runs of the job that keep something, on ``world`` sp ranks: ``whole`` and
    ``sharded`` (``shard_state=True``) each checkpoint at step 3 and save the final model in
    ``root/<name>/final``; ``whole`` resumes from step 3 here (``whole_resumed``), ``sharded``
    on other ranks (``on_other_ranks``), and its checkpoint is also copied to ``root/sharded/old-3`` as an earlier version wrote it;
    ``lora`` and ``lora_sharded`` (if peft is installed) record their step-1 gradients, the
    latter checkpointing at step 3 (the adapter and the ``sharded_state`` folder)."""
    import spdsl
    out = {}
    for name, opts in (("whole", {}), ("sharded", {"shard_state": True})):
        d = os.path.join(root, name)
        trainer = spdsl.hf.sequence_parallel(make_trainer(out=d, save_steps=3), seq=world,
                                             debug=True, **opts)
        out[name] = run(trainer)
        out[name]["programs"] = trainer._spdsl_loss.step._traces
        trainer.save_model(os.path.join(d, "final"))
        out[name]["files"] = sorted(os.listdir(os.path.join(d, "checkpoint-3")))
        if opts:
            continue
        resumed = spdsl.hf.sequence_parallel(make_trainer(out=d), seq=world, **opts)
        resumed.train(resume_from_checkpoint=os.path.join(d, "checkpoint-3"))
        out[name + "_resumed"] = result(resumed)
    d = os.path.join(root, "sharded")
    as_old_checkpoint(os.path.join(d, "checkpoint-3"), os.path.join(d, "old-3"))
    try:
        import peft  # noqa: F401
    except ImportError:
        return out
    for name, opts in (("lora", {}), ("lora_sharded", {"shard_state": True})):
        grads = first_gradients()
        trainer = make_trainer(model=lora_model(), callbacks=[grads],
                               out=os.path.join(root, name), save_steps=3 if opts else None)
        trainer = spdsl.hf.sequence_parallel(trainer, seq=world, **opts)
        out[name] = lora_run(trainer, grads)
        out[name]["sharded"] = trainer._spdsl_sharded
        if opts:
            out[name]["files"] = sorted(os.listdir(os.path.join(root, name, "checkpoint-3")))
    return out


def on_other_ranks(world: int, root: str) -> dict:
    """On ``world`` ranks other than ``on_ranks``' (``seq=world``), with
    ``shard_state=True``: ``sharded`` resumed from ``on_ranks``' step-3 checkpoint (its
    ``sharded_state`` folder resharded), and the refusal of ``root/sharded/old-3`` (an
    earlier version's per-rank files)."""
    import spdsl
    out = {}
    trainer = spdsl.hf.sequence_parallel(make_trainer(out=os.path.join(root, "sharded_other")),
                                         seq=world, shard_state=True)
    trainer.train(resume_from_checkpoint=os.path.join(root, "sharded", "checkpoint-3"))
    out["sharded"] = result(trainer)
    old = spdsl.hf.sequence_parallel(make_trainer(out=os.path.join(root, "old_other")),
                                     seq=world, shard_state=True)
    try:
        old.train(resume_from_checkpoint=os.path.join(root, "sharded", "old-3"))
    except Exception as e:  # noqa: BLE001 - the test reads the type and the message
        out["old"] = (type(e).__name__, str(e))
    return out
