"""Causal balance of ring attention: each rank's attention compute, contiguous pieces against
zigzag pieces, in the same launch (spdsl's tiny Llama, fp32, ``attention="ring"``).

With contiguous pieces, rank ``r`` of a causal ring computes ``r + 1`` of its ``R`` steps (the
others' keys all follow its queries): the last rank works ``2R / (R + 1)`` times the average,
and every step waits for it. Zigzag pieces (chunks ``r`` and ``2R - 1 - r`` of ``2R``) give
every rank the same work, for one relayout of q, k, v and of the output per layer.

Per rank and layout: the time inside the kernel's compute range
(``spdsl.kernels.ring_attn.COMPUTE``: a step's blocks, no transfer or wait), read from the
profiler, summed over a training step (forward and backward), median over the timed steps;
and the step's wall time. Layouts alternate step by step::

    torchrun --standalone --nproc_per_node=4 bench/ring_balance.py --seq 8192 \
        --out bench/results/ring_balance_sp4.json
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
from torch.profiler import ProfilerActivity, profile

LAYOUTS = ("contiguous", "zigzag")


def _compute_ms(prof, name: str) -> float:
    return sum(e.cpu_time_total for e in prof.events() if e.name == name) / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--steps", type=int, default=3, help="timed steps per layout")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    import spdsl
    from spdsl.kernels.ring_attn import COMPUTE
    from spdsl.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    ids = torch.randint(0, 256, (1, a.seq), generator=torch.Generator().manual_seed(1))
    steps = {lay: spdsl.sp_shard(seq=world, remat="none", attention=spdsl.AttentionConfig(
        "ring", layout=lay))(model) for lay in LAYOUTS}
    compute = {lay: [] for lay in LAYOUTS}
    wall = {lay: [] for lay in LAYOUTS}
    losses = {}
    for i in range(a.steps + 1):                 # the first round warms up, untimed
        for lay in LAYOUTS:
            model.zero_grad()
            dist.barrier()
            t0 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                loss = steps[lay](ids, ids)
                loss.backward()
            dist.barrier()
            dt = time.perf_counter() - t0
            losses[lay] = loss.item()
            if i:
                compute[lay].append(_compute_ms(prof, COMPUTE))
                wall[lay].append(dt)
    mine = {lay: statistics.median(compute[lay]) for lay in LAYOUTS}
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=False,
                             capture_output=True, text=True).stdout.strip()
        out = {"revision": rev, "seq": a.seq, "world": world, "steps": a.steps,
               "load": os.getloadavg()[0], "losses": losses,
               "compute_ms": {lay: [e[lay] for e in every] for lay in LAYOUTS},
               "step_s": {lay: statistics.median(wall[lay]) for lay in LAYOUTS}}
        print(f"ring attention, tiny Llama, {a.seq:,} tokens, SP {world}, revision {rev}, "
              f"load {out['load']:.1f}; losses {losses}")
        print("layout      " + "".join(f"  rank {r} ms" for r in range(world))
              + "   max/mean   step s")
        for lay in LAYOUTS:
            per = out["compute_ms"][lay]
            print(f"{lay:<11} " + "".join(f"{x:>11.0f}" for x in per)
                  + f"{max(per) / statistics.mean(per):>11.2f}{out['step_s'][lay]:>9.2f}")
        print(f"zigzag / contiguous: busiest rank's compute "
              f"{max(out['compute_ms']['zigzag']) / max(out['compute_ms']['contiguous']):.2f}, "
              f"step {out['step_s']['zigzag'] / out['step_s']['contiguous']:.2f}")
        if a.out:
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
