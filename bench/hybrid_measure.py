"""Per-rank peak memory of the hybrids' training step, by the allocator, at L and 2L tokens.

    torchrun --standalone --nproc_per_node=2 bench/hybrid_measure.py --seqs 4096 8192 \\
        --families qwen3_5,bamba,minimax,kimi_linear --out bench/results/hybrid_measure_sp2.json

Models: the tiny random hybrids of ``tests/hf/hybrid_cases.py`` (``HYBRIDS``, the configs saved
as ``bench/configs/tiny-<family>``), fp32, Hugging Face's torch paths; spdsl as
``sp_shard(seq=P, remat="none")`` of ``model(input_ids=, labels=, use_cache=False).loss`` (no
recompute, so that every activation the step keeps is in the figure, and the same mode at
every length: ``"fit"`` may choose differently at L and 2L); AdamW; batch 1. Per family and
length, as ``bench/mask_measure.py`` part a does: one warm-up step (traces, creates AdamW's
states), then one measured step (``spdsl.memory.measure_step``: c10's CPU allocator's own bytes
above what was held when the step began; the step is forward, backward, ``AdamW.step()``,
``zero_grad(set_to_none=True)``), the largest rank; beside it the planner's same quantity,
``plan.peak - plan.parameters - plan.optimizer - plan.inputs`` (``plan_memory(...,
rank=r, optimizer="adamw-torch")``). The ratio of each doubling, measured and planned: an
activation linear in the sequence doubles; what does not grow (weights' gradients, the
mixers' states, AdamW's temporaries) pulls the ratio below 2, what grows faster (a
``[S, S]`` score or mask) above it. Each point is measured once more with the step inside a
dispatch mode that only calls the ops (``measured_under_a_mode``): the run the planner models,
where autograd sums gradients out of place (bench/MEMORY.md, "Why Kimi-Linear plans 14%
above the allocator").
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch
import torch.distributed as dist

MIB = 1024.0 ** 2
FAMILIES = ("qwen3_5", "bamba", "minimax", "kimi_linear")
OUT = os.path.join(ROOT, "bench", "results", "hybrid_measure_sp2.json")


def _gather(values: list[float]) -> list[list[float]]:
    """Every rank's ``values``, rank order."""
    t = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


class MixerSaved:
    """Bytes autograd keeps for backward inside the mixer calls of the steps run under it (the
    chunk loops' intermediates, beyond the calls' own inputs): what the planner's stand-in for
    a mixer (``spdsl.lower.mixers._Planned``: output, inputs kept) leaves out."""

    def __enter__(self):
        from spdsl.propagate.mixer_form import Site
        self.bytes, self._orig = 0, Site.call
        orig, me = self._orig, self

        def call(site, tensors, **override):
            inputs = {t.untyped_storage().data_ptr() for t in tensors
                      if isinstance(t, torch.Tensor)}
            seen = set()

            def pack(t):
                key = t.untyped_storage().data_ptr()
                if key not in inputs and key not in seen:
                    seen.add(key)
                    me.bytes += t.untyped_storage().nbytes()
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return orig(site, tensors, **override)
        Site.call = call
        return self

    def __exit__(self, *exc):
        from spdsl.propagate.mixer_form import Site
        Site.call = self._orig


def point(family: str, seq: int, world: int, rank: int) -> dict:
    """One (family, length): planned and measured per rank, above the step's start."""
    import spdsl
    from spdsl.memory import measure_step, plan_memory
    from tests.hf.cases import loss_fn
    from tests.hf.families import batch
    from tests.hf.hybrid_cases import build, mixer_strategies

    gc.collect()
    model = build(family)
    ids, labels = batch(1, seq)
    fn = spdsl.sp_shard(seq=world, remat="none")(loss_fn(model, ("input_ids", "labels")))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    mem = plan_memory(fn, ids, labels, rank=rank, optimizer="adamw-torch")
    planned = mem.peak - mem.parameters - mem.optimizer - mem.inputs
    plan_s = time.perf_counter() - t0
    strategies = sorted(set(mixer_strategies(spdsl.plan(fn, ids, labels))))

    def step():
        fn(ids, labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    with MixerSaved() as saved:
        step()                                      # traces, creates AdamW's states
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    m = measure_step(step, warmup=False)
    step_s = time.perf_counter() - t0
    watched = measure_step(_under_a_mode(step), warmup=False)
    ranks = _gather([planned, m.peak, m.end, warm_s, step_s, plan_s, saved.bytes,
                     watched.peak])
    return {"family": family, "seq": seq, "strategies": strategies,
            "planned": [int(r[0]) for r in ranks], "planned_phase": mem.peak_phase,
            "measured": [int(r[1]) for r in ranks], "end": [int(r[2]) for r in ranks],
            "measured_under_a_mode": [int(r[7]) for r in ranks],
            "mixer_saved": [int(r[6]) for r in ranks],
            "warm_s": round(max(r[3] for r in ranks), 1),
            "step_s": round(max(r[4] for r in ranks), 1),
            "plan_s": round(max(r[5] for r in ranks), 1)}


def _under_a_mode(step):
    """``step`` run under a dispatch mode that does nothing but call each op. Any active mode
    makes autograd treat every tensor as a tensor subclass (ATen's ``isTensorSubclassLike``),
    so the formulas and gradient accumulations that check it take their out-of-place forms:
    the run the planner models (its fake tensors and its count are such modes), which can
    hold more than the unwatched run."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def watched():
        with Calls():
            step()
    return watched


def ratios(rows: list[dict]) -> list[dict]:
    """Per family, peak(2L) / peak(L) for each doubling, measured and planned (largest rank)."""
    out = []
    by = {(r["family"], r["seq"]): r for r in rows}
    for (family, seq), r in by.items():
        nxt = by.get((family, 2 * seq))
        if nxt is None:
            continue
        out.append({"family": family, "seq": seq, "seq2": 2 * seq,
                    "measured": max(nxt["measured"]) / max(r["measured"]),
                    "planned": max(nxt["planned"]) / max(r["planned"])})
    return out


def render(result: dict) -> str:
    lines = ["| model | tokens | measured | planned | measured / planned | measured under a "
             "mode / planned | saved inside the mixers | strategies |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        m, p = max(r["measured"]) / MIB, max(r["planned"]) / MIB
        x = max(r["mixer_saved"]) / MIB
        w = max(r["measured_under_a_mode"]) / MIB if "measured_under_a_mode" in r else None
        lines.append(f"| {r['family']} | {r['seq']:,} | {m:.2f} MiB | {p:.2f} MiB | "
                     f"{m / p:.2f} | {'-' if w is None else f'{w / p:.2f}'} | {x:.2f} MiB | "
                     f"{', '.join(r['strategies'])} |")
    lines += ["", "| model | doubling | measured | planned |", "|---|---|---|---|"]
    for q in result["ratios"]:
        lines.append(f"| {q['family']} | {q['seq']:,} -> {q['seq2']:,} | "
                     f"{q['measured']:.2f} | {q['planned']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--out", default=OUT)
    p.add_argument("--render", action="store_true", help="plain python: print the tables")
    args = p.parse_args(argv)
    if args.render:
        with open(args.out) as f:
            print(render(json.load(f)))
        return 0
    from bench.compare import source_revision
    from spdsl.memory.measure import track_cpu_allocations

    track_cpu_allocations()     # first: the allocator's total is absolute and exact on every thread
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.time()
    rows = []
    for family in args.families.split(","):
        for seq in args.seqs:
            row = point(family, seq, world, rank)
            rows.append(row)
            if rank == 0:
                print(f"{family:12s} {seq:6d}: measured {max(row['measured']) / MIB:8.2f} MiB, "
                      f"under a mode {max(row['measured_under_a_mode']) / MIB:8.2f} MiB, "
                      f"planned {max(row['planned']) / MIB:8.2f} MiB (warm {row['warm_s']} s, "
                      f"step {row['step_s']} s) {row['strategies']}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return 0
    argv_line = " ".join(sys.argv[1:] if argv is None else argv)
    result = {"command": f"torchrun --standalone --nproc_per_node={world} "
                         f"bench/hybrid_measure.py {argv_line}",
              "revision": source_revision(), "world": world, "torch": torch.__version__,
              "minutes": round((time.time() - t0) / 60, 1), "rows": rows,
              "ratios": ratios(rows)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
