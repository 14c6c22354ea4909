"""Steps of forwards that read tensor values in Python (graph breaks), after the first: the
recorded segments replayed (``spdsl.annotate.breaks``: a path seen before traces nothing)
against the same function traced every call (``Segments.replay = False``: what spdsl did
before) and against the same math written as tensor ops (one program, no break).

- ``reads``: 3 layers, each with a branch on a global statistic (``if h.mean() > 0``) and a
  ``.item()`` scale (``h / h.pow(2).mean().item()``); ``tensor ops``: the branch as
  ``torch.where`` and the scale as a 0-dim tensor (detached, as a Python float is). An SGD step
  after every step, and a fresh batch whose mean alternates in sign, so the read values change
  every step and the branches switch back and forth.
- ``opt``: a 4-layer OPT (Hugging Face) in training mode with ``layerdrop=0.5`` (a
  ``torch.rand([]) < layerdrop`` read per layer), replayed against traced every call.

Before timing, each system's loss and every gradient are compared with a single-device copy on
the same weights and batch (relative, bound 1e-5; stops the run otherwise). Reported: the
median wall time of the timed steps (forward, backward, SGD step), the systems alternating step
by step, the traces and replays the segmented runs counted, and the medians of the timed steps
that replayed and of those that traced (a step down a path not seen before; OPT's layerdrop has
16 paths, so a short run traces on most steps and a long one on at most 16)::

    torchrun --standalone --nproc_per_node=2 bench/breaks_speed.py --tokens 1024 --steps 12
    torchrun --standalone --nproc_per_node=4 bench/breaks_speed.py --tokens 1024 --steps 12

``--profile 20``: only the Python calls and CPU time a replayed step costs on rank 0
(``cProfile``), against the tensor-op program::

    torchrun --standalone --nproc_per_node=4 bench/breaks_speed.py --tokens 1024 --profile 20
"""

from __future__ import annotations

import argparse
import copy
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
from torch import nn

import spdsl
from spdsl.annotate.breaks import Segments

TOL = 1e-5


class Reads(nn.Module):
    """Per layer: a branch on the layer's global mean and a ``.item()`` scale."""

    def __init__(self, dim: int, layers: int = 3) -> None:
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x):
        for up, down in zip(self.up, self.down):
            h = up(x)
            h = h.relu() if h.mean() > 0 else h.tanh()
            scale = h.pow(2).mean().item()
            x = x + down(h / scale)
        return x.pow(2).mean()


class TensorOps(Reads):
    """The same math with no value read in Python: one program."""

    def forward(self, x):
        for up, down in zip(self.up, self.down):
            h = up(x)
            h = torch.where(h.mean() > 0, h.relu(), h.tanh())
            scale = h.pow(2).mean().detach()
            x = x + down(h / scale)
        return x.pow(2).mean()


def _batch(k: int, tokens: int, dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(1, tokens, dim, generator=g) + (0.5 if k % 2 else -0.5)


def _check(step, model, ref, args) -> float:
    """Loss and every gradient of one step against the single-device copy."""
    model.zero_grad()
    ref.zero_grad()
    loss = step(*args)
    loss.backward()
    want = ref(*args)
    want.backward()
    worst = abs(float(loss) - float(want)) / abs(float(want))
    for p, q in zip(model.parameters(), ref.parameters()):
        if q.grad is None:
            continue
        worst = max(worst, float((p.grad - q.grad).abs().max() /
                                 q.grad.abs().max().clamp_min(1e-12)))
    return worst


def _systems(names, make, batches, steps: int, lr: float) -> dict:
    """Each system's median step time, alternating systems step by step."""
    times = {n: [] for n in names}
    kinds = {n: {"traced": [], "replayed": []} for n in names}
    built = {n: make(n) for n in names}
    for k in range(steps):
        for n in names:
            step, model, replay = built[n]
            Segments.replay = replay
            args = batches(k)
            seg = step._segmented
            before = seg.traces if seg is not None else 0
            dist.barrier()
            t0 = time.perf_counter()
            model.zero_grad()
            step(*args).backward()
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.sub_(lr * p.grad)
            dist.barrier()
            if k >= 2:                  # the first steps trace and build the programs
                times[n].append(time.perf_counter() - t0)
                seg = step._segmented
                if seg is not None:
                    kinds[n]["traced" if seg.traces > before else "replayed"].append(times[n][-1])
    Segments.replay = True
    out = {}
    for n in names:
        step = built[n][0]
        seg = step._segmented
        out[n] = {"median_s": statistics.median(times[n]),
                  "traces": seg.traces if seg is not None else 0,
                  "replays": seg.replays if seg is not None else 0,
                  # the timed steps by kind: a step down a new path traces
                  **{f"{kind}_median_s": statistics.median(v) if v else None
                     for kind, v in kinds[n].items()}}
    return out


def reads(world: int, tokens: int, dim: int, steps: int) -> dict:
    torch.manual_seed(0)
    base = Reads(dim)

    def make(name):
        model = (TensorOps if name == "tensor ops" else Reads)(dim)
        model.load_state_dict(base.state_dict())
        return spdsl.sp_shard(seq=world)(model), model, name != "reads, traced every call"

    for name in ("reads", "reads, traced every call", "tensor ops"):
        step, model, replay = make(name)
        Segments.replay = replay
        ref = copy.deepcopy(model)
        worst = max(_check(step, model, ref, (_batch(k, tokens, dim),)) for k in range(3))
        Segments.replay = True
        if worst > TOL:
            raise SystemExit(f"{name}: off one device by {worst:.2e}")
    return _systems(("reads", "reads, traced every call", "tensor ops"), make,
                    lambda k: (_batch(k, tokens, dim),), steps, 1e-2)


def profile(tokens: int, dim: int, steps: int) -> dict:
    """Python calls and CPU milliseconds a step on this rank (``cProfile``) over ``steps``
    steps after 3 warm ones, one batch (one path, replayed), SGD-free: the reads model and the
    tensor-op program."""
    import cProfile
    import pstats
    out = {}
    for name, cls in (("reads", Reads), ("tensor ops", TensorOps)):
        torch.manual_seed(0)
        model = cls(dim)
        step = spdsl.sp_shard(seq=dist.get_world_size())(model)
        x = _batch(1, tokens, dim)
        for _ in range(3):
            step(x).backward()
        prof = cProfile.Profile()
        t0 = time.process_time()
        prof.enable()
        for _ in range(steps):
            model.zero_grad()
            step(x).backward()
        prof.disable()
        out[name] = {"calls": pstats.Stats(prof).total_calls / steps,
                     "cpu_ms": (time.process_time() - t0) / steps * 1e3}
    return out


def opt(world: int, steps: int) -> dict:
    from tests.hf.cases import GRAD_FLOOR
    from tests.hf.families import batch, build
    ids, labels = batch()

    def make(name):
        model = build("opt", num_hidden_layers=4, layerdrop=0.5).train()
        return (spdsl.sp_shard(seq=world)(
            lambda i, lab: model(input_ids=i, labels=lab, use_cache=False).loss),
            model, name == "opt, replayed")

    for name in ("opt, replayed", "opt, traced every call"):
        step, model, replay = make(name)
        Segments.replay = replay
        ref = copy.deepcopy(model)
        worst = 0.0
        for k in range(4):
            torch.manual_seed(k)
            model.zero_grad()
            loss = step(ids, labels)
            loss.backward()
            torch.manual_seed(k)
            ref.zero_grad()
            want = ref(input_ids=ids, labels=labels, use_cache=False).loss
            want.backward()
            worst = max(worst, abs(float(loss) - float(want)) / abs(float(want)))
            # a gradient zero in exact arithmetic (OPT's key bias) is rounding noise: measured
            # against a share of the largest gradient, as tests/hf does
            top = max(float(q.grad.abs().max()) for q in ref.parameters() if q.grad is not None)
            for p, q in zip(model.parameters(), ref.parameters()):
                if q.grad is not None:
                    worst = max(worst, float((p.grad - q.grad).abs().max()) /
                                max(float(q.grad.abs().max()), GRAD_FLOOR * top))
        Segments.replay = True
        if worst > TOL:
            raise SystemExit(f"{name}: off one device by {worst:.2e}")

    def batches(k):
        torch.manual_seed(1000 + k)         # the same draws on every rank
        return ids, labels

    return _systems(("opt, replayed", "opt, traced every call"), make, batches, steps, 1e-3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default="")
    ap.add_argument("--no-opt", action="store_true", help="the reads model only")
    ap.add_argument("--profile", type=int, default=0,
                    help="only Python calls and CPU a step on rank 0, over this many steps")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    if a.profile:
        got = profile(a.tokens, a.dim, a.profile)
        if dist.get_rank() == 0:
            for n, v in got.items():
                print(f"SP {world} {n:12s} {v['calls']:7.0f} Python calls a step, "
                      f"{v['cpu_ms']:.1f} ms CPU (rank 0, cProfile on)")
        dist.destroy_process_group()
        return
    res = {"world": world, "tokens": a.tokens, "dim": a.dim}
    res.update(reads(world, a.tokens, a.dim, a.steps))
    if not a.no_opt:
        res.update(opt(world, a.steps))
    if dist.get_rank() == 0:
        r, t, o = res["reads"], res["reads, traced every call"], res["tensor ops"]
        print(f"SP {world}, {a.tokens} tokens, hidden {a.dim}, median of {a.steps - 2} steps")
        for n in ("reads", "reads, traced every call", "tensor ops", "opt, replayed",
                  "opt, traced every call"):
            if n not in res:
                continue
            v = res[n]
            split = "".join(f"  {kind} {v[kind + '_median_s']:.4f} s"
                            for kind in ("replayed", "traced")
                            if v.get(kind + "_median_s") is not None)
            print(f"  {n:28s} {v['median_s']:.4f} s   traces {v['traces']:3d}  "
                  f"replays {v['replays']:3d} {split}")
        print(f"  reads / tensor ops: replayed {r['median_s'] / o['median_s']:.2f}x, "
              f"traced every call {t['median_s'] / o['median_s']:.2f}x")
        if "opt, replayed" in res:
            print(f"  opt: traced every call / replayed "
                  f"{res['opt, traced every call']['median_s'] / res['opt, replayed']['median_s']:.2f}x")
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
