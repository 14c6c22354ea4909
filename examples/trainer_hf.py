"""Train an unchanged Hugging Face causal LM with the ``transformers.Trainer`` and
``spdsl.hf.sequence_parallel``, then compare every logged number with the same job in one
process.

A tiny Llama built from a config (no download) on right-padded random rows; two
micro-batches a step, warm-up then cosine, clipping, evaluation every ``--eval-every`` steps
on rows of an odd length (padded inside the step). Run it once in one process and once on
ranks, each writing its logs; the run on ranks prints the comparison (output of these four
commands, under a minute each on 2 CPU cores: ``examples/results/trainer_hf.txt``):

    python examples/trainer_hf.py --out /tmp/one.json
    torchrun --standalone --nproc_per_node=2 examples/trainer_hf.py --out /tmp/sp.json --against /tmp/one.json
    python examples/trainer_hf.py --batch 8 --out /tmp/one8.json    # the dp 2 x sp 2 reference
    torchrun --standalone --nproc_per_node=4 examples/trainer_hf.py --seq 2 --out /tmp/dpsp.json --against /tmp/one8.json

With ``--seq 2`` on 4 ranks the job is dp 2 x sp 2: its reference is one process at twice
the per-device batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

import spdsl

_TIMINGS = ("runtime", "per_second", "epoch")


class Rows(torch.utils.data.Dataset):
    """``n`` rows of ``length`` tokens, each right-padded from a random length."""

    def __init__(self, n: int, length: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(n):
            real = int(torch.randint(length // 2, length + 1, (1,), generator=g))
            ids = torch.randint(1, vocab, (length,), generator=g)
            mask = (torch.arange(length) < real).long()
            self.rows.append({"input_ids": ids * mask, "attention_mask": mask,
                              "labels": ids.masked_fill(mask == 0, -100)})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def build_trainer(a):
    import transformers
    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    cfg._attn_implementation = a.attn
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), use_cpu=True, seed=0, data_seed=0,
        per_device_train_batch_size=a.batch, per_device_eval_batch_size=a.batch,
        gradient_accumulation_steps=2, max_steps=a.steps, learning_rate=5e-3, warmup_steps=2,
        lr_scheduler_type="cosine", max_grad_norm=0.5, logging_steps=1, eval_strategy="steps",
        eval_steps=a.eval_every, save_strategy="no", include_num_input_tokens_seen="non_padding",
        report_to="none", disable_tqdm=True)
    return transformers.Trainer(
        model=model, args=args, train_dataset=Rows(64, a.len, a.vocab, seed=1),
        eval_dataset=Rows(8, a.len - 1, a.vocab, seed=2))


def compare(logs: list, ref: list) -> str:
    """The worst relative difference of each logged number."""
    lines = []
    for key in ("loss", "grad_norm", "learning_rate", "eval_loss", "num_input_tokens_seen",
                "train_loss", "total_flos"):
        pairs = list(zip([e[key] for e in ref if key in e], [e[key] for e in logs if key in e]))
        worst = max(abs(a - b) / max(abs(a), 1e-30) for a, b in pairs)
        lines.append(f"  {key}: {len(pairs)} values, worst relative difference {worst:.1e}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=None,
                   help="sp degree; the other ranks are dp (default: every rank)")
    p.add_argument("--batch", type=int, default=4,
                   help="rows per device and micro-batch (default: %(default)s)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps (default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=3,
                   help="steps between evaluations (default: %(default)s)")
    p.add_argument("--len", type=int, default=64,
                   help="training row length; evaluation rows are one shorter "
                        "(default: %(default)s)")
    p.add_argument("--vocab", type=int, default=128,
                   help="vocabulary of the tiny Llama (default: %(default)s)")
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"),
                   help="the Hugging Face attention implementation (default: %(default)s)")
    p.add_argument("--out", help="write the logs here (JSON)")
    p.add_argument("--against", help="a one-process run's logs to compare with")
    a = p.parse_args()
    trainer = build_trainer(a)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = spdsl.hf.sequence_parallel(trainer, seq=a.seq or world)
    trainer.train()
    logs = [{k: v for k, v in e.items() if not any(t in k for t in _TIMINGS)}
            for e in trainer.state.log_history]
    if int(os.environ.get("RANK", "0")) != 0:
        return
    for e in logs:
        print(e)
    sp = getattr(trainer, "_spdsl_loss", None)
    print(f"{world} rank(s); " + (f"sp {sp.seq}, {sp.step._traces} programs traced (train, eval)"
                                  if sp else "one process: no sequence parallelism"))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(logs, f)
    if a.against:
        with open(a.against) as f:
            ref = json.load(f)
        print(f"against {a.against} (one process):\n{compare(logs, ref)}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
