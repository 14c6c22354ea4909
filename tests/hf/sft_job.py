"""One small TRL ``SFTTrainer`` job with packing (``padding_free=True``), run the same way in
one process and on sp ranks.

A tiny Llama (``tests/hf/families.py``), a word-level tokenizer and pre-tokenized documents
built here (no downloads). The documents' lengths pair up (24 + 8, 20 + 12, 16 + 16), so
best-fit packing fills every row of 32 tokens with two documents, position ids restarting at
the second: every micro-batch has the same shape (one program) and attention must not cross
from one document into the other.
"""

from __future__ import annotations

import tempfile

import torch

from tests.hf.families import VOCAB, build

LENGTHS = (24, 8, 20, 12, 16, 16)


def tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")),
                                   pad_token="t0", eos_token="t2", unk_token="t1")


def documents(n: int, seed: int):
    import datasets
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, VOCAB, (LENGTHS[i % len(LENGTHS)],), generator=g).tolist()
            for i in range(n)]
    return datasets.Dataset.from_dict({"input_ids": docs})


def make_trainer(max_steps: int = 6, batch: int = 2, eval_docs: int = 12):
    from trl import SFTConfig, SFTTrainer
    args = SFTConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, seed=0, data_seed=0,
        per_device_train_batch_size=batch, per_device_eval_batch_size=batch,
        gradient_accumulation_steps=2, max_steps=max_steps, learning_rate=5e-3,
        warmup_steps=2, lr_scheduler_type="cosine", max_grad_norm=0.5, logging_steps=1,
        eval_strategy="steps", eval_steps=3, save_strategy="no", report_to="none",
        disable_tqdm=True, packing=True, padding_free=True, max_length=32,
        dataset_num_proc=None, include_num_input_tokens_seen="all",
        bf16=False, gradient_checkpointing=False)   # SFTConfig defaults: bf16 autocast, HF checkpointing
    return SFTTrainer(model=build("llama"), args=args, processing_class=tokenizer(),
                      train_dataset=documents(96, seed=1), eval_dataset=documents(eval_docs, seed=2))
