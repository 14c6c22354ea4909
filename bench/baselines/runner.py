"""The per-rank loop that every system goes through in the same way, interleaved.

All systems are built first (AutoSP last: ``deepspeed.initialize`` patches global state). Then,
for each sequence length in turn:

1. warm-up, system by system: the first ``warmup`` steps (compilation happens here);
2. timed steps, round-robin: step ``j`` of every system before step ``j+1`` of any, so a burst
   of load from other processes on this shared machine hits every system alike instead of
   whichever happened to be running (a step's time is the slowest rank's, from a barrier);
   with ``order="alternate"`` every other round runs the systems in reverse order (ABBA...);
3. one extra *profiled* step per system (not timed): collective bytes and peak memory.

Every system sees the same batches in the same order, so loss trajectories stay comparable step
by step; the first step's gradients at each length are kept for parity. Lengths after the first
make compiled systems recompile, which shows in their first-step times. The reference runs on
rank 0 alone while the other ranks wait, so it is timed as the single process it is.
"""

from __future__ import annotations

import functools
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .measure import StepMeasure, profile_step
from .systems import RunConfig, System, Trainer, Unavailable


@dataclass
class Workload:
    seq: int
    batches: list          # [(input_ids, labels)]: warm-up then timed steps, parity-checked
    profile_batch: tuple   # one more batch for the profiled step


@dataclass
class Slot:
    """One system's state in this launch, and what it measured at the current length."""

    system: System
    trainer: Trainer | None = None
    status: str = "ok"
    reason: str = ""
    times: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    grads: torch.Tensor | None = None
    measure: StepMeasure | None = None

    @property
    def solo(self) -> bool:
        return self.system.single_process


def _flat_grads(trainer: Trainer) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in trainer.llama.parameters()]).detach().clone()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _failure(e: Exception, rank: int) -> tuple[str, str]:
    if isinstance(e, Unavailable):
        return "unavailable", str(e)
    if rank == 0:
        traceback.print_exc()
    return "failed", f"{type(e).__name__}: {e}".strip().splitlines()[0][:400]


def _guarded(slot: Slot, rank: int, fn: Callable[[], None]) -> None:
    """Run ``fn`` for ``slot`` on the ranks it runs on; failures are reported, not raised,
    and the ranks agree on them before anyone starts the next collective."""
    if (not slot.solo or rank == 0) and slot.status == "ok":
        try:
            fn()
        except Exception as e:  # noqa: BLE001 -- any failure is a result to report
            slot.status, slot.reason = _failure(e, rank)
    if slot.solo:
        dist.barrier()               # the other ranks wait while rank 0 runs the reference
        return
    flag = torch.tensor([0 if slot.status == "ok" else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and slot.status == "ok":
        slot.status, slot.reason = "failed", "another rank failed"


def _build(slot: Slot, cfg: RunConfig) -> None:
    slot.trainer = slot.system.build(cfg)


def _prepare(trainer: Trainer, batch: tuple) -> tuple:
    """The arguments of ``forward_backward``: a trainer's own data loading (ALST's adapter) runs
    here, before the barrier and outside the timed region, like every system's batch."""
    prepare = getattr(trainer, "prepare", None)
    return prepare(*batch) if prepare is not None else batch


def _step(slot: Slot, batch: tuple, keep_grads: bool) -> None:
    trainer = slot.trainer
    trainer.zero_grad()
    batch = _prepare(trainer, batch)
    if not slot.solo:
        dist.barrier()
    t0 = time.perf_counter()
    slot.losses.append(trainer.forward_backward(*batch))
    t1 = time.perf_counter()
    if keep_grads:
        slot.grads = _flat_grads(trainer)      # untimed: the copy kept for parity
    t2 = time.perf_counter()
    trainer.optimizer_step()
    slot.times.append((t1 - t0) + (time.perf_counter() - t2))


def _profile(slot: Slot, batch: tuple, world: int, rank: int, top: int) -> None:
    trainer = slot.trainer
    trainer.zero_grad()
    batch = _prepare(trainer, batch)
    if not slot.solo:
        dist.barrier()

    def step():
        trainer.forward_backward(*batch)
        trainer.optimizer_step()
    slot.measure = profile_step(step, 1 if slot.solo else world, rank, top)


def _reduce_over_ranks(slot: Slot) -> float:
    """Slowest rank's step times, largest rank's peak memory; returns how far the ranks'
    gradients are from rank 0's (every rank must hold the same full gradient)."""
    t = torch.tensor(slot.times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    slot.times = t.tolist()
    peak = torch.tensor([slot.measure.peak_bytes], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    slot.measure.peak_bytes = int(peak.item())
    g0 = slot.grads.clone()
    dist.broadcast(g0, 0)
    spread = torch.tensor([_rel_err(slot.grads, g0)], dtype=torch.float64)
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return spread.item()


def _row(slot: Slot, seq: int, warmup: int, reference: Slot | None) -> dict:
    s = slot.system
    row = {"system": s.name, "mode": s.mode, "seq": seq, "status": slot.status,
           "reason": slot.reason}
    if slot.status != "ok":
        return row
    m, timed = slot.measure, slot.times[warmup:] or slot.times[-1:]
    row.update(first_step_s=slot.times[0], median_step_s=statistics.median(timed),
               min_step_s=min(timed), step_s=slot.times, losses=slot.losses,
               comm_bytes=m.comm_bytes, comm_calls=m.comm_calls, comm_total=m.total_comm_bytes,
               peak_bytes=m.peak_bytes)
    if m.top_ops:
        row["top_ops"] = m.top_ops
    if reference is not None and reference is not slot and reference.status == "ok":
        row["loss_rel_err"] = max(abs(a - b) / abs(b)
                                  for a, b in zip(slot.losses, reference.losses))
        row["grad_rel_err"] = _rel_err(slot.grads, reference.grads)
        scale = getattr(slot.trainer, "grad_scale", None)
        if scale:   # a system whose gradient is a known multiple of the true one (ALST)
            row["grad_scale"] = scale
            row["grad_rel_err_rescaled"] = _rel_err(slot.grads / scale, reference.grads)
    return row


def run_all(systems: list[System], cfg: RunConfig, workloads: list[Workload], warmup: int,
            top: int = 0, log: Callable[[str], None] = print, order: str = "fixed") -> list[dict]:
    """Every system at every workload; rank 0 gets one row per (system, workload)."""
    slots = [Slot(s) for s in systems]
    for slot in slots:
        _guarded(slot, cfg.rank, functools.partial(_build, slot, cfg))
    reference = next((s for s in slots if s.solo), None)
    rows = []
    for work in workloads:
        n = len(work.batches)
        for slot in slots:
            slot.times, slot.losses, slot.grads, slot.measure = [], [], None, None
            for j in range(min(warmup, n)):
                _guarded(slot, cfg.rank, functools.partial(_step, slot, work.batches[j], j == 0))
        for j in range(warmup, n):
            # "alternate": A B, then B A, ...: no system always runs right after another one
            # (or after the reference, while the other ranks sat idle at the barrier).
            turn = slots[::-1] if order == "alternate" and (j - warmup) % 2 else slots
            for slot in turn:
                _guarded(slot, cfg.rank, functools.partial(_step, slot, work.batches[j], j == 0))
        for slot in slots:
            _guarded(slot, cfg.rank, functools.partial(_profile, slot, work.profile_batch,
                                                       cfg.world, cfg.rank, top))
        for slot in slots:
            spread = None
            if not slot.solo and slot.status == "ok":
                spread = _reduce_over_ranks(slot)
            if cfg.rank == 0:
                row = _row(slot, work.seq, warmup, reference)
                if spread is not None:
                    row["grad_rank_spread"] = spread
                rows.append(row)
                log(f"[compare] {slot.system.label} seq {work.seq}: {row['status']} "
                    f"{row['reason']}")
    return rows
