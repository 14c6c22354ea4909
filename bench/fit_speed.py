"""Step time at SP 2 (gloo, 2 ranks), tiny Llama, 4,096 tokens: the default remat ("fit",
which picks "none" when the step fits) against remat="auto", interleaved step by step; prints
the median of each and their ratio.

    PYTHONPATH=. python bench/fit_speed.py [--steps 10]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from tests.dist import spawn


def run(rank: int, world: int, steps: int):
    import spdsl
    from spdsl.models.llama import Llama, LlamaConfig
    torch.manual_seed(0)
    base = Llama(LlamaConfig.tiny())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (1, 4096), generator=g)
    labels = torch.roll(ids, -1, 1)
    fns = {}
    for name, remat in (("default", None), ("auto", "auto")):
        m = copy.deepcopy(base)
        fns[name] = (m, spdsl.sp_shard(seq=world, remat=remat)(m))
        fns[name][1](ids, labels).backward()        # build outside the timing
    times = {k: [] for k in fns}
    for _ in range(steps):
        for name, (m, f) in fns.items():
            m.zero_grad(set_to_none=True)
            torch.distributed.barrier()
            t = time.perf_counter()
            f(ids, labels).backward()
            torch.distributed.barrier()
            times[name].append(time.perf_counter() - t)
    chosen = spdsl.plan(fns["default"][1], ids, labels).remat.chosen
    return times, chosen


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    res = spawn(run, 2, ap.parse_args().steps)
    times, chosen = res[0]
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"default picks {chosen!r}; median step: default {med['default']*1e3:.0f} ms, "
          f"auto {med['auto']*1e3:.0f} ms, auto/default {med['auto']/med['default']:.2f}x")
