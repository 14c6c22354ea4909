"""A hybrid's training step with its sequence mixers split over the ranks by spdsl, against the
same step with the mixers gathered (every rank runs the whole sequence through every
linear-attention and state-space layer: what spdsl did before it recognised them) and, for
Qwen3.5 and Bamba, against a hand-written Megatron-style split
(``bench/baselines/hybrid_handwritten.py``: all-to-alls to a head split around the conv and the
recurrence, hand-written Ulysses at attention), in one launch.

Hugging Face models on their torch paths (the CPU has no flash-linear-attention or mamba_ssm),
fp32, ``sp_shard(seq=P)`` defaults; the gathered variant is the same model traced with the
mixer registry emptied (``spdsl.propagate.mixer_form.MIXERS`` and ``mixers.FORWARDS``), so the
chunked recurrences are traced as ops and placed by the ops' rules. Per family:

- before timing, spdsl's split step and the hand-written step against one device on the same
  weights and batch: the loss (relative, bound 1e-5) and every parameter gradient (relative to
  its largest entry, bound 1e-4, or twice the gradient's fp32 rounding floor where that is
  larger: ``tests/hf/hybrid_cases.rounding_floor``, HF's own chunked Gated DeltaNet in chunks of
  32 instead of 64; Qwen3.5's first ``A_log``). A system out of bounds stops the run;
- the median wall time of the timed steps (forward, backward, the gradients reduced), the
  systems alternating step by step;
- after timing, one more step of each under the PyTorch profiler
  (``bench/baselines/measure.py``: the ``c10d`` dispatcher ops and gloo's own events, what the
  process group ran, read the same way for spdsl's functional collectives and the hand-written
  ``torch.distributed`` calls): bytes sent per rank by kind, and the allocator's peak::

    torchrun --standalone --nproc_per_node=4 bench/hybrid_speed.py --seq 2048 4096 --steps 7 \\
        --families qwen3_5,bamba --out bench/results/hybrid_handwritten_sp4.json
"""

from __future__ import annotations

import argparse
import contextlib
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

FAMILIES = ("qwen3_5", "bamba", "jamba", "minimax")
HANDWRITTEN = ("qwen3_5", "bamba")         # families with a hand-written baseline
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
NAMES = ("input_ids", "labels")


@contextlib.contextmanager
def _gathered():
    """Tracing with no mixer recognised: the recurrences as ops."""
    from spdsl.propagate import mixer_form, mixers
    saved = dict(mixer_form.MIXERS), dict(mixers.FORWARDS)
    mixer_form.MIXERS.clear()
    mixers.FORWARDS.clear()
    try:
        yield
    finally:
        mixer_form.MIXERS.update(saved[0])
        mixers.FORWARDS.update(saved[1])


def _systems(family: str, model, world: int, names: list[str], ids, labels) -> dict:
    """name -> (the model whose gradients it fills, ``run(ids, labels) -> loss``); the gathered
    step is traced here, on ``ids, labels``, with the mixers unknown."""
    import spdsl
    from tests.hf.cases import loss_fn

    out = {}
    if "split" in names:
        split = spdsl.sp_shard(seq=world)(loss_fn(model, NAMES))

        def run_split(ids, labels):
            loss = split(ids, labels)
            loss.backward()
            return loss.item()
        out["split"] = (model, run_split)
    if "handwritten" in names and family in HANDWRITTEN:
        from bench.baselines.hybrid_handwritten import HybridHandwritten
        hw = HybridHandwritten(copy.deepcopy(model))
        out["handwritten"] = (hw.model, hw.step)
    if "gathered" in names:
        with _gathered():
            gathered = spdsl.sp_shard(seq=world)(loss_fn(model, NAMES))
            gathered(ids, labels).backward()
        model.zero_grad(set_to_none=True)

        def run_gathered(ids, labels):
            loss = gathered(ids, labels)
            loss.backward()
            return loss.item()
        out["gathered"] = (model, run_gathered)
    return out


def _exactness(family: str, systems: dict, ref, ids, labels) -> dict:
    """Each checked system's loss and worst gradient error against one device."""
    from tests.hf.cases import loss_fn
    from tests.hf.hybrid_cases import param_errors, rounding_floor

    ref.zero_grad(set_to_none=True)
    loss_ref = loss_fn(ref, NAMES)(ids, labels)
    loss_ref.backward()
    floor = rounding_floor(family, NAMES, (ids, labels), ref)
    out = {}
    for name in ("split", "handwritten"):
        if name not in systems:
            continue
        model, run = systems[name]
        model.zero_grad(set_to_none=True)
        loss = run(ids, labels)
        errs = param_errors(model, ref)
        over = {p: e for p, e in errs.items() if e > max(GRAD_RTOL, 2 * floor.get(p, 0.0))}
        worst = max(errs, key=errs.get)
        out[name] = {"loss": abs(loss - loss_ref.item()) / abs(loss_ref.item()),
                     "grad": errs[worst], "worst": worst, "n_grads": len(errs),
                     "n_params": sum(1 for _ in model.parameters()), "over": over,
                     "floor": {p: f for p, f in floor.items() if 2 * f > GRAD_RTOL}}
        model.zero_grad(set_to_none=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[2048])
    p.add_argument("--steps", type=int, default=3, help="timed steps per system")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--systems", default="split,handwritten,gathered")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from spdsl.memory.measure import track_cpu_allocations
    track_cpu_allocations()     # first: the profiled peaks are exact on every thread
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    from bench.baselines.measure import profile_step
    from bench.compare import source_revision
    from tests.hf.families import batch
    from tests.hf.hybrid_cases import build

    rows = []
    for family in a.families.split(","):
        for seq in a.seq:
            ref = build(family)
            ids, labels = batch(1, seq)
            systems = _systems(family, copy.deepcopy(ref), world, a.systems.split(","),
                               ids, labels)
            t0 = time.perf_counter()
            exact = _exactness(family, systems, ref, ids, labels)   # the first split: traced
            check_s = time.perf_counter() - t0
            bad = {k: v for k, v in exact.items() if v["loss"] > LOSS_RTOL or v["over"]
                   or v["n_grads"] != v["n_params"]}
            if bad:
                raise SystemExit(f"{family} at {seq}: not exact: {bad}")
            times = {k: [] for k in systems}
            losses = {}
            for _ in range(a.steps):
                for k, (model, run) in systems.items():
                    model.zero_grad(set_to_none=True)
                    dist.barrier()
                    t0 = time.perf_counter()
                    losses[k] = run(ids, labels)
                    dist.barrier()
                    times[k].append(time.perf_counter() - t0)
            comm = {}
            for k, (model, run) in systems.items():
                model.zero_grad(set_to_none=True)
                m = profile_step(lambda: run(ids, labels), world, rank)
                comm[k] = {"bytes": m.comm_bytes, "calls": m.comm_calls,
                           "total_bytes": m.total_comm_bytes, "peak_bytes": m.peak_bytes}
            med = {k: statistics.median(v) for k, v in times.items()}
            row = {"family": family, "seq": seq, "sp": world, "median_s": med, "times_s": times,
                   "losses": losses, "exact": exact, "check_s": check_s, "comm": comm}
            if "handwritten" in med:
                row["split_over_handwritten"] = med["split"] / med["handwritten"]
            if "gathered" in med:
                row["split_over_gathered"] = med["split"] / med["gathered"]
            rows.append(row)
            if rank == 0:
                parts = ", ".join(f"{k} {v:.3f} s ({comm[k]['total_bytes'] / 2**20:.2f} MiB)"
                                  for k, v in med.items())
                print(f"{family:8s} seq {seq} sp {world}: {parts}; "
                      + ", ".join(f"{k} loss {v['loss']:.1e} grad {v['grad']:.1e}"
                                  for k, v in exact.items()), flush=True)
    if rank == 0 and a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "torch": torch.__version__, "revision": source_revision(),
                       "command": "torchrun --standalone --nproc_per_node="
                                  f"{world} " + " ".join(sys.argv)}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
