"""Per-rank peak memory of a step vs sequence length, and the step-time cost of each remat
mode, for a small Llama on CPU: SP 1/2/4 x remat none/auto/full, one launch of gloo ranks per
SP degree, every mode timed side by side in the same launch.

    python bench/memory_bench.py                      # ~15 min on 2 cores; writes the PNG
    python bench/memory_bench.py --seqs 512 1024 --time-seq 1024 --worlds 1 2   # quick

Measured: the most bytes c10's CPU allocator held during a real forward + backward above what
it held when the step began (``spdsl.memory.measure``, which shares nothing with the planner):
saved activations, transients and the gradients that exist at that moment; parameters and the
batch were there before. Dashed: the planner's prediction of the same quantity, extended to
lengths not run. Outputs ``bench/memory_bench.png`` and ``bench/memory_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODES = ("none", "auto", "full")


def _step_peak(f, model, ids) -> int:
    from spdsl.memory.measure import measure_step

    def step():
        loss = f(ids, ids)
        loss.backward()
        del loss
        model.zero_grad(set_to_none=True)      # the step ends where it began
    return measure_step(step, warmup=False).peak


def run(rank: int, world: int, seqs: list[int], plan_seqs: list[int], time_seq: int,
        steps: int) -> dict:
    import spdsl
    from spdsl.memory import plan_memory
    from spdsl.memory.measure import track_cpu_allocations
    from spdsl.models.llama import Llama, LlamaConfig

    track_cpu_allocations()
    cfg = LlamaConfig.small()
    torch.manual_seed(0)
    model = Llama(cfg)
    out: dict = {"measured": {}, "planned": {}, "step_s": {}}
    for mode in MODES:
        f = spdsl.sp_shard(seq=world, remat=mode)(model)
        out["measured"][mode] = {}
        out["planned"][mode] = {}
        for s in seqs:
            ids = torch.randint(0, cfg.vocab_size, (1, s))
            f(ids, ids).backward()                 # build + warm up
            model.zero_grad(set_to_none=True)
            out["measured"][mode][s] = _step_peak(f, model, ids)
        for s in sorted(set(seqs) | set(plan_seqs)):
            ids = torch.zeros(1, s, dtype=torch.long)
            p = plan_memory(f, ids, ids, rank=rank, optimizer="none")
            out["planned"][mode][s] = p.peak - p.parameters - p.inputs
    # step times side by side: interleave the modes so load drifts hit each alike
    fns = {m: spdsl.sp_shard(seq=world, remat=m)(model) for m in MODES}
    ids = torch.randint(0, cfg.vocab_size, (1, time_seq))
    for f in fns.values():
        f(ids, ids).backward()
    times = {m: [] for m in MODES}
    for _ in range(steps):
        for m, f in fns.items():
            model.zero_grad(set_to_none=True)
            t = time.perf_counter()
            f(ids, ids).backward()
            times[m].append(time.perf_counter() - t)
    out["step_s"] = {m: sorted(v)[len(v) // 2] for m, v in times.items()}
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted(results, key=int)
    fig, axes = plt.subplots(1, len(worlds), figsize=(5 * len(worlds), 4), sharey=True)
    axes = [axes] if len(worlds) == 1 else axes
    colors = {"none": "tab:red", "auto": "tab:blue", "full": "tab:green"}
    for ax, w in zip(axes, worlds):
        r = results[w]
        for m in MODES:
            ps = sorted(r["planned"][m], key=int)
            ax.plot([int(s) for s in ps], [r["planned"][m][s] / 2 ** 20 for s in ps], "--",
                    color=colors[m], alpha=0.6)
            ms = sorted(r["measured"][m], key=int)
            ratio = r["step_s"][m] / r["step_s"]["none"]
            ax.plot([int(s) for s in ms], [r["measured"][m][s] / 2 ** 20 for s in ms], "o-",
                    color=colors[m], label=f"{m} (step x{ratio:.2f})")
        ax.set_title(f"SP {w}: small Llama, per rank")
        ax.set_xlabel("global sequence length (tokens)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(title="remat (time vs none)")
    axes[0].set_ylabel("step peak above its start (MiB)\nsolid: allocator, dashed: planner")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--plan-seqs", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--time-seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "memory_bench"))
    a = p.parse_args(argv)
    from bench.compare import source_revision
    from tests.dist import spawn

    print(f"revision {source_revision()}", flush=True)
    results = {}
    for w in a.worlds:
        t = time.time()
        # an hour a launch: on loaded cores SP 1 alone has taken over 10 minutes
        results[str(w)] = spawn(run, w, a.seqs, a.plan_seqs, a.time_seq, a.steps,
                                timeout=3600)[0]
        r = results[str(w)]
        print(f"SP {w} ({time.time() - t:.0f} s)")
        for m in MODES:
            meas = "  ".join(f"{s}:{v / 2 ** 20:.1f} (planned {r['planned'][m][s] / v - 1:+.2%})"
                             for s, v in r["measured"][m].items())
            print(f"  {m:5} step {r['step_s'][m]:.3f} s (x{r['step_s'][m] / r['step_s']['none']:.2f})"
                  f"  step peak MiB {meas}")
    with open(a.out + ".json", "w") as fh:
        json.dump(results, fh, indent=1)
    plot(results, a.out + ".png")
    print(f"wrote {a.out}.png and {a.out}.json")


if __name__ == "__main__":
    main()
