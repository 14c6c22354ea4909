"""Train the tiny Llama of ``tests/checkpoint`` on a dp=2 x sp=2 mesh with its state split
over the 4 ranks, a checkpoint every few steps, resuming from the newest complete one at start.
With ``--crash-at-step N`` rank 1 kills itself (SIGKILL) right after step N of the first
attempt; torchrun then restarts the whole group, which resumes from the last checkpoint.
``--reference-out`` first trains the same steps without checkpoints (once: a restarted attempt
finds the file) and saves its final weights there, to compare with.

    PYTHONPATH=. torchrun --standalone --nproc_per_node=4 --max-restarts=1 \
        tests/checkpoint/train_resume.py \
        --ckpt /tmp/ckpt --out /tmp/weights.pt --reference-out /tmp/ref.pt --crash-at-step 5
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist

import spdsl
from tests.checkpoint._train import build, optimizer, sharded, train, weights


def _save(obj, path: str) -> None:
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True, help="rank 0 saves the final full weights here")
    ap.add_argument("--reference-out", default=None)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--crash-at-step", type=int, default=0)
    args = ap.parse_args()

    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.reference_out and not os.path.exists(args.reference_out):
        ref = build()
        ref_fn = sharded(ref, 2, 2)       # spdsl.mesh starts the process group, restart-safe
        ref_opt = optimizer(ref)
        train(ref_fn, ref, ref_opt, 1, args.steps)
        final = weights(ref)
        if dist.get_rank() == 0:
            _save(final, args.reference_out)
        del ref, ref_fn, ref_opt

    model = build()
    step_fn = sharded(model, 2, 2)
    rank = dist.get_rank()
    opt = optimizer(model)
    start = spdsl.load_checkpoint(args.ckpt, model, opt) or 0
    if rank == 0:
        with open(args.out + ".log", "a") as f:
            f.write(f"attempt {attempt} resumed from step {start}\n")
    for step in range(start + 1, args.steps + 1):
        train(step_fn, model, opt, step, step)
        if step % args.save_every == 0:
            spdsl.save_checkpoint(args.ckpt, model, opt, step=step)
        if step == args.crash_at_step and attempt == 0 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    final = weights(model)
    if rank == 0:
        _save(final, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
