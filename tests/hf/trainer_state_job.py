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


def on_ranks(world: int, root: str) -> dict:
    """The runs of the job that keep something, on ``world`` sp ranks: ``whole`` and
    ``sharded`` (``shard_state=True``) each checkpoint at step 3, save the final model in
    ``root/<name>/final`` and resume from step 3 (``<name>_resumed``); ``lora`` (if peft is
    installed) records its step-1 gradients."""
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
        resumed = spdsl.hf.sequence_parallel(make_trainer(out=d), seq=world, **opts)
        resumed.train(resume_from_checkpoint=os.path.join(d, "checkpoint-3"))
        out[name + "_resumed"] = result(resumed)
    try:
        import peft  # noqa: F401
    except ImportError:
        return out
    grads = first_gradients()
    out["lora"] = lora_run(spdsl.hf.sequence_parallel(
        make_trainer(model=lora_model(), callbacks=[grads]), seq=world), grads)
    return out
