"""The per-rank loop that every system goes through in the same way.

For each system: build it, run ``warmup + steps`` training steps on the shared batches (a
barrier before each so ranks start together; the step time of a step is the slowest rank's),
keep the first step's gradients for parity, then run one extra *profiled* step (not timed) for
collective bytes and peak memory. The reference runs on rank 0 alone while the other ranks
wait, so it is timed as the single process it is.
"""

from __future__ import annotations

import statistics
import time
import traceback

import torch
import torch.distributed as dist

from .measure import profile_step
from .systems import RunConfig, System, Trainer, Unavailable


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


def run_system(system: System, cfg: RunConfig, batches, profile_batch, warmup: int,
               reference: dict | None) -> dict | None:
    """Run one system on every rank; rank 0 returns its result row (others return None)."""
    row: dict = {"system": system.name, "mode": system.mode}
    solo = system.single_process
    if solo and cfg.rank != 0:
        dist.barrier()               # wait while rank 0 runs the reference alone
        return None
    world = 1 if solo else cfg.world
    try:
        trainer = system.build(cfg)
        times, losses, grads = _train(trainer, batches, barrier=not solo)
        trainer.zero_grad()
        if not solo:
            dist.barrier()
        measure = profile_step(_one_step(trainer, profile_batch), world, cfg.rank)
        status, reason = "ok", ""
    except Unavailable as e:
        status, reason = "unavailable", str(e)
    except Exception as e:           # reported, not raised: the other systems still run
        status = "failed"
        reason = f"{type(e).__name__}: {e}".strip().splitlines()[0][:400]
        if cfg.rank == 0:
            traceback.print_exc()
    if solo:
        dist.barrier()
    else:
        # All ranks must agree before the next system's collectives start.
        flag = torch.tensor([0 if status == "ok" else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and status == "ok":
            status, reason = "failed", "another rank failed"
    row.update(status=status, reason=reason)
    if status != "ok":
        return row if cfg.rank == 0 else None

    if not solo:
        # Step time = the slowest rank; peak memory = the largest rank.
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times = t.tolist()
        peak = torch.tensor([measure.peak_bytes], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        measure.peak_bytes = int(peak.item())
        # Every rank must hold the same (full) gradient: how far is each from rank 0's?
        g0 = grads.clone()
        dist.broadcast(g0, 0)
        spread = torch.tensor([_rel_err(grads, g0)], dtype=torch.float64)
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        row["grad_rank_spread"] = spread.item()
    if cfg.rank != 0:
        return None
    timed = times[warmup:] or times[-1:]
    row.update(
        first_step_s=times[0], median_step_s=statistics.median(timed), step_s=times,
        losses=losses, comm_bytes=measure.comm_bytes, comm_calls=measure.comm_calls,
        comm_total=measure.total_comm_bytes, peak_bytes=measure.peak_bytes,
    )
    if reference is not None:
        row["loss_rel_err"] = max(abs(a - b) / abs(b) for a, b in zip(losses, reference["losses"]))
        row["grad_rel_err"] = _rel_err(grads, reference["grads"])
    else:                            # this is the reference: keep what the others compare with
        row["_grads"] = grads
    return row
