"""Train a tiny Llama with ``spdsl.sp_shard(seq=4)`` on 4 CPU ranks, on a task whose answer
lies in another rank's shard, and check it against a single-process run of the same steps.

At the end it reports two parity checks. Every 10 steps, the sequence-parallel loss and every
gradient are compared with single-device PyTorch on the same weights and batch (exact to
fp32 rounding). And a single-process run trains alongside through the same steps from the same
start; its end state is compared too. Over hundreds of AdamW steps two fp32 runs drift apart
even when every step is exact -- rounding differences are amplified by the training dynamics --
so the demo also shows how far a single-device run drifts from itself when its start is moved by
one float32 ulp: the sequence-parallel run should drift no more than that.

The task: each sequence carries a key token at position 1 (rank 0's shard), then a long
stretch of random filler, then a block of ``QUERY key`` pairs at the very end (the last rank's
shard): after each QUERY marker the model must emit the key. Only those answers have labels
(every other label is -100), so valid labels are as uneven across ranks as they can be: the
loss must be the exact global mean. Learning the task proves attention crosses shards.

    torchrun --standalone --nproc_per_node=4 examples/train_llama_sp.py
    torchrun --standalone --nproc_per_node=4 examples/train_llama_sp.py --steps 50 --seq 1024
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
import torch.distributed as dist

import spdsl
from spdsl.models.llama import Llama, LlamaConfig

N_KEYS, QUERY = 16, 255      # keys are tokens 0..15; the query marker is the last token
N_ASK = 8                    # QUERY/key pairs at the end of each sequence


def batch(step: int, b: int, s: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch on every rank (seeded by the step)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(N_KEYS, vocab - 1, (b, s), generator=g)
    keys = torch.randint(0, N_KEYS, (b,), generator=g)
    ids[:, 1] = keys
    ids[:, -2 * N_ASK::2] = QUERY
    ids[:, -2 * N_ASK + 1::2] = keys[:, None]
    labels = torch.full_like(ids, -100)
    # the model shifts inside: the logits at each QUERY predict the key after it
    labels[:, -2 * N_ASK + 1::2] = keys[:, None]
    return ids, labels


def accuracy(model: torch.nn.Module, b: int, s: int, vocab: int) -> float:
    with torch.no_grad():
        ids, _ = batch(10 ** 6, b, s, vocab)
        logits = model(ids)
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        guess = logits[:, -2 * N_ASK::2].argmax(-1)
        return (guess == ids[:, -2 * N_ASK + 1::2]).float().mean().item()


def progress(step: int, steps: int, loss: float, tok_s: float) -> None:
    done = int(30 * step / steps)
    sys.stdout.write(f"\r[{'#' * done}{'.' * (30 - done)}] step {step}/{steps} "
                     f"loss {loss:.4f} {tok_s:,.0f} tok/s")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps (default: %(default)s)")
    ap.add_argument("--seq", type=int, default=256,
                    help="tokens a sequence, split over the ranks (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=8,
                    help="sequences a step, the same on every rank (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=5e-3,
                    help="AdamW learning rate (default: %(default)s)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the per-rank program")
    ap.add_argument("--no-check", action="store_true", help="skip the single-process parity run")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    cfg = LlamaConfig.tiny()
    model = Llama(cfg)
    check = rank == 0 and not args.no_check
    sp_model = spdsl.sp_shard(seq=world, compile=args.compile)(model)
    # single-process companions on rank 0: the same run, the same run one ulp away, a probe
    runs = {}
    if check:
        runs["single"] = copy.deepcopy(model)
        runs["single+1ulp"] = copy.deepcopy(model)
        with torch.no_grad():
            for p in runs["single+1ulp"].parameters():
                p.copy_(torch.nextafter(p, torch.full_like(p, float("inf"))))
        probe = copy.deepcopy(model)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=args.lr)
            for name, m in [("sp", model), *runs.items()]}

    ids, labels = batch(0, args.batch, args.seq, cfg.vocab_size)
    if rank == 0:
        print(f"spdsl: tiny Llama ({sum(p.numel() for p in model.parameters()):,} params), "
              f"{world} ranks, batch {args.batch} x {args.seq} tokens "
              f"({args.seq // world} per rank)")
        print(spdsl.plan(sp_model, ids, labels))

    step_loss, step_grad, t0, tokens = 0.0, 0.0, time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        ids, labels = batch(step, args.batch, args.seq, cfg.vocab_size)
        opts["sp"].zero_grad()
        loss = sp_model(ids, labels)
        loss.backward()
        if check and step % 10 == 1:      # exactness of this step: same weights, one device
            probe.load_state_dict(model.state_dict())
            probe.zero_grad()
            want = probe(ids, labels)
            want.backward()
            step_loss = max(step_loss, abs(loss.item() - want.item()) / abs(want.item()))
            step_grad = max(step_grad, max(((p.grad - q.grad).abs().max() / q.grad.abs().max())
                                           .item() for p, q in zip(model.parameters(),
                                                                   probe.parameters())))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opts["sp"].step()
        for name, m in runs.items():
            opts[name].zero_grad()
            m(ids, labels).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opts[name].step()
        tokens += ids.numel()
        if rank == 0 and (step % 5 == 0 or step == args.steps):
            progress(step, args.steps, loss.item(), tokens / (time.perf_counter() - t0))
    if rank == 0:
        print()
    acc = accuracy(sp_model, 64, args.seq, cfg.vocab_size)
    if rank == 0:
        print(f"task accuracy (key at position 1, answers in the last {2 * N_ASK} positions): "
              f"{acc:.1%} (chance {1 / N_KEYS:.1%})")
    if check:
        print(f"per-step parity with single-device PyTorch (same weights and batch, every 10th "
              f"step): loss rel err {step_loss:.1e}, max gradient rel err {step_grad:.1e}")

        def drift(a: torch.nn.Module, b: torch.nn.Module) -> float:
            return max(((p - q).abs().max() / q.abs().max()).item()
                       for p, q in zip(a.parameters(), b.parameters()))
        single = runs["single"]
        print(f"after {args.steps} steps: parameter drift sequence-parallel vs single-process "
              f"{drift(model, single):.1e}; single-process vs itself moved by one ulp "
              f"{drift(runs['single+1ulp'], single):.1e}; single-process accuracy "
              f"{accuracy(single, 64, args.seq, cfg.vocab_size):.1%}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
