"""Your own training loop around ``spdsl.sp_shard``: a DataLoader, AdamW, an LR schedule,
gradient accumulation and clipping, bf16 autocast, evaluation and checkpoints, all plain
PyTorch; only the forward is sharded. It ends with parity: one optimizer step's loss and
gradients against single-device PyTorch on the same weights and batch (a deepcopy of the model
on every rank). In fp32 they agree to fp32 rounding; under bf16 autocast the gradients differ by
about bf16's unit roundoff (3.9e-3), since each rank's weight gradients come out of bf16
matmuls over its own tokens and are then summed across ranks.

What retraces: the step is cached per program. A new sequence length, ``train()`` vs ``eval()``,
autocast on or off, grad mode (``torch.no_grad()``), input dtypes: each is its own program,
traced the first time it is seen and reused after (here: training, evaluation, and the parity
step in fp32 when training ran under ``--bf16``). A step that keeps retracing warns after 16.

    torchrun --standalone --nproc_per_node=4 examples/train_own_loop.py
    torchrun --standalone --nproc_per_node=4 examples/train_own_loop.py --bf16 --accum 2
    torchrun --standalone --nproc_per_node=4 examples/train_own_loop.py --cuda   # 4 GPUs, NCCL
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import math
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from train_llama_sp import batch  # this script's neighbour: the key-retrieval task

import spdsl
from spdsl.models.llama import Llama, LlamaConfig


def parity(step, model, micro, accum, autocast) -> tuple[float, float]:
    """One optimizer step's loss and max gradient error against a single-device copy."""
    ref = copy.deepcopy(model)                        # plain PyTorch on the same weights
    losses = []
    for m, fn in ((model, step), (ref, ref)):
        m.zero_grad()
        losses.append(0.0)
        for ids, labels in micro:
            with autocast():
                loss = fn(ids, labels) / accum
            loss.backward()
            losses[-1] += loss.item()
    err = max(((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
              for p, q in zip(model.parameters(), ref.parameters()))
    out = torch.tensor([abs(losses[0] - losses[1]) / abs(losses[1]), err], device=next(ref.parameters()).device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)       # the worst rank
    return out[0].item(), out[1].item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps (default: %(default)s)")
    ap.add_argument("--seq", type=int, default=256,
                    help="tokens a sequence, split over the ranks (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=4,
                    help="global micro-batch (default: %(default)s)")
    ap.add_argument("--accum", type=int, default=1,
                    help="micro-batches per optimizer step (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=5e-3,
                    help="peak AdamW learning rate: 5 warm-up steps, then cosine to 0 "
                         "(default: %(default)s)")
    ap.add_argument("--eval-every", type=int, default=10,
                    help="steps between evaluations on a held-out batch, and at the last step "
                         "(default: %(default)s)")
    ap.add_argument("--bf16", action="store_true", help="autocast to bfloat16")
    ap.add_argument("--cuda", action="store_true",
                    help="one GPU per rank, NCCL (needs torch with CUDA and a device)")
    ap.add_argument("--ckpt", default=None,
                    help="checkpoint root (default: a temporary directory, removed at the end)")
    args = ap.parse_args()
    if args.cuda and not torch.cuda.is_available():
        ap.error("--cuda: this torch sees no CUDA device (torch.cuda.is_available() is False); "
                 "run without --cuda for gloo on the CPU")

    if args.cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(1)                      # CPU ranks share the cores
    dist.init_process_group("nccl" if args.cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda" if args.cuda else "cpu")
    mesh = spdsl.mesh(sp=world)

    torch.manual_seed(0)                              # the same weights on every rank
    cfg = LlamaConfig.tiny()
    model = Llama(cfg).to(dev)
    step = spdsl.sp_shard(seq=world, mesh=mesh)(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(       # 5 warm-up steps, then cosine to 0
        opt, lambda i: min(1.0, (i + 1) / 5) * 0.5 * (1 + math.cos(math.pi * i / args.steps)))

    # The same global batch on every rank: the same data, shuffled by the same seed.
    train = TensorDataset(*batch(0, 512, args.seq, cfg.vocab_size))
    held_out = [t.to(dev) for t in batch(1, args.batch, args.seq, cfg.vocab_size)]
    loader = DataLoader(train, batch_size=args.batch, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(0))
    autocast = functools.partial(torch.autocast, dev.type, torch.bfloat16, enabled=args.bf16)

    root = [args.ckpt or (tempfile.mkdtemp(prefix="spdsl_own_") if rank == 0 else None)]
    dist.broadcast_object_list(root)                  # one directory, named by rank 0
    extra = {"sched": sched.state_dict()}
    start = spdsl.load_checkpoint(root[0], model, opt, extra=extra) or 0
    sched.load_state_dict(extra["sched"])
    if rank == 0:
        print(f"tiny Llama, sp={world} on {dev.type}, global batch {args.batch} x {args.seq} "
              f"tokens x {args.accum} micro-batches, bf16 autocast {args.bf16}, resumed at {start}")
    micro = itertools.islice((b for _ in itertools.count() for b in loader), start * args.accum,
                             None)                    # epochs without end, resumed in place
    for i in range(start + 1, args.steps + 1):
        for _ in range(args.accum):
            ids, labels = (t.to(dev) for t in next(micro))
            with autocast():
                loss = step(ids, labels) / args.accum
            loss.backward()                           # gradients add up over micro-batches
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        if i % args.eval_every == 0 or i == args.steps:
            model.eval()                              # eval + no_grad: a program of its own
            with torch.no_grad(), autocast():
                val = step(*held_out).item()
            model.train()
            if rank == 0:
                print(f"step {i}: train loss {loss.item() * args.accum:.4f}, grad norm "
                      f"{norm.item():.3f}, lr {sched.get_last_lr()[0]:.2e}, eval loss {val:.4f}")
    path = spdsl.save_checkpoint(root[0], model, opt, step=args.steps,
                                 extra={"sched": sched.state_dict()})

    micro = [[t.to(dev) for t in next(micro)] for _ in range(args.accum)]
    checks = [("fp32", functools.partial(torch.autocast, dev.type, enabled=False))]
    if args.bf16:
        checks.append(("bf16 autocast", autocast))
    for name, ctx in checks:
        loss_err, grad_err = parity(step, model, micro, args.accum, ctx)
        if rank == 0:
            print(f"parity with single-device PyTorch ({name}, one step of {args.accum} "
                  f"micro-batch(es), same weights and batch): loss rel err {loss_err:.1e}, "
                  f"max gradient rel err {grad_err:.1e}")
    if rank == 0:
        print(f"checkpoint saved to {path}")
        if args.ckpt is None:
            shutil.rmtree(root[0])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
