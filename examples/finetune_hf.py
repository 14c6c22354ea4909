"""Fine-tune an unchanged Hugging Face causal LM with ``spdsl.sp_shard`` on 4 CPU ranks, on
long synthetic documents in padded and packed batches, then check one step of each against
single-device PyTorch.

The model is built from a small config (Llama by default, or ``--family qwen2|mistral|gemma``)
or loaded from a local directory (``--model-dir``, no download). The documents are long
runs of a random phrase repeated with noise: predicting a token needs the phrase seen
hundreds of positions earlier, usually in another rank's shard.

- padded batches: one document per row, padded on the right; ``attention_mask`` marks the
  padding and the labels there are -100, as a Hugging Face collator does;
- packed batches: several documents in one row, ``position_ids`` restarting at each one (the
  Hugging Face convention: no attention across documents, no padding).

Every rank passes the same global batch; ``sp_shard`` splits the sequence. The default 30
steps run the plumbing end to end (1 min 21 s on 2 CPU cores:
``examples/results/finetune_hf.txt``); copying a phrase from far back takes a model this
small a few hundred steps to learn, so over 30 the loss stays near ln(256) = 5.55. What the
run shows is the last line: one padded and one packed step equal to single-device PyTorch.

    torchrun --standalone --nproc_per_node=4 examples/finetune_hf.py
    torchrun --standalone --nproc_per_node=4 examples/finetune_hf.py --attn eager --seq 1024
    torchrun --standalone --nproc_per_node=4 examples/finetune_hf.py --model-dir ./my-llama
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
import torch.distributed as dist

import spdsl


def build(args) -> torch.nn.Module:
    import transformers
    if args.model_dir:
        return transformers.AutoModelForCausalLM.from_pretrained(
            args.model_dir, local_files_only=True, attn_implementation=args.attn,
            torch_dtype=torch.float32)
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


def document(g: torch.Generator, n: int, vocab: int) -> torch.Tensor:
    """A phrase of 24 random tokens repeated to length ``n``, 10% of tokens replaced."""
    phrase = torch.randint(3, vocab, (24,), generator=g)
    doc = phrase.repeat(n // 24 + 1)[:n]
    noise = torch.rand(n, generator=g) < 0.1
    return torch.where(noise, torch.randint(3, vocab, (n,), generator=g), doc)


def padded_batch(step: int, b: int, s: int, vocab: int):
    g = torch.Generator().manual_seed(step)
    ids = torch.zeros(b, s, dtype=torch.long)
    mask = torch.zeros(b, s, dtype=torch.long)
    for r in range(b):
        n = int(torch.randint(s // 2, s + 1, (1,), generator=g))
        ids[r, :n], mask[r, :n] = document(g, n, vocab), 1
    return ids, ids.masked_fill(mask == 0, -100), mask


def packed_batch(step: int, b: int, s: int, vocab: int):
    g = torch.Generator().manual_seed(10 ** 6 + step)
    ids, pos = torch.zeros(b, s, dtype=torch.long), torch.zeros(b, s, dtype=torch.long)
    for r in range(b):
        at = 0
        while at < s:
            n = min(s - at, int(torch.randint(s // 8, s // 2, (1,), generator=g)))
            ids[r, at:at + n], pos[r, at:at + n] = document(g, n, vocab), torch.arange(n)
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=None, help="a local Hugging Face model directory")
    ap.add_argument("--family", default="llama", choices=["llama", "qwen2", "mistral", "gemma"])
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(1)
    seq = args.seq + (-args.seq) % world          # the sequence must split evenly
    model = build(args).train()
    vocab = model.config.vocab_size if args.model_dir else args.vocab
    steps = {"padded": spdsl.sp_shard(seq=world)(loss_fn(model, "attention_mask")),
             "packed": spdsl.sp_shard(seq=world)(loss_fn(model, "position_ids"))}
    make = {"padded": padded_batch, "packed": packed_batch}
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if rank == 0:
        print(f"{type(model).__name__} ({args.attn}), sequence {seq} split over {world} ranks, "
              f"{sum(p.numel() for p in model.parameters()):,} parameters")
    t0, tokens = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        kind = "padded" if step % 2 else "packed"
        ids, labels, extra = make[kind](step, args.batch, seq, vocab)
        loss = steps[kind](ids, labels, extra)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += ids.numel()
        if rank == 0:
            progress(step, args.steps, kind, loss.item(), tokens / (time.perf_counter() - t0))
    if rank == 0:
        print()
    batches = {k: make[k](10 ** 7, args.batch, seq, vocab) for k in make}
    err_loss, err_grad = parity(model, steps, batches)
    if rank == 0:
        print(f"parity with single-device PyTorch (padded and packed batch, same weights): "
              f"loss rel err {err_loss:.1e}, max gradient rel err {err_grad:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
