"""Step time of padded or packed Hugging Face batches: spdsl with the fused CPU path for causal x
key-side masks and packed documents (``spdsl.kernels.masked_attn_keys``), spdsl on its block
kernel (``masked_attn_keys.FUSED = False``), and ALST's Hugging Face integration, interleaved
in one launch at SP 2.

    torchrun --standalone --nproc_per_node=2 bench/mask_speed.py --seqs 4096 8192 --steps 6 \\
        --out bench/results/mask_speed_sp2.json
    torchrun --standalone --nproc_per_node=2 bench/mask_speed.py --case packed \\
        --seqs 4096 8192 --steps 6 --out bench/results/mask_speed_packed_sp2.json

The model and batches are ``bench/mask_measure.py``'s (a tiny HF Llama, 8 query / 2 kv heads,
SDPA; ``padded``: the last quarter of the row ``attention_mask`` 0, labels -100; ``packed``:
``position_ids`` restarting every 1,024 tokens; ``eager``: a plain batch, the model in eager
attention, whose mask is additive; ``window``: a plain batch, Mistral of the same widths with a
sliding window of 1,024 tokens; ``eager_left``: eager attention, the first quarter of the row
padding, labels -100 there), spdsl ``sp_shard(seq=2, remat="full")``, ALST
with HF gradient checkpointing (the same policy). ALST's adapter drops the 4-D mask and attends
causally over the whole row: with right padding no kept token attends to a padded one, so its
loss is the same; packed, its tokens attend across documents, with a window, to every
earlier token, and with left padding, to the padding, so its loss is not (the table gives the
difference). A step is forward, backward
and AdamW from a barrier, the slowest rank; the systems alternate step by step (A B C, C B A).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch
import torch.distributed as dist

from bench.mask_measure import SpdslMaskTrainer, _tokens, alst_trainer


class _Fused:
    """An spdsl trainer with the fused path on or off for its own steps."""

    def __init__(self, trainer, fused: bool) -> None:
        self.trainer, self.fused = trainer, fused

    def __getattr__(self, name):
        return getattr(self.trainer, name)

    def forward_backward(self, *batch) -> float:
        from spdsl.kernels import masked_attn_keys
        masked_attn_keys.FUSED = self.fused
        return self.trainer.forward_backward(*batch)


def _step(system, batch) -> tuple[float, float]:
    dist.barrier()
    t0 = time.perf_counter()
    loss = system.forward_backward(*batch)
    system.optimizer_step()
    system.zero_grad()
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item(), loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=("padded", "packed", "eager", "window", "eager_left"),
                   default="padded")
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    rows = []
    for seq in a.seqs:
        systems = {"spdsl fused": _Fused(SpdslMaskTrainer(a.case, True, world), True),
                   "spdsl blocks": _Fused(SpdslMaskTrainer(a.case, True, world), False),
                   "alst": alst_trainer(a.case, world, rank)}
        names = list(systems)
        batches = [_tokens(seq, j) for j in range(a.warmup + a.steps)]
        times = {k: [] for k in names}
        losses = {k: [] for k in names}
        for j, tokens in enumerate(batches):
            for k in names if j % 2 == 0 else names[::-1]:
                t, loss = _step(systems[k], systems[k].prepare(*tokens))
                losses[k].append(loss)
                if j >= a.warmup:
                    times[k].append(t)
        med = {k: statistics.median(times[k]) for k in names}
        rows.append({"seq": seq, "times": times, "losses": losses, "median": med})
        if rank == 0:
            print(f"| {seq} | " + " | ".join(
                f"{k} {med[k]:.3f} s" for k in names) +
                f" | fused/blocks {med['spdsl fused'] / med['spdsl blocks']:.2f}"
                f" | fused/alst {med['spdsl fused'] / med['alst']:.2f} | max loss diff "
                f"{max(abs(x - y) for x, y in zip(losses['spdsl fused'], losses['alst'])):.1e}"
                f" (vs alst), "
                f"{max(abs(x - y) for x, y in zip(losses['spdsl fused'], losses['spdsl blocks'])):.1e}"
                " (vs blocks) |", flush=True)
    if rank == 0 and a.out:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False,
                             capture_output=True, text=True, cwd=ROOT).stdout.strip()
        with open(a.out, "w") as f:
            json.dump({"revision": rev, "world": world, "case": a.case,
                       "load": os.getloadavg(), "rows": rows},
                      f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
