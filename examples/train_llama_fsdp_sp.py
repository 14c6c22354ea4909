"""Train a tiny Llama on 4 CPU ranks as a dp=2 x sp=2 mesh (the batch split over dp, the
sequence over sp) with its parameters, gradients and AdamW state split over all 4 ranks
(``shard_state=True``); save a checkpoint halfway, tear the model and optimizer down, rebuild
them from other weights, load the checkpoint and carry on.

At the end it reports three checks: the state loaded equals the state saved; every 10th step,
the loss and every gradient equal single-device PyTorch on the same weights and global batch
(to fp32 rounding); and the final weights equal, bit for bit, those of an uninterrupted run of
the same steps on the same mesh, trained alongside. The task is the key retrieval of
``train_llama_sp.py`` (a key at position 1, asked for at the end of the sequence).

    torchrun --standalone --nproc_per_node=4 examples/train_llama_fsdp_sp.py
    torchrun --standalone --nproc_per_node=4 examples/train_llama_fsdp_sp.py --steps 60 --seq 512
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from train_llama_sp import batch, progress  # this script's neighbour

import spdsl
from spdsl.models.llama import Llama, LlamaConfig


def build(seed: int, mesh, args):
    torch.manual_seed(seed)
    model = Llama(LlamaConfig.tiny())
    step_fn = spdsl.sp_shard(model, seq=args.sp, mesh=mesh, shard_state=True,
                             compile=args.compile)
    return model, step_fn, torch.optim.AdamW(model.parameters(), lr=args.lr)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a DTensor shard)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"param {n}": full(p) for n, p in model.named_parameters()}
    names = {p: n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        out.update({f"{k} {names[p]}": full(v) for k, v in st.items()})
    return out


def update(model, opt, loss) -> None:
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps (default: %(default)s)")
    ap.add_argument("--save-at", type=int, default=None,
                    help="the step after which to checkpoint, rebuild and resume "
                         "(default: half of --steps)")
    ap.add_argument("--seq", type=int, default=256,
                    help="tokens a sequence, split over sp (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=8,
                    help="global batch, split over dp (default: %(default)s)")
    ap.add_argument("--dp", type=int, default=2,
                    help="data-parallel size of the mesh; dp x sp = ranks (default: %(default)s)")
    ap.add_argument("--sp", type=int, default=2,
                    help="sequence-parallel size of the mesh (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=5e-3,
                    help="AdamW learning rate (default: %(default)s)")
    ap.add_argument("--ckpt", default=None,
                    help="checkpoint root (default: a temporary directory, removed at the end)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the per-rank program")
    args = ap.parse_args()
    save_at = args.save_at if args.save_at is not None else args.steps // 2

    torch.set_num_threads(1)
    mesh = spdsl.mesh(dp=args.dp, sp=args.sp)
    rank, world = dist.get_rank(), dist.get_world_size()
    root = [args.ckpt or (tempfile.mkdtemp(prefix="spdsl_ckpt_") if rank == 0 else None)]
    dist.broadcast_object_list(root)
    root = root[0]
    cfg = LlamaConfig.tiny()

    model, step_fn, opt = build(0, mesh, args)
    # the uninterrupted run: same start, same steps, same mesh, no checkpoint in between
    ref, ref_fn, ref_opt = build(0, mesh, args)
    probe = Llama(cfg) if rank == 0 else None      # single-device PyTorch, rank 0
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        local = sum(p.to_local().numel() for p in model.parameters())
        print(f"spdsl: tiny Llama ({n:,} params), mesh dp={args.dp} x sp={args.sp} on {world} "
              f"ranks; parameters, gradients and AdamW state split over all {world} "
              f"(rank 0 holds {local:,}); global batch {args.batch} x {args.seq} tokens, "
              f"{args.batch // args.dp} x {args.seq // args.sp} per rank; an uninterrupted run "
              f"trains alongside (tokens/s counts both)")

    step_loss = step_grad = 0.0
    t0, tokens = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        ids, labels = batch(step, args.batch, args.seq, cfg.vocab_size)
        loss = step_fn(ids, labels)
        if step % 10 == 1:     # exactness of this step: same weights and batch, one device
            loss.backward()
            grads = {n: full(p.grad) for n, p in model.named_parameters()}
            weights = {n: full(p) for n, p in model.named_parameters()}
            if rank == 0:
                probe.load_state_dict(weights)
                probe.zero_grad()
                want = probe(ids, labels)
                want.backward()
                step_loss = max(step_loss, abs(loss.item() - want.item()) / abs(want.item()))
                step_grad = max(step_grad, max(
                    ((grads[n] - q.grad).abs().max() / q.grad.abs().max()).item()
                    for n, q in probe.named_parameters()))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        else:
            update(model, opt, loss)
        update(ref, ref_opt, ref_fn(ids, labels))
        tokens += 2 * ids.numel()      # both runs
        if rank == 0 and (step % 5 == 0 or step == args.steps):
            progress(step, args.steps, loss.item(), tokens / (time.perf_counter() - t0))

        if step == save_at:    # checkpoint, tear down, rebuild from other weights, resume
            path = spdsl.save_checkpoint(root, model, opt, step=step)
            saved = full_state(model, opt)
            del model, step_fn, opt
            model, step_fn, opt = build(1, mesh, args)
            resumed = spdsl.load_checkpoint(root, model, opt)
            loaded = full_state(model, opt)
            if rank == 0:
                same = sum(torch.equal(loaded[k], v) for k, v in saved.items())
                size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
                print(f"\ncheckpoint: step {step} saved to {path} ({size / 2**10:.0f} KiB, "
                      f"{len(os.listdir(path))} files); model and optimizer rebuilt, resumed "
                      f"at step {resumed}: {same} of {len(saved)} tensors (weights, exp_avg, "
                      f"exp_avg_sq, step) equal to those saved")
    if rank == 0:
        print()
    final = {n: full(p) for n, p in model.named_parameters()}
    want = {n: full(p) for n, p in ref.named_parameters()}
    if rank == 0:
        same = sum(torch.equal(final[n], want[n]) for n in want)
        diff = max((final[n] - want[n]).abs().max().item() for n in want)
        print(f"per-step parity with single-device PyTorch (same weights and global batch, every "
              f"10th step): loss rel err {step_loss:.1e}, max gradient rel err {step_grad:.1e}")
        print(f"final weights vs the uninterrupted run: {same} of {len(want)} tensors bitwise "
              f"equal (max abs diff {diff:.1e})")
        if args.ckpt is None:
            shutil.rmtree(root)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
