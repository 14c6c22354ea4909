"""A hybrid's training step with its sequence mixers split over the ranks, against the same
step with the mixers gathered (every rank runs the whole sequence through every linear-attention
and state-space layer: what spdsl did before it recognised them), in one launch.

Hugging Face models on their torch paths (the CPU has no flash-linear-attention or mamba_ssm),
fp32, ``sp_shard(seq=P)`` defaults; the gathered variant is the same model traced with the
mixer registry emptied (``spdsl.propagate.mixers.MIXERS`` and ``FORWARDS``), so the chunked
recurrences are traced as ops and placed by the ops' rules. Per family: the median wall time
of the timed steps (forward and backward), the variants alternating step by step, and the loss
of both (equal: the two are the same mathematics)::

    torchrun --standalone --nproc_per_node=4 bench/hybrid_speed.py --seq 2048 \\
        --out bench/results/hybrid_speed_sp4.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch
import torch.distributed as dist

FAMILIES = ("qwen3_5", "bamba", "jamba", "minimax")


@contextlib.contextmanager
def _gathered():
    """Tracing with no mixer recognised: the recurrences as ops."""
    from spdsl.propagate import mixers
    saved = dict(mixers.MIXERS), dict(mixers.FORWARDS)
    mixers.MIXERS.clear()
    mixers.FORWARDS.clear()
    try:
        yield
    finally:
        mixers.MIXERS.update(saved[0])
        mixers.FORWARDS.update(saved[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    import spdsl
    from tests.hf.cases import loss_fn
    from tests.hf.families import batch
    from tests.hf.hybrid_cases import build

    rows = []
    for family in a.families.split(","):
        model = build(family)
        ids, labels = batch(1, a.seq)
        names = ("input_ids", "labels")
        steps = {"split": spdsl.sp_shard(seq=world)(loss_fn(model, names))}
        with _gathered():
            steps["gathered"] = spdsl.sp_shard(seq=world)(loss_fn(model, names))
            steps["gathered"](ids, labels).backward()          # traced here, mixers unknown
        t0 = time.perf_counter()
        steps["split"](ids, labels).backward()
        first = time.perf_counter() - t0
        times = {k: [] for k in steps}
        losses = {}
        for _ in range(a.steps):
            for k, step in steps.items():
                model.zero_grad(set_to_none=True)
                dist.barrier()
                t0 = time.perf_counter()
                loss = step(ids, labels)
                loss.backward()
                dist.barrier()
                times[k].append(time.perf_counter() - t0)
                losses[k] = loss.item()
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"family": family, "seq": a.seq, "sp": world,
               "split_s": med["split"], "gathered_s": med["gathered"],
               "ratio": med["split"] / med["gathered"], "first_split_s": first,
               "loss_split": losses["split"], "loss_gathered": losses["gathered"]}
        rows.append(row)
        if rank == 0:
            print(f"{family:8s} seq {a.seq} sp {world}: split {med['split']:.3f} s, gathered "
                  f"{med['gathered']:.3f} s, ratio {row['ratio']:.2f}; loss "
                  f"{losses['split']:.6f} / {losses['gathered']:.6f}", flush=True)
    if rank == 0 and a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "torch": torch.__version__,
                       "command": " ".join(sys.argv)}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
