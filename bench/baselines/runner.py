"""The per-rank loop that every system goes through in the same way.

For each system: build it once, then for each sequence length in turn run ``warmup + steps``
training steps on the shared batches (a barrier before each so ranks start together; a step's
time is the slowest rank's), keep the first step's gradients for parity, and run one extra
*profiled* step (not timed) for collective bytes and peak memory. Every system sees the same
batches in the same order, so loss trajectories stay comparable step by step. Lengths after the
first make compiled systems recompile (Dynamo's automatic dynamic shapes), which shows in their
first-step times. The reference runs on rank 0 alone while the other ranks wait, so it is timed
as the single process it is.
"""

from __future__ import annotations

import statistics
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .measure import profile_step
from .systems import RunConfig, System, Trainer, Unavailable


@dataclass
class Workload:
    seq: int
    batches: list          # [(input_ids, labels)] timed (after warm-up) and parity-checked
    profile_batch: tuple   # one more batch for the profiled step


def _flat_grads(trainer: Trainer) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in trainer.llama.parameters()]).detach().clone()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _train(trainer: Trainer, batches, barrier: bool):
    times, losses, grads = [], [], None
    for i, (ids, labels) in enumerate(batches):
        trainer.zero_grad()
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        losses.append(trainer.forward_backward(ids, labels))
        t1 = time.perf_counter()
        if i == 0:
            grads = _flat_grads(trainer)     # untimed: the copy kept for parity
        t2 = time.perf_counter()
        trainer.optimizer_step()
        times.append((t1 - t0) + (time.perf_counter() - t2))
    return times, losses, grads


def _one_step(trainer: Trainer, batch):
    def step():
        trainer.forward_backward(*batch)
        trainer.optimizer_step()
    return step


def _measure(trainer: Trainer, work: Workload, solo: bool, world: int, rank: int, top: int):
    times, losses, grads = _train(trainer, work.batches, barrier=not solo)
    trainer.zero_grad()
    if not solo:
        dist.barrier()
    measure = profile_step(_one_step(trainer, work.profile_batch), world, rank, top)
    return times, losses, grads, measure


def _failure(e: Exception, rank: int) -> tuple[str, str]:
    if isinstance(e, Unavailable):
        return "unavailable", str(e)
    if rank == 0:
        traceback.print_exc()
    return "failed", f"{type(e).__name__}: {e}".strip().splitlines()[0][:400]


def _agree(status: str, reason: str) -> tuple[str, str]:
    """All ranks must agree on failure before the next collectives start."""
    flag = torch.tensor([0 if status == "ok" else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and status == "ok":
        return "failed", "another rank failed"
    return status, reason


def _reduce_over_ranks(times, measure, grads) -> tuple[list, float]:
    """Slowest rank's step times, largest rank's peak memory, and how far the ranks' gradients
    are from rank 0's (every rank must hold the same full gradient)."""
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    peak = torch.tensor([measure.peak_bytes], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    measure.peak_bytes = int(peak.item())
    g0 = grads.clone()
    dist.broadcast(g0, 0)
    spread = torch.tensor([_rel_err(grads, g0)], dtype=torch.float64)
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return t.tolist(), spread.item()


def _row(system: System, seq: int, times, losses, grads, measure, warmup: int,
         reference: dict | None) -> dict:
    timed = times[warmup:] or times[-1:]
    row = {"system": system.name, "mode": system.mode, "seq": seq, "status": "ok", "reason": "",
           "first_step_s": times[0], "median_step_s": statistics.median(timed), "step_s": times,
           "losses": losses, "comm_bytes": measure.comm_bytes, "comm_calls": measure.comm_calls,
           "comm_total": measure.total_comm_bytes, "peak_bytes": measure.peak_bytes}
    if measure.top_ops:
        row["top_ops"] = measure.top_ops
    if system.single_process:        # the reference: keep what the others compare with
        row["_grads"] = grads
    elif reference is not None:
        row["loss_rel_err"] = max(abs(a - b) / abs(b) for a, b in zip(losses, reference["losses"]))
        row["grad_rel_err"] = _rel_err(grads, reference["grads"])
    return row


def run_system(system: System, cfg: RunConfig, workloads: list[Workload], warmup: int,
               references: dict[int, dict], top: int = 0) -> list[dict]:
    """Run one system over every workload on every rank; rank 0 gets one row per workload
    (with the ``top`` ops by self CPU time of rank 0's profiled step when ``top`` > 0)."""
    solo = system.single_process
    if solo and cfg.rank != 0:
        dist.barrier()               # wait while rank 0 runs the reference alone
        return []
    world = 1 if solo else cfg.world
    rows, trainer, status, reason = [], None, "ok", ""
    try:
        trainer = system.build(cfg)
    except Exception as e:
        status, reason = _failure(e, cfg.rank)
    for work in workloads:
        result = None
        if status == "ok":
            try:
                result = _measure(trainer, work, solo, world, cfg.rank, top)
            except Exception as e:
                status, reason = _failure(e, cfg.rank)
        if not solo:
            status, reason = _agree(status, reason)
        if status != "ok":
            rows.append({"system": system.name, "mode": system.mode, "seq": work.seq,
                         "status": status, "reason": reason})
            continue
        times, losses, grads, measure = result
        spread = None
        if not solo:
            times, spread = _reduce_over_ranks(times, measure, grads)
        row = _row(system, work.seq, times, losses, grads, measure, warmup,
                   references.get(work.seq))
        if spread is not None:
            row["grad_rank_spread"] = spread
        rows.append(row)
    if solo:
        dist.barrier()
    return rows if cfg.rank == 0 else []
