"""One small Hugging Face ``Trainer`` job, run the same way in one process and on sp ranks.

A tiny Llama (``tests/hf/families.py``), rows built here (no downloads): training rows of 32
tokens, right-padded from a random length (``attention_mask`` 0 and labels -100 on the
padding), evaluation rows of 31 tokens (a length two ranks do not divide). Six optimizer steps
of two micro-batches, warm-up then cosine, clipping, evaluation every three steps.
"""

from __future__ import annotations

import tempfile

import torch

from tests.hf.families import VOCAB, build

TRAIN_LEN, EVAL_LEN = 32, 31
MAX_GRAD_NORM = 0.5


class Rows(torch.utils.data.Dataset):
    """``n`` rows of ``length`` tokens; a row's real length is drawn in [length/2, length]."""

    def __init__(self, n: int, length: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(n):
            real = int(torch.randint(length // 2, length + 1, (1,), generator=g))
            ids = torch.randint(1, VOCAB, (length,), generator=g)
            mask = (torch.arange(length) < real).long()
            self.rows.append({"input_ids": ids * mask, "attention_mask": mask,
                              "labels": ids.masked_fill(mask == 0, -100)})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def make_trainer(max_steps: int = 6, batch: int = 4, out: str | None = None, model=None,
                 save_steps: int | None = None, eval_rows: int = 8, callbacks=None):
    """The job's Trainer, built the same way on every rank; ``batch`` rows per device and
    micro-batch (training and evaluation); a checkpoint every ``save_steps`` steps in ``out``
    (the same directory on every rank)."""
    from transformers import Trainer, TrainingArguments
    args = TrainingArguments(
        output_dir=out or tempfile.mkdtemp(), use_cpu=True, seed=0, data_seed=0,
        per_device_train_batch_size=batch, per_device_eval_batch_size=batch,
        gradient_accumulation_steps=2, max_steps=max_steps, learning_rate=5e-3,
        warmup_steps=2, lr_scheduler_type="cosine", max_grad_norm=MAX_GRAD_NORM,
        logging_steps=1, eval_strategy="steps", eval_steps=3,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        include_num_input_tokens_seen="non_padding", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0)
    return Trainer(model=model if model is not None else build("llama"), args=args,
                   train_dataset=Rows(64, TRAIN_LEN, seed=1),
                   eval_dataset=Rows(eval_rows, EVAL_LEN, seed=2), callbacks=callbacks)


def run(trainer) -> dict:
    """Train; the logs and the final weights (sharded parameters gathered whole)."""
    trainer.train()
    return result(trainer)


def result(trainer) -> dict:
    from torch.distributed.tensor import DTensor
    logs = [{k: v for k, v in e.items() if k not in _TIMINGS} for e in trainer.state.log_history]
    weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
               for k, v in trainer.model.state_dict().items()}
    return {"logs": logs, "weights": weights}


_TIMINGS = {"train_runtime", "train_samples_per_second", "train_steps_per_second",
            "eval_runtime", "eval_samples_per_second", "eval_steps_per_second",
            "train_tokens_per_second", "epoch"}
