"""Fine-tune an unchanged Hugging Face causal LM with ``spdsl.sp_shard`` on 4 CPU ranks, on
long documents in padded and packed batches, then check one step of each against
single-device PyTorch.

The model is built from a small config (Llama by default, or ``--family qwen2|mistral|gemma``)
on synthetic documents, or loaded with its tokenizer from a local directory (``--model-dir``,
no download) and trained on real text: ``--text FILE``, or this docstring, tokenized by the
directory's tokenizer and cut into windows of up to ``--seq`` tokens.

- padded batches: one document per row, padded on the right; ``attention_mask`` marks the
  padding and the labels there are -100, as a Hugging Face collator does;
- packed batches: several documents in one row, ``position_ids`` restarting at each one (the
  Hugging Face convention: no attention across documents, no padding).

Every rank passes the same global batch; ``sp_shard`` splits the sequence. A synthetic
document is one phrase of 24 tokens repeated, the phrase a random walk in a small fixed
language (16 tokens, each followed by one of two). Learning the language takes the loss from
ln(256) = 5.55 to 1.43 in the default 30 steps (23 s on 2 CPU cores:
``examples/results/finetune_hf.txt``). The walk's coin flips leave about ln(2) = 0.69 a token
that only copying removes: the phrase's previous repeat, 24 positions back (in the previous
rank's shard at the start of each shard), which takes a model this small far longer to learn
(about 0.55 after 200 steps). The last line is the check: one padded and one packed step
equal to single-device PyTorch.

    torchrun --standalone --nproc_per_node=4 examples/finetune_hf.py
    torchrun --standalone --nproc_per_node=4 examples/finetune_hf.py --attn eager --seq 1024
    torchrun --standalone --nproc_per_node=4 examples/finetune_hf.py --model-dir ./my-llama --text notes.txt
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import spdsl

Document = Callable[[torch.Generator, int], torch.Tensor]


def build(args) -> torch.nn.Module:
    import transformers
    if args.model_dir:
        return transformers.AutoModelForCausalLM.from_pretrained(
            args.model_dir, local_files_only=True, attn_implementation=args.attn,
            dtype=torch.float32)
    kw = {"vocab_size": args.vocab, "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
          "max_position_embeddings": max(4096, args.seq), "attention_dropout": 0.0}
    if args.family == "gemma":
        kw.update(num_key_value_heads=1, head_dim=16)
    cfg = getattr(transformers, {"llama": "LlamaConfig", "qwen2": "Qwen2Config",
                                 "mistral": "MistralConfig", "gemma": "GemmaConfig"}
                  [args.family])(**kw)
    cfg._attn_implementation = args.attn
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def synthetic_documents(vocab: int) -> Document:
    """Documents of one phrase of 24 tokens repeated, the phrase a walk in a fixed language:
    tokens 3..18 (0-2 left to padding and specials), each followed by one of two tokens."""
    size = min(16, vocab - 3)
    follow = torch.randint(3, 3 + size, (vocab, 2), generator=torch.Generator().manual_seed(0))

    def document(g: torch.Generator, n: int) -> torch.Tensor:
        phrase = [int(torch.randint(3, 3 + size, (1,), generator=g))]
        for coin in torch.randint(0, 2, (23,), generator=g).tolist():
            phrase.append(int(follow[phrase[-1], coin]))
        return torch.tensor(phrase).repeat(n // 24 + 1)[:n]
    return document


def text_documents(args, vocab: int) -> tuple[Document, str]:
    """Documents cut from ``--text`` (or this docstring) tokenized by the model directory's
    tokenizer: ``n`` tokens from a random start, wrapping around at the end."""
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        sys.exit(f"--model-dir {args.model_dir}: no tokenizer loads from it ({e})")
    name = args.text or "this script's docstring"
    raw = Path(args.text).read_text(encoding="utf-8") if args.text else __doc__
    ids = torch.tensor(tok(raw, add_special_tokens=False)["input_ids"], dtype=torch.long)
    if ids.numel() < 2 or int(ids.max()) >= vocab:
        sys.exit(f"--text {name}: {ids.numel()} tokens with ids up to "
                 f"{int(ids.max()) if ids.numel() else None}; the model needs at least 2, "
                 f"each below its vocab_size {vocab}")

    def document(g: torch.Generator, n: int) -> torch.Tensor:
        start = int(torch.randint(0, ids.numel(), (1,), generator=g))
        return ids[(start + torch.arange(n)) % ids.numel()]
    return document, f"{name}, {ids.numel():,} tokens by the tokenizer in {args.model_dir}"


def padded_batch(step: int, b: int, s: int, document: Document):
    g = torch.Generator().manual_seed(step)
    ids = torch.zeros(b, s, dtype=torch.long)
    mask = torch.zeros(b, s, dtype=torch.long)
    for r in range(b):
        n = int(torch.randint(s // 2, s + 1, (1,), generator=g))
        ids[r, :n], mask[r, :n] = document(g, n), 1
    return ids, ids.masked_fill(mask == 0, -100), mask


def packed_batch(step: int, b: int, s: int, document: Document):
    g = torch.Generator().manual_seed(10 ** 6 + step)
    ids, pos = torch.zeros(b, s, dtype=torch.long), torch.zeros(b, s, dtype=torch.long)
    for r in range(b):
        at = 0
        while at < s:
            n = min(s - at, int(torch.randint(s // 8, s // 2, (1,), generator=g)))
            ids[r, at:at + n], pos[r, at:at + n] = document(g, n), torch.arange(n)
            at += n
    return ids, ids.masked_fill(pos == 0, -100), pos        # no target across documents


def loss_fn(model, extra: str):
    def f(ids, labels, x):
        return model(input_ids=ids, labels=labels, use_cache=False, **{extra: x}).loss
    return f


def progress(step: int, steps: int, kind: str, loss: float, tok_s: float) -> None:
    done = int(30 * step / steps)
    sys.stdout.write(f"\r[{'#' * done}{'.' * (30 - done)}] step {step}/{steps} {kind:6s} "
                     f"loss {loss:.4f} {tok_s:,.0f} tok/s")
    sys.stdout.flush()


def parity(model, steps: dict, batches: dict) -> tuple[float, float]:
    """Loss and worst gradient relative error of one sequence-parallel step per kind of batch
    against single-device PyTorch on the same weights and batch."""
    ref = copy.deepcopy(model)
    worst_loss = worst_grad = 0.0
    for kind, xs in batches.items():
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss = steps[kind](*xs)
        loss.backward()
        loss_ref = loss_fn(ref, "attention_mask" if kind == "padded" else "position_ids")(*xs)
        loss_ref.backward()
        worst_loss = max(worst_loss, abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()))
        for p, q in zip(model.parameters(), ref.parameters()):
            if q.grad is not None:
                scale = q.grad.abs().max().item() or 1.0
                worst_grad = max(worst_grad, (p.grad - q.grad).abs().max().item() / scale)
    return worst_loss, worst_grad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=None, metavar="DIR",
                    help="a local Hugging Face model directory with its tokenizer (no download); "
                         "trains on --text, not synthetic documents")
    ap.add_argument("--text", default=None, metavar="FILE",
                    help="UTF-8 text to train on with --model-dir (default: this script's "
                         "docstring)")
    ap.add_argument("--family", default="llama", choices=["llama", "qwen2", "mistral", "gemma"],
                    help="the architecture built from a small config without --model-dir "
                         "(default: %(default)s)")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"],
                    help="the Hugging Face attention implementation (default: %(default)s)")
    ap.add_argument("--seq", type=int, default=512,
                    help="tokens a row, rounded up to split evenly over the ranks "
                         "(default: %(default)s)")
    ap.add_argument("--batch", type=int, default=2,
                    help="rows a step, the same on every rank (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=30,
                    help="optimizer steps, padded and packed in turn (default: %(default)s)")
    ap.add_argument("--vocab", type=int, default=256,
                    help="vocabulary of the model built without --model-dir "
                         "(default: %(default)s)")
    ap.add_argument("--lr", type=float, default=3e-3,
                    help="AdamW learning rate (default: %(default)s)")
    args = ap.parse_args()
    if args.text and not args.model_dir:
        ap.error("--text needs --model-dir: the directory's tokenizer turns the text into ids")
    if args.model_dir and not (Path(args.model_dir) / "config.json").is_file():
        ap.error(f"--model-dir {args.model_dir}: no config.json there; give a directory that "
                 "save_pretrained wrote (nothing is downloaded)")

    torch.set_num_threads(1)
    model = build(args).train()
    vocab = model.config.vocab_size
    document, source = (text_documents(args, vocab) if args.model_dir
                        else (synthetic_documents(vocab), None))
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    seq = args.seq + (-args.seq) % world          # the sequence must split evenly
    steps = {"padded": spdsl.sp_shard(seq=world)(loss_fn(model, "attention_mask")),
             "packed": spdsl.sp_shard(seq=world)(loss_fn(model, "position_ids"))}
    make = {"padded": padded_batch, "packed": packed_batch}
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if rank == 0:
        print(f"{type(model).__name__} ({args.attn}), sequence {seq} split over {world} ranks, "
              f"{sum(p.numel() for p in model.parameters()):,} parameters")
        if source:
            print(f"text: {source}")
    t0, tokens = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        kind = "padded" if step % 2 else "packed"
        ids, labels, extra = make[kind](step, args.batch, seq, document)
        loss = steps[kind](ids, labels, extra)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += ids.numel()
        if rank == 0:
            progress(step, args.steps, kind, loss.item(), tokens / (time.perf_counter() - t0))
    if rank == 0:
        print()
    batches = {k: make[k](10 ** 7, args.batch, seq, document) for k in make}
    err_loss, err_grad = parity(model, steps, batches)
    if rank == 0:
        print(f"parity with single-device PyTorch (padded and packed batch, same weights): "
              f"loss rel err {err_loss:.1e}, max gradient rel err {err_grad:.1e}")
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
