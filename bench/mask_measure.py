"""Masks as functions (``spdsl.propagate.masks``) measured with the allocator at SP 2.

    torchrun --standalone --nproc_per_node=2 bench/mask_measure.py --part a
    torchrun --standalone --nproc_per_node=2 bench/mask_measure.py --part b --budget-mib 48 \
        --seq-start 1024 --quantum 512 --seq-max 65536
    python bench/mask_measure.py --render          # the markdown tables of the JSON

Model: a Hugging Face Llama built from ``AutoConfig.for_model("llama", vocab_size=256,
hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
num_key_value_heads=2)``, fp32, SDPA (eager attention for the ``eager`` batch); spdsl as
``sp_shard(seq=2, remat="full")`` of ``model(input_ids=, labels=, attention_mask=|position_ids=,
use_cache=False).loss``; AdamW; batch 1. Batches: ``padded`` (right padding: the last quarter
of the row has ``attention_mask`` 0 and labels -100), ``packed`` (``position_ids`` restarting
every 1,024 tokens, label -100 at each document's first token), ``eager`` (a plain batch,
eager attention), ``plain`` (SDPA, no mask: the reference), ``window`` (a plain batch, Mistral
of the same widths, ``sliding_window=1024``), ``eager_left`` (eager attention, left padding:
the first quarter of the row masked, labels -100). "off" is spdsl with
``SPDSL_MASK_FUNCTIONS=0`` (the dense ``[B, 1, S, S]`` mask, written-out ``[S, S]`` scores),
set around the trace.

Part a: per batch, length and setting, one warm-up step then one measured step
(``spdsl.memory.measure.measure_step``: c10's CPU allocator's own bytes above what was held
when the step began; the step is forward, backward, ``AdamW.step()``,
``zero_grad(set_to_none=True)``), the largest rank; beside it the planner's same quantity,
``plan.peak - plan.parameters - plan.optimizer - plan.inputs`` (``plan_memory(..., rank=r)``;
on rank 0 that is ``spdsl.plan(...).memory``), and the ratio of each doubling. A point whose plan exceeds ``--dense-limit-gib``
per rank is planned, not run.

Part b: the longest sequence within one per-rank budget, by ``bench/longest.py``'s search
(doubling, then bisection; its step, measured with ``measure_step``: ``search(...,
allocator=True)``), for spdsl before (off),
spdsl after (on), and ALST's Hugging Face integration (``bench/baselines/alst_hf.py``, with HF
gradient checkpointing as spdsl recomputes every layer) on the same model and batches. Before
the search, each system's loss on a 2,048-token batch against the unsharded model's.

Writes ``bench/results/mask_measure_sp2.json`` (each part merged into it) and prints the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import itertools
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

MIB = 1024.0 ** 2
GIB = 1024.0 ** 3
DOC = 1024                                     # packed: tokens per document
WINDOW = 1024                                  # window: Mistral's sliding window, tokens
CASES = ("padded", "packed", "eager", "plain", "window", "eager_left")
DEFAULT_CASES = CASES[:4]        # part a's default run (MEMORY.md's tables); the others by name
OUT = os.path.join(ROOT, "bench", "results", "mask_measure_sp2.json")


def hf_llama(attn: str, seed: int = 0, window: int | None = None) -> torch.nn.Module:
    """The brief's Llama, the same initial weights for every system and in every process;
    ``window``: Mistral of the same widths, whose layers attend over that sliding window."""
    import transformers
    extra = {"sliding_window": window} if window else {}
    cfg = transformers.AutoConfig.for_model(
        "mistral" if window else "llama", vocab_size=256, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=1 << 20, **extra)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().train()


def case_batch(case: str, ids: torch.Tensor, labels: torch.Tensor) -> tuple:
    """``(ids, labels[, extra])`` of one batch kind from plain HF tokens (``labels == ids``)."""
    seq, labels = ids.shape[1], labels.clone()
    if case == "padded":
        mask = torch.ones_like(ids)
        mask[:, -seq // 4:] = 0
        labels[:, -seq // 4:] = -100
        return ids, labels, mask
    if case == "eager_left":
        mask = torch.ones_like(ids)
        mask[:, :seq // 4] = 0
        labels[:, :seq // 4] = -100
        return ids, labels, mask
    if case == "packed":
        pos = torch.arange(seq).remainder(DOC).unsqueeze(0).expand_as(ids).contiguous()
        labels[pos == 0] = -100
        return ids, labels, pos
    return ids, labels


def loss_of(model: torch.nn.Module, case: str):
    if case in ("padded", "eager_left"):
        return lambda ids, labels, extra: model(input_ids=ids, labels=labels,
                                                attention_mask=extra, use_cache=False).loss
    if case == "packed":
        return lambda ids, labels, extra: model(input_ids=ids, labels=labels,
                                                position_ids=extra, use_cache=False).loss
    return lambda ids, labels: model(input_ids=ids, labels=labels, use_cache=False).loss


@contextlib.contextmanager
def mask_functions(on: bool):
    """``SPDSL_MASK_FUNCTIONS`` as the trace reads it, restored after."""
    saved = os.environ.get("SPDSL_MASK_FUNCTIONS")
    os.environ["SPDSL_MASK_FUNCTIONS"] = "1" if on else "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("SPDSL_MASK_FUNCTIONS")
        else:
            os.environ["SPDSL_MASK_FUNCTIONS"] = saved


class SpdslMaskTrainer:
    """spdsl on the HF loss of one batch kind; ``longest.search``'s trainer protocol
    (``prepare`` turns the plain tokens it draws into the batch kind)."""

    def __init__(self, case: str, functions: bool, world: int, seed: int = 0,
                 lr: float = 1e-3) -> None:
        import spdsl
        self.case, self.functions = case, functions
        self.llama = hf_llama("eager" if case.startswith("eager") else "sdpa", seed,
                              WINDOW if case == "window" else None)
        self.fn = spdsl.sp_shard(seq=world, remat="full")(loss_of(self.llama, case))
        self.opt = torch.optim.AdamW(self.llama.parameters(), lr=lr)

    def prepare(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple:
        return case_batch(self.case, ids, labels)

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def forward_backward(self, *batch) -> float:
        with mask_functions(self.functions):
            loss = self.fn(*batch)
        loss.backward()
        return float(loss.detach())

    def optimizer_step(self) -> None:
        self.opt.step()

    def plan(self, *batch):
        import spdsl
        with mask_functions(self.functions):
            return spdsl.plan(self.fn, *batch)

    def plan_memory(self, *batch, rank: int):
        from spdsl.memory import plan_memory
        with mask_functions(self.functions):
            return plan_memory(self.fn, *batch, rank=rank)


def alst_trainer(case: str, world: int, rank: int, seed: int = 0, checkpoint: bool = True):
    """ALST (``UlyssesSPAttentionHF``) on the same model; its batch as its adapter takes it:
    ``input_ids``, ``labels``, ``position_ids`` (restarting for packed); no ``attention_mask``
    (the adapter does not carry one and the attention wrapper drops any 4-D mask)."""
    import deepspeed.comm

    from bench.baselines.alst_hf import ALSTTrainer
    from bench.baselines.systems import RunConfig

    class ALSTMaskTrainer(ALSTTrainer):
        def prepare(self, ids, labels):
            batch = case_batch(case, ids, labels)
            return super().prepare(batch[0], batch[1],
                                   position_ids=batch[2] if case == "packed" else None)

    deepspeed.comm.init_distributed(dist_backend="gloo")
    cfg = RunConfig(model="tiny", batch=1, world=world, rank=rank, seed=seed, lr=1e-3)
    return ALSTMaskTrainer(cfg, checkpoint,
                           llama=hf_llama("sdpa", seed, WINDOW if case == "window" else None))


def _gather(values: list[float]) -> list[list[float]]:
    """Every rank's ``values``, rank order."""
    t = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def _tokens(seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from bench.baselines.data import make_batches
    return make_batches(1, 1, seq, 256, seed + seq, hf=True)[0]


# ---------------------------------------------------------------------------------------- a

def point(case: str, seq: int, functions: bool, world: int, rank: int, limit: float,
          log) -> dict:
    """One (batch, length, setting): planned and measured per rank, above the step's start."""
    from spdsl.memory.measure import measure_step

    gc.collect()
    trainer = SpdslMaskTrainer(case, functions, world)
    batch = trainer.prepare(*_tokens(seq, 0))
    t0 = time.perf_counter()
    plan = trainer.plan(*batch)
    masks = sorted({a.mask for a in plan.attention})
    mem = trainer.plan_memory(*batch, rank=rank)
    planned = mem.peak - mem.parameters - mem.optimizer - mem.inputs
    plan_s = time.perf_counter() - t0
    ranks = _gather([planned, mem.peak])
    out = {"case": case, "seq": seq, "functions": functions, "masks": masks,
           "planned": [int(r[0]) for r in ranks], "planned_abs": [int(r[1]) for r in ranks],
           "planned_phase": mem.peak_phase, "plan_s": round(plan_s, 1)}
    if max(r[1] for r in ranks) > limit:
        out["skipped"] = (f"planned {max(r[1] for r in ranks) / GIB:.1f} GiB per rank > "
                          f"{limit / GIB:.0f} GiB")
        log(f"  {case:6} {seq:6} {'on' if functions else 'off':3} skipped: {out['skipped']}")
        return out

    def step():
        trainer.forward_backward(*batch)
        trainer.optimizer_step()
        trainer.zero_grad()

    t0 = time.perf_counter()
    step()                                          # traces, creates AdamW's states
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    m = measure_step(step, warmup=False)
    step_s = time.perf_counter() - t0
    ranks = _gather([m.peak, m.end, m.before, warm_s, step_s])
    out.update(measured=[int(r[0]) for r in ranks], end=[int(r[1]) for r in ranks],
               measured_abs=[int(r[0] + r[2]) for r in ranks],
               warm_s=round(max(r[3] for r in ranks), 1),
               step_s=round(max(r[4] for r in ranks), 1))
    log(f"  {case:6} {seq:6} {'on' if functions else 'off':3} measured "
        f"{max(out['measured']) / MIB:8.2f} MiB, planned {max(out['planned']) / MIB:8.2f} MiB "
        f"(warm {out['warm_s']} s, step {out['step_s']} s, plan {out['plan_s']} s) {masks}")
    return out


def part_a(args, world: int, rank: int, log) -> list[dict]:
    rows = []
    for case in args.cases:
        for functions in (True, False):
            if not functions and case == "plain":
                continue
            for seq in args.seqs if functions else [s for s in args.seqs if s <= args.off_max]:
                rows.append(point(case, seq, functions, world, rank,
                                  args.dense_limit_gib * GIB, log))
    return rows


# ---------------------------------------------------------------------------------------- b



def _parity(trainer, case: str, seq: int) -> float:
    """The system's loss on a ``seq``-token batch without a step (gradients dropped)."""
    ids, labels = _tokens(seq, 1)
    batch = trainer.prepare(ids, labels)
    loss = trainer.forward_backward(*batch)
    trainer.zero_grad()
    return loss


def part_b(args, world: int, rank: int, log) -> list[dict]:
    from bench.baselines.systems import Unavailable
    from bench.longest import search

    rows = []
    search_args = argparse.Namespace(batch=1, seed=0, budget_mib=args.budget_mib,
                                     seq_start=args.seq_start, seq_max=args.seq_max,
                                     quantum=args.quantum)
    for case in ("padded", "packed"):
        ids, labels = _tokens(args.parity_seq, 1)
        with torch.no_grad():
            ref = float(loss_of(hf_llama("sdpa"), case)(*case_batch(case, ids, labels)))
        for system in args.systems:
            log(f"[{case}] {system}")
            gc.collect()
            row = {"case": case, "system": system, "reference_loss": ref}
            try:
                if system == "alst":
                    trainer = alst_trainer(case, world, rank)
                else:
                    trainer = SpdslMaskTrainer(case, system == "spdsl after", world)
            except (ImportError, Unavailable) as e:
                rows.append({**row, "status": "unavailable", "reason": str(e)})
                continue
            loss = _parity(trainer, case, args.parity_seq)
            row.update(loss=loss, loss_rel_err=abs(loss - ref) / abs(ref))
            log(f"  loss at {args.parity_seq}: {loss:.6f} (unsharded {ref:.6f})")
            t0 = time.perf_counter()
            row.update(status="ok", **search(trainer, True, search_args, 256, world, rank, log,
                                             allocator=True))
            row["search_s"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            del trainer
    return rows


# ----------------------------------------------------------------------------------- tables

def _mib(b) -> str:
    return f"{b / MIB:,.2f}"


def table_a(rows: list[dict]) -> str:
    seqs = sorted({r["seq"] for r in rows})
    head = ("| batch | mask functions | " + " | ".join(f"{s:,}" for s in seqs) + " | "
            + " | ".join(f"x {a:,}->{b:,}" for a, b in itertools.pairwise(seqs)) + " |")
    lines = [head, "|---|---|" + "---:|" * (2 * len(seqs) - 1)]
    plans = [("| batch | mask functions | tokens | planned | measured | planned / measured "
              "| attention masks (plan) |"), "|---|---|---:|---:|---:|---:|---|"]
    for case in CASES:
        for on in (True, False):
            pts = {r["seq"]: r for r in rows if r["case"] == case and r["functions"] == on}
            if not pts:
                continue
            cells, peaks = [], {}
            for s in seqs:
                r = pts.get(s)
                if r is None:
                    cells.append("")
                elif "measured" in r:
                    peaks[s] = max(r["measured"])
                    cells.append(_mib(peaks[s]))
                else:
                    cells.append(f"(planned {_mib(max(r['planned']))}, not run)")
            ratios = [f"{peaks[b] / peaks[a]:.2f}" if a in peaks and b in peaks else ""
                      for a, b in itertools.pairwise(seqs)]
            lines.append(f"| {case} | {'on' if on else 'off'} | " + " | ".join(cells) + " | "
                         + " | ".join(ratios) + " |")
            for s, r in sorted(pts.items()):
                meas = max(r["measured"]) if "measured" in r else None
                plans.append(
                    f"| {case} | {'on' if on else 'off'} | {s:,} | {max(r['planned']):,} | "
                    f"{'-' if meas is None else format(meas, ',')} | "
                    f"{'-' if meas is None else format(max(r['planned']) / meas, '.4f')} | "
                    f"{'; '.join(r['masks'])} |")
    return ("Measured per-rank peak, MiB (largest rank), and the ratio of each doubling:\n\n"
            + "\n".join(lines) + "\n\nPlanner against the allocator (bytes, largest rank, "
            "both above the step's start):\n\n" + "\n".join(plans))


def table_b(rows: list[dict], budget: float) -> str:
    lines = [(f"Budget {budget:g} MiB per rank (measured peak above the step's start, largest "
              "rank):\n"),
             ("| batch | system | longest within budget | first length over | loss rel. err. at "
              "2,048 vs unsharded | peak MiB at each probed length | search s |"),
             "|---|---|---:|---:|---:|---|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['case']} | {r['system']} | {r['status']}: {r['reason']} "
                         "| | | | |")
            continue
        longest = f"{'>= ' if r['capped'] else ''}{r['longest']:,}"
        probes = ", ".join(f"{p['seq']}: {p['peak_bytes'] / MIB:.1f}"
                           for p in sorted(r["probes"], key=lambda p: p["seq"]))
        lines.append(f"| {r['case']} | {r['system']} | {longest} | "
                     f"{format(r['first_over'], ',') if r['first_over'] else '-'} | "
                     f"{r['loss_rel_err']:.1e} | {probes} | {r['search_s']} |")
    return "\n".join(lines)


def render(result: dict) -> str:
    out = []
    for part, table in (("a", lambda r: table_a(r["rows"])),
                        ("b", lambda r: table_b(r["rows"], r["budget_mib"]))):
        if part in result:
            r = result[part]
            head = (f"`{r['command']}` (revision `{r['revision']}`, {r['minutes']} min, "
                    f"1-min load average {r['loadavg_1min'][0]:.1f} at start, "
                    f"{r['loadavg_1min'][1]:.1f} at end on {r['cpus']} CPUs)\n")
            out += [head, table(r), ""]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("a", "b"), default="a")
    p.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), choices=CASES)
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--off-max", type=int, default=8192, help="part a: run 'off' up to this")
    p.add_argument("--dense-limit-gib", type=float, default=8.0,
                   help="part a: plan only, do not run, a point planned above this per rank")
    p.add_argument("--budget-mib", type=float, default=48.0)
    p.add_argument("--seq-start", type=int, default=1024)
    p.add_argument("--seq-max", type=int, default=65536)
    p.add_argument("--quantum", type=int, default=512)
    p.add_argument("--parity-seq", type=int, default=2048)
    p.add_argument("--systems", nargs="+", default=["spdsl before", "spdsl after", "alst"],
                   choices=["spdsl before", "spdsl after", "alst"])
    p.add_argument("--out", default=OUT)
    p.add_argument("--render", action="store_true", help="plain python: print the tables")
    args = p.parse_args(argv)
    if args.render:
        with open(args.out) as f:
            print(render(json.load(f)))
        return 0
    from bench.compare import source_revision
    from spdsl.memory.measure import track_cpu_allocations

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    revision, load0, t0 = source_revision(), os.getloadavg()[0], time.time()
    track_cpu_allocations()     # first: the allocator's total is absolute and exact on every thread
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))

    def log(line):
        if rank == 0:
            print(line, flush=True)
    rows = (part_a if args.part == "a" else part_b)(args, world, rank, log)
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return 0
    argline = shlex.join(sys.argv[1:] if argv is None else argv)
    part = {"command": f"torchrun --standalone --nproc_per_node={world} bench/mask_measure.py "
                       f"{argline}",
            "revision": revision, "world": world, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "loadavg_1min": [load0, os.getloadavg()[0]], "minutes": round((time.time() - t0) / 60, 1),
            "rows": rows}
    if args.part == "b":
        part.update(budget_mib=args.budget_mib, seq_start=args.seq_start, seq_max=args.seq_max,
                    quantum=args.quantum, parity_seq=args.parity_seq)
    result = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            result = json.load(f)
    result[args.part] = part
    result["revision"] = revision
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
