"""Side-by-side sequence-parallel training: reference, spdsl, hand-written DeepSpeed-Ulysses,
hand-written ring attention, DeepSpeed AutoSP. Same model, weights, batches and labels for all;
gloo CPU ranks.

One configuration (4 ranks, 4096 tokens)::

    torchrun --standalone --nproc_per_node=4 bench/compare.py --seq 4096 --out /tmp/sp4.json

CI smoke (one step, 256 tokens, reference + hand-written Ulysses, exits 1 on a parity miss)::

    torchrun --standalone --nproc_per_node=2 bench/compare.py --smoke --systems ulysses-eager \
        --check 1e-5

Everything that bench/RESULTS.md reports (SP 2 at 4096 tokens, SP 4 over 1K..16K tokens, two
label variants at SP 2, the plot), then rewrites its tables (runs and times: bench/README.md)::

    python bench/compare.py --suite            # or --suite sp4_8k; --render: tables only

Needs matplotlib (the ``bench`` extra) for the plot, and deepspeed==0.19.8 for the DeepSpeed
systems (install it with torch pinned, see bench/README.md; without it they report
"unavailable"). Per system it prints: median step time after warm-up, the
ratio to hand-written Ulysses in the same mode, the first (compiling) step, loss and gradient
relative error against the single-process reference, bytes sent per rank per step by kind
of collective beside the analytic Ulysses floor (ring systems: the ring floor, their point-to-point
sends under "other"), and peak tensor memory per rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

# DeepSpeed picks its accelerator at import; CPU here, whatever imports it first.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch
import torch.distributed as dist

from bench.baselines import report
from bench.baselines.analytic import ring_floor, ulysses_floor
from bench.baselines.data import make_batches
from bench.baselines.hf_model import EXPERTS
from bench.baselines.model import CONFIGS
from bench.baselines.runner import Workload, run_all
from bench.baselines.systems import HF_SYSTEMS, SYSTEMS, RunConfig, select


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", choices=sorted(CONFIGS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, nargs="+", default=None,
                   help="global tokens per sequence; several make a sweep (4096)")
    p.add_argument("--steps", type=int, default=None, help="timed steps after warm-up (5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first steps (2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ignore-prefix", type=float, default=0.0,
                   help="mask this fraction of each sequence's first labels (SFT prompt)")
    p.add_argument("--labels", choices=("shifted", "window"), default="shifted",
                   help="shifted: labels = input_ids moved left, last -100 (default); "
                        "window: seq+1 tokens, every label valid")
    p.add_argument("--systems", nargs="*", default=None,
                   help="names (ulysses) or name-mode (ulysses-compiled); reference always runs")
    p.add_argument("--smoke", action="store_true", help="1 step at 256 tokens, for CI")
    p.add_argument("--check", type=float, default=None,
                   help="exit 1 if a system that ran misses the loss (and grad) parity bound")
    p.add_argument("--top", type=int, default=0, metavar="K",
                   help="print each system's K most expensive ops (self CPU) in its profiled step")
    p.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    p.add_argument("--suite", nargs="*", default=None, metavar="RUN",
                   help="plain python: launch the configurations of bench/RESULTS.md (all, or "
                        "the named ones) via torchrun, then rewrite its tables")
    p.add_argument("--render", action="store_true",
                   help="plain python: rewrite RESULTS.md tables and plot from saved JSON")
    p.add_argument("--hf", action="store_true",
                   help="the Hugging Face comparison: a tiny random LlamaForCausalLM of the same "
                        "shape under the HF reference, spdsl and ALST (UlyssesSPAttentionHF)")
    p.add_argument("--moe", action="store_true",
                   help="with --hf: a tiny random MixtralForCausalLM of the same widths (4 "
                        "experts, top 2, the router's load-balancing loss in the loss) instead")
    p.add_argument("--order", choices=("fixed", "alternate"), default="fixed",
                   help="timed rounds in the same system order, or every other one reversed")
    p.add_argument("--abab", default=None, metavar="NAME",
                   help="plain python: --launches torchrun launches of these arguments with "
                        "--order alternate; bench/results/abab/NAME*.json, then the summary "
                        "(median and spread of per-launch medians, ratios) and RESULTS.md")
    p.add_argument("--launches", type=int, default=3, help="with --abab (3)")
    p.add_argument("--nproc", type=int, default=4, help="with --abab: ranks per launch (4)")
    args = p.parse_args(argv)
    defaults = ([256], 1, 0) if args.smoke else ([4096], 5, 2)
    for name, value in zip(("seq", "steps", "warmup"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def source_revision() -> str:
    """The repository revision measured (spdsl changes fast: results must say which one).

    ``-dirty`` when code differs from the commit; documents and result files (``*.md``,
    ``bench/results``, the memory benchmarks' ``bench/memory_*.json``), which change while a
    suite runs, do not count.
    """
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
        clean = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ".", ":!*.md",
                                ":!bench/results", ":!bench/memory_*.json", ":!*.png"],
                               cwd=ROOT, check=False).returncode
        return head + ("" if clean == 0 else "-dirty")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args: argparse.Namespace) -> list[dict] | None:
    """All systems at every ``--seq`` on this rank; rank 0 returns one result per length."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    load_before = os.getloadavg()[0]     # the machine is shared: say how busy it was
    revision = source_revision()         # at the start: the tree may change during a run
    from spdsl.memory.measure import track_cpu_allocations
    track_cpu_allocations()      # the allocator counts frees on gloo's threads too (the peaks)
    # Long steps at 16K tokens: time out a stuck collective after 15 min, not gloo's 30.
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=15))
    cfg = RunConfig(model=args.model, batch=args.batch, world=world, rank=rank, seed=args.seed,
                    lr=args.lr, hf_family="mixtral" if args.moe else "llama")
    vocab = CONFIGS[args.model]().vocab_size
    workloads = []
    for i, seq in enumerate(args.seq):
        batches = make_batches(args.warmup + args.steps + 1, args.batch, seq, vocab,
                               args.seed + 1 + i, args.ignore_prefix, args.labels == "window",
                               hf=args.hf)
        workloads.append(Workload(seq, batches[:-1], batches[-1]))
    systems = select(args.systems, HF_SYSTEMS if args.hf else SYSTEMS)
    rows = run_all(systems, cfg, workloads, args.warmup, args.top,
                   log=lambda line: print(line, flush=True), order=args.order)
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    config = {k: getattr(args, k) for k in ("model", "batch", "steps", "warmup", "seed", "lr",
                                            "labels", "ignore_prefix", "hf", "moe", "order")}
    config.update(world=world, torch=torch.__version__, threads=torch.get_num_threads(),
                  cpus=os.cpu_count(), loadavg_1min=[load_before, os.getloadavg()[0]],
                  revision=revision)
    return [{"config": {**config, "seq": seq},
             "floor": ulysses_floor(CONFIGS[args.model](), args.batch, seq, world,
                                    experts=EXPERTS if args.moe else 0),
             "ring_floor": ring_floor(CONFIGS[args.model](), args.batch, seq, world),
             "rows": [r for r in rows if r["seq"] == seq]} for seq in args.seq]


def parity_failures(result: dict, bound: float) -> list[str]:
    bad = []
    for r in result["rows"]:
        for key in ("loss_rel_err", "grad_rel_err"):
            if r["status"] == "ok" and r.get(key) is not None and r[key] > bound:
                bad.append(f"{r['system']} {r['mode']}: {key} {r[key]:.2e} > {bound:.0e}")
    return bad


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.abab is not None:
        from bench.baselines import abab
        return abab.run(args.abab, sys.argv[1:] if argv is None else argv, args.launches,
                        args.nproc)
    if args.suite is not None or args.render:
        from bench.baselines import suite
        return suite.run_suite(args.suite) if args.suite is not None else suite.render() or 0
    results = run(args)
    if results is None:
        return 0
    for result in results:
        print(report.header(result))
        print(report.table(result))
        if args.top:
            print(report.top_ops(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.check is not None:
        bad = [b for result in results for b in parity_failures(result, args.check)]
        ran = [r for result in results for r in result["rows"]
               if r["status"] == "ok" and r["system"] != "reference"]
        if bad or not ran:
            print("PARITY FAIL:", "; ".join(bad) or "no system besides the reference ran")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
