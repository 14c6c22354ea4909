"""Fine-tune with TRL's ``SFTTrainer`` on packed documents (``packing=True``,
``padding_free=True``: several documents a row, position ids restarting, no attention across
them) under ``spdsl.hf.sequence_parallel``, and compare every logged number with the same job
in one process.

A tiny Llama and a word-level tokenizer built here (no download), pre-tokenized documents
whose lengths pair up to rows of ``--len`` tokens (one program for every batch). fp32, and
HF's gradient checkpointing off (``SFTConfig`` turns on bf16 and checkpointing by default;
spdsl's ``remat=`` does the recomputation). Output of these four commands, under a minute each on
2 CPU cores: ``examples/results/sft_trl.txt``.

    python examples/sft_trl.py --out /tmp/sft1.json
    torchrun --standalone --nproc_per_node=2 examples/sft_trl.py --out /tmp/sft2.json --against /tmp/sft1.json
    python examples/sft_trl.py --batch 4 --out /tmp/sft1b4.json     # the dp 2 x sp 2 reference
    torchrun --standalone --nproc_per_node=4 examples/sft_trl.py --seq 2 --out /tmp/sft4.json --against /tmp/sft1b4.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

import spdsl

_TIMINGS = ("runtime", "per_second", "epoch")


def tokenizer(vocab: int):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    words = {f"t{i}": i for i in range(vocab)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(words, unk_token="t1")),
                                   pad_token="t0", eos_token="t2", unk_token="t1")


def documents(n: int, row: int, vocab: int, seed: int):
    """``n`` documents whose lengths pair up to ``row`` tokens (3/4 + 1/4, 5/8 + 3/8, halves)."""
    import datasets
    lengths = [3 * row // 4, row // 4, 5 * row // 8, 3 * row // 8, row // 2, row // 2]
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, vocab, (lengths[i % 6],), generator=g).tolist() for i in range(n)]
    return datasets.Dataset.from_dict({"input_ids": docs})


def build_trainer(a):
    import transformers
    from trl import SFTConfig, SFTTrainer
    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    args = SFTConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, seed=0, data_seed=0,
        per_device_train_batch_size=a.batch, per_device_eval_batch_size=a.batch,
        gradient_accumulation_steps=2, max_steps=a.steps, learning_rate=5e-3, warmup_steps=2,
        lr_scheduler_type="cosine", max_grad_norm=0.5, logging_steps=1, eval_strategy="steps",
        eval_steps=3, save_strategy="no", report_to="none", disable_tqdm=True, packing=True,
        padding_free=True, max_length=a.len, include_num_input_tokens_seen="all",
        bf16=False, gradient_checkpointing=False)
    return SFTTrainer(model=transformers.LlamaForCausalLM(cfg), args=args,
                      processing_class=tokenizer(a.vocab),
                      train_dataset=documents(96, a.len, a.vocab, seed=1),
                      eval_dataset=documents(24, a.len, a.vocab, seed=2))


def compare(logs: list, ref: list) -> str:
    lines = []
    for key in ("loss", "grad_norm", "learning_rate", "entropy", "mean_token_accuracy",
                "num_tokens", "eval_loss", "eval_entropy", "eval_mean_token_accuracy",
                "num_input_tokens_seen", "train_loss"):
        pairs = list(zip([e[key] for e in ref if key in e], [e[key] for e in logs if key in e]))
        worst = max(abs(a - b) / max(abs(a), 1e-30) for a, b in pairs)
        lines.append(f"  {key}: {len(pairs)} values, worst relative difference {worst:.1e}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=None,
                   help="sp degree; the other ranks are dp (default: every rank)")
    p.add_argument("--batch", type=int, default=2,
                   help="packed rows per device and micro-batch (default: %(default)s)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps (default: %(default)s)")
    p.add_argument("--len", type=int, default=32, help="tokens a packed row (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=128,
                   help="vocabulary of the tiny Llama and its tokenizer (default: %(default)s)")
    p.add_argument("--out", help="write the logs here (JSON)")
    p.add_argument("--against", help="a one-process run's logs to compare with")
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = spdsl.hf.sequence_parallel(build_trainer(a), seq=a.seq or world)
    trainer.train()
    logs = [{k: v for k, v in e.items() if not any(t in k for t in _TIMINGS)}
            for e in trainer.state.log_history]
    if int(os.environ.get("RANK", "0")) != 0:
        return
    for e in logs:
        print(e)
    sp = getattr(trainer, "_spdsl_loss", None)
    print(f"{world} rank(s); " + (f"sp {sp.seq}, {sp.fused_step._traces} programs traced"
                                  if sp else "one process: no sequence parallelism"))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(logs, f)
    if a.against:
        with open(a.against) as f:
            print(f"against {a.against} (one process):\n{compare(logs, json.load(f))}")


if __name__ == "__main__":
    main()
