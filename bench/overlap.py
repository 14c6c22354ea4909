"""Ulysses with its exchanges pipelined by head groups against one exchange each way, or
(``--grad``) gradient buckets reduced during backward against each waited where it starts:
exposed communication and step time, interleaved in one launch.

    torchrun --standalone --nproc_per_node=4 bench/overlap.py --seq 4096 --steps 10 \\
        --out bench/results/overlap_sp4.json
    torchrun --standalone --nproc_per_node=4 bench/overlap.py --grad --model small --seq 1024 \\
        --steps 10 --bucket-mib 1 --out bench/results/grad_overlap_sp4_1mib.json

Systems (same weights and batches; ``attention="ulysses"``, default remat): ``spdsl-g1``
(``spdsl.lower.ops.ULYSSES_GROUPS = 1``: today's one exchange in, one out), ``spdsl-g2`` (2 head
groups, the output projection fused into the attention: ``spdsl.lower.project``),
``spdsl-g2-unfused`` (2 head groups, the projection after the attention), and hand-written DeepSpeed-Ulysses (``bench/baselines/ulysses.py``) where deepspeed
imports. The model is the tiny Llama with 8 query and 4 kv heads (``tiny-h8``): at SP 4 a
rank holds 2 query heads, so 2 groups are possible (the plain tiny Llama has 1 a rank).

Timed steps alternate the systems step by step (A B C, then C B A, ...); a step is forward +
backward + AdamW from a barrier, the slowest rank. Then ``--profiled`` profiled steps per
system, alternating too: **exposed communication** is the time the rank's own thread spends
inside collectives -- functional collectives' issue and ``wait_tensor`` (spdsl), ``c10d``
calls and the blocking wait that follows them up to the next op (hand-written Ulysses, whose
``dist.all_to_all_single`` waits without a profiler record of its own) -- summed per step,
and its share of that rank's profiled step; the mean over ranks and profiled steps. Beside
it, the plan's cost model of the same step (``plan.timing().exposed_share``, CPU links: the
share the links alone would leave exposed, without other ranks' compute to wait for).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.baselines.data import make_batches
from bench.baselines.model import CONFIGS
from bench.baselines.systems import RunConfig, Unavailable


def _exposed(prof) -> float:
    """Seconds this thread spent inside collectives during the profiled region."""
    main = None
    evs = sorted(prof.events(), key=lambda e: e.time_range.start)
    for e in evs:
        if e.name.startswith(("_c10d_functional::", "c10d::")):
            main = e.thread
            break
    events = [e for e in evs if e.thread == main]
    total, covered_to = 0.0, -1.0
    for i, e in enumerate(events):
        start, end = e.time_range.start, e.time_range.end
        if end <= covered_to:
            continue                             # nested inside one already counted
        if e.name.startswith("c10d::"):
            # a blocking eager call: its wait runs until the next op on this thread starts
            nxt = next((f.time_range.start for f in events[i + 1:]
                        if f.time_range.start >= end), end)
            end = max(end, nxt)
        elif not e.name.startswith("_c10d_functional::"):
            continue
        start = max(start, covered_to)
        total += end - start
        covered_to = end
    return total / 1e6


class _Spdsl:
    def __init__(self, cfg: RunConfig, groups: int, grad_overlap: bool = True,
                 fuse: bool = True) -> None:
        from bench.baselines.spdsl_adapter import SpdslTrainer
        self.groups, self.grad_overlap, self.fuse = groups, grad_overlap, fuse
        self.trainer = SpdslTrainer(cfg, False, attention="ulysses")

    def _modes(self) -> None:
        from spdsl.collectives import grads
        from spdsl.lower import ops, project
        ops.ULYSSES_GROUPS = self.groups
        project.FUSE = self.fuse
        grads.GRAD_OVERLAP = self.grad_overlap

    def step(self, ids, labels) -> float:
        self._modes()
        return _step(self.trainer, ids, labels)

    def modelled(self, ids, labels) -> float:
        """The plan's cost model (``plan.timing()``, CPU links): exposed share of the step."""
        import spdsl
        self._modes()
        return spdsl.plan(self.trainer.fn, ids, labels).timing().exposed_share


class _Plain:
    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def step(self, ids, labels) -> float:
        return _step(self.trainer, ids, labels)


def _step(trainer, ids, labels) -> float:
    trainer.zero_grad()
    loss = trainer.forward_backward(ids, labels)
    trainer.optimizer_step()
    return loss


def _timed(system, ids, labels) -> tuple[float, float]:
    dist.barrier()
    t0 = time.perf_counter()
    loss = system.step(ids, labels)
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item(), loss


def _profiled(system, ids, labels) -> tuple[float, float]:
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        system.step(ids, labels)
        step = time.perf_counter() - t0
    return _exposed(prof), step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--model", default="tiny-h8")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profiled", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--bucket-mib", type=float, default=None,
                   help="gradient bucket cap (default: spdsl's, 32 MiB: a model smaller than "
                        "that has one bucket, complete only when backward ends)")
    p.add_argument("--grad", action="store_true",
                   help="gradient buckets reduced during backward (spdsl-overlap, the default) "
                        "against each bucket waited where it starts (spdsl-sync)")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cfg = RunConfig(a.model, a.batch, world, rank, seed=0, lr=1e-3)
    if a.bucket_mib is not None:
        from spdsl.lower import grad_buckets as graph
        graph.GRAD_BUCKET_BYTES = int(a.bucket_mib * 2 ** 20)
    if a.grad:
        systems = {"spdsl-sync": _Spdsl(cfg, 1, grad_overlap=False),
                   "spdsl-overlap": _Spdsl(cfg, 1, grad_overlap=True)}
    else:
        systems = {"spdsl-g1": _Spdsl(cfg, 1), "spdsl-g2-unfused": _Spdsl(cfg, 2, fuse=False),
                   "spdsl-g2": _Spdsl(cfg, 2)}
    try:
        from bench.baselines import ulysses
        systems["ulysses"] = _Plain(ulysses.build(cfg, False))
    except Unavailable as e:
        if rank == 0:
            print(f"ulysses: unavailable ({e})")
    first = next(iter(systems))
    n = a.warmup + a.steps + a.profiled
    batches = make_batches(n, a.batch, a.seq, CONFIGS[a.model]().vocab_size, seed=0)
    names = list(systems)
    times = {k: [] for k in names}
    losses = {k: [] for k in names}
    for j, (ids, labels) in enumerate(batches[:a.warmup + a.steps]):
        order = names if j % 2 == 0 else names[::-1]
        for k in order:
            t, loss = _timed(systems[k], ids, labels)
            losses[k].append(loss)
            if j >= a.warmup:
                times[k].append(t)
    exposed = {k: [] for k in names}
    for j, (ids, labels) in enumerate(batches[a.warmup + a.steps:]):
        for k in (names if j % 2 == 0 else names[::-1]):
            e, s = _profiled(systems[k], ids, labels)
            got = [None] * world
            dist.all_gather_object(got, (e, s))
            exposed[k].extend(got)
    ids, labels = batches[0]
    model = {k: systems[k].modelled(ids, labels) if isinstance(systems[k], _Spdsl) else None
             for k in names}
    if rank == 0:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "spdsl"],
                               check=False, capture_output=True, text=True).stdout.strip()
        out = {"revision": rev + ("+dirty" if dirty else ""), "seq": a.seq, "world": world,
               "model": a.model, "load": os.getloadavg(), "steps": a.steps,
               "bucket_mib": a.bucket_mib, "systems": {}}
        base = statistics.median(times[first])
        cap = f", buckets of {a.bucket_mib:g} MiB" if a.bucket_mib is not None else ""
        print(f"revision {out['revision']}, SP {world}, {a.seq} tokens, model {a.model}{cap}, "
              f"load {os.getloadavg()[0]:.1f}")
        print(f"| system | step s: median (min-max) | vs {first} | paired ratio median | "
              f"exposed comm s / step | exposed share | cost model's exposed share | "
              f"max loss diff vs {first} |")
        print("|---|---|---|---|---|---|---|---|")
        for k in names:
            med = statistics.median(times[k])
            paired = statistics.median(x / y for x, y in zip(times[k], times[first]))
            ex = statistics.mean(e for e, _ in exposed[k])
            share = statistics.mean(e / s for e, s in exposed[k])
            dl = max(abs(x - y) for x, y in zip(losses[k], losses[first]))
            out["systems"][k] = {"times": times[k], "losses": losses[k],
                                 "exposed": exposed[k], "modelled_share": model[k]}
            mod = "-" if model[k] is None else f"{model[k]:.1%}"
            print(f"| {k} | {med:.3f} ({min(times[k]):.3f}-{max(times[k]):.3f}) | "
                  f"{med / base:.2f} | {paired:.2f} | {ex:.3f} | {share:.1%} | {mod} | "
                  f"{dl:.1e} |")
        if a.out:
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
