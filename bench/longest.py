"""The longest sequence each system trains within one per-rank memory budget, measured.

    torchrun --standalone --nproc_per_node=4 bench/longest.py --budget-mib 24 \\
        --out bench/results/longest_sp4.json

For every system, the sequence length doubles from ``--seq-start`` until a step's measured peak
exceeds the budget (or ``--seq-max`` is reached), then bisects between the last length that fitted
and the first that did not, down to ``--quantum`` tokens. At each length: one untimed step
(spdsl traces the new shape, AdamW creates its state), then one profiled step whose peak is
the allocator's own count (``measure.profile_step``: tensor bytes allocated minus freed since
the step began, weights and optimizer state excluded, the largest rank) -- the same accounting
as ``compare.py``'s peak column, independent of spdsl's memory planner.

Systems (eager; tiny Llama unless ``--model``): hand-written DeepSpeed-Ulysses without and with
per-layer activation checkpointing (``torch.utils.checkpoint``), spdsl with ``remat`` none /
auto / full on the same model, and on the same-shaped Hugging Face ``LlamaForCausalLM``: ALST
(``UlyssesSPAttentionHF``) without and with HF gradient checkpointing, spdsl auto / full.
Prints a markdown table; ``--render`` rewrites the ``longest`` block of ``RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch
import torch.distributed as dist

from bench.baselines.data import make_batches
from bench.baselines.measure import profile_step
from bench.baselines.model import CONFIGS
from bench.baselines.report import rewrite_block
from bench.baselines.systems import RunConfig, Unavailable

MIB = 1024.0 ** 2
RESULTS_MD = os.path.join(ROOT, "bench", "RESULTS.md")
BEGIN, END = "<!-- longest:begin (bench/longest.py) -->", "<!-- longest:end -->"


def _build(module: str, factory: str, **kw):
    """A builder of ``bench.baselines.<module>.<factory>(cfg, False, **kw)`` (eager), imported
    when the system is tried."""
    def build(cfg):
        import importlib
        return getattr(importlib.import_module(f"bench.baselines.{module}"), factory)(
            cfg, False, **kw)
    return build


def _remat(mode: str, **kw):
    import spdsl
    return spdsl.Remat(mode, **kw)


# name -> (builder, Hugging Face model?). ALST last: deepspeed.initialize patches global state.
SYSTEMS = {
    "ulysses": (_build("ulysses", "build", checkpoint=False), False),
    "ulysses+checkpoint": (_build("ulysses", "build", checkpoint=True), False),
    "spdsl remat=none": (_build("spdsl_adapter", "SpdslTrainer", remat="none"), False),
    "spdsl remat=auto": (_build("spdsl_adapter", "SpdslTrainer", remat="auto"), False),
    "spdsl remat=full": (_build("spdsl_adapter", "SpdslTrainer", remat="full"), False),
    # full, the all-to-alls run again in backward like the checkpointed baselines' (less kept,
    # 1.5x the all-to-all bytes)
    "spdsl remat=full+recompute": (_build("spdsl_adapter", "SpdslTrainer",
                                          remat=_remat("full", recompute_collectives=True)),
                                   False),
    "hf: spdsl remat=auto": (_build("hf_model", "SpdslHFTrainer", remat="auto"), True),
    "hf: spdsl remat=full": (_build("hf_model", "SpdslHFTrainer", remat="full"), True),
    "hf: spdsl remat=full+recompute": (_build("hf_model", "SpdslHFTrainer",
                                              remat=_remat("full", recompute_collectives=True)),
                                       True),
    "hf: alst": (_build("alst_hf", "build", checkpoint=False), True),
    "hf: alst+checkpoint": (_build("alst_hf", "build", checkpoint=True), True),
}


def _probe(trainer, seq: int, hf: bool, args, vocab: int, world: int, rank: int,
           allocator: bool = False) -> dict:
    """One warm step and one profiled step at ``seq``: the largest rank's peak and the bytes.
    ``allocator``: measure the step with ``spdsl.memory.measure.measure_step`` instead (the
    same allocator count, without the profiler's ``record_shapes``, which on the blockwise
    attention kernel's many small ops held 5 GiB of host memory per rank at 4,096 tokens);
    no communication bytes then."""
    warm, prof = make_batches(2, args.batch, seq, vocab, args.seed + seq, hf=hf)
    prepare = getattr(trainer, "prepare", None)

    def step(batch):
        trainer.zero_grad()
        batch = prepare(*batch) if prepare is not None else batch
        dist.barrier()
        trainer.forward_backward(*batch)
        trainer.optimizer_step()

    t0 = time.perf_counter()
    step(warm)
    seconds = time.perf_counter() - t0
    if allocator:
        from spdsl.memory.measure import measure_step
        m = measure_step(lambda: step(prof), warmup=False)
        peak_bytes, comm = m.peak, None
    else:
        m = profile_step(lambda: step(prof), world, rank)
        peak_bytes, comm = m.peak_bytes, m.total_comm_bytes
    peak = torch.tensor([float(peak_bytes), seconds], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"seq": seq, "peak_bytes": int(peak[0]), "step_s": float(peak[1]),
            "comm_total": comm}


def search(trainer, hf: bool, args, vocab: int, world: int, rank: int, log,
           allocator: bool = False) -> dict:
    """Double, then bisect: the longest measured length whose peak fits ``--budget-mib``.
    ``allocator``: see ``_probe``."""
    def _probe_at(*a):
        return _probe(*a, allocator=True) if allocator else _probe(*a)
    budget = args.budget_mib * MIB
    probes, lo, hi, seq = [], None, None, args.seq_start
    while seq <= args.seq_max:
        p = _probe_at(trainer, seq, hf, args, vocab, world, rank)
        probes.append(p)
        log(f"  {seq} tokens: peak {p['peak_bytes'] / MIB:.1f} MiB, {p['step_s']:.2f} s")
        if p["peak_bytes"] > budget:
            hi = seq
            break
        lo, seq = seq, seq * 2
    while lo is not None and hi is not None and hi - lo > args.quantum:
        mid = (lo + hi) // 2 // args.quantum * args.quantum
        p = _probe_at(trainer, mid, hf, args, vocab, world, rank)
        probes.append(p)
        log(f"  {mid} tokens: peak {p['peak_bytes'] / MIB:.1f} MiB, {p['step_s']:.2f} s")
        lo, hi = (mid, hi) if p["peak_bytes"] <= budget else (lo, mid)
    return {"longest": lo or 0, "first_over": hi, "capped": hi is None, "probes": probes}


def table(result: dict) -> str:
    c = result["config"]
    head = (f"`{c['command']}`\n\nmodel `{c['model']}`, {c['world']} gloo ranks, batch "
            f"{c['batch']}, budget {c['budget_mib']} MiB per rank (measured peak tensor bytes "
            f"of a step, allocator count), lengths from {c['start']} doubling to at most "
            f"{c['max']}, then bisected to {c['quantum']} tokens; code revision "
            f"`{c['revision']}`; 1-min load average {c['loadavg_1min'][0]:.1f} at start, "
            f"{c['loadavg_1min'][1]:.1f} at end on {c['cpus']} CPUs\n")
    base = next((r["longest"] for r in result["rows"]
                 if r["system"] == "ulysses" and r["status"] == "ok"), None)
    lines = [("| system | longest sequence within budget | x ulysses | first length over "
             "| peak MiB at each probed length | step s at the longest |"),
             "|---|---:|---:|---:|---|---:|"]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['system']} | {r['status']}: {r['reason']} | | | | |")
            continue
        longest = f"{'>= ' if r['capped'] else ''}{r['longest']:,}"
        ratio = f"{r['longest'] / base:.2f}" if base else "-"
        probes = ", ".join(f"{p['seq']}: {p['peak_bytes'] / MIB:.1f}"
                           for p in sorted(r["probes"], key=lambda p: p["seq"]))
        at = next((p["step_s"] for p in r["probes"] if p["seq"] == r["longest"]), None)
        lines.append(f"| {r['system']} | {longest} | {ratio} | "
                     f"{r['first_over'] if r['first_over'] else '-'} | {probes} | "
                     f"{at if at is None else format(at, '.2f')} |")
    return head + "\n" + "\n".join(lines)


def render(path: str) -> None:
    with open(path) as f:
        result = json.load(f)
    rewrite_block(RESULTS_MD, BEGIN, END, table(result) + "\n")
    print(f"rewrote the longest-sequence table of {RESULTS_MD}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", choices=sorted(CONFIGS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--budget-mib", type=float, default=24.0)
    p.add_argument("--seq-start", type=int, default=4096)
    p.add_argument("--seq-max", type=int, default=32768)
    p.add_argument("--quantum", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", nargs="*", default=None, help=f"from {list(SYSTEMS)}")
    p.add_argument("--out", default=None)
    p.add_argument("--render", default=None, metavar="JSON",
                   help="plain python: rewrite RESULTS.md's table from this result file")
    args = p.parse_args(argv)
    if args.render:
        render(args.render)
        return 0
    from bench.compare import source_revision

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    load0, revision = os.getloadavg()[0], source_revision()
    from spdsl.memory.measure import track_cpu_allocations
    track_cpu_allocations()      # the allocator counts frees on gloo's threads too (the peaks)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=15))
    cfg = RunConfig(model=args.model, batch=args.batch, world=world, rank=rank, seed=args.seed,
                    lr=1e-3)
    vocab = CONFIGS[args.model]().vocab_size

    def log(line):
        if rank == 0:
            print(line, flush=True)
    rows = []
    for name in args.systems or list(SYSTEMS):
        build, hf = SYSTEMS[name]
        log(f"[longest] {name}")
        try:
            trainer = build(cfg)
            rows.append({"system": name, "status": "ok",
                         **search(trainer, hf, args, vocab, world, rank, log)})
        except Unavailable as e:
            rows.append({"system": name, "status": "unavailable", "reason": str(e)})
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return 0
    argline = shlex.join(sys.argv[1:] if argv is None else argv)
    result = {"config": {"model": args.model, "batch": args.batch, "world": world,
                         "budget_mib": args.budget_mib, "start": args.seq_start, "max": args.seq_max,
                         "quantum": args.quantum, "revision": revision, "cpus": os.cpu_count(),
                         "torch": torch.__version__, "loadavg_1min": [load0, os.getloadavg()[0]],
                         "command": f"torchrun --standalone --nproc_per_node={world} "
                                    f"bench/longest.py {argline}"},
              "rows": rows}
    print(table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
