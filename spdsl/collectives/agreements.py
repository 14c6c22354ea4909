"""Agreements: what the ranks' hosts compare or share.

Plain process-group calls outside any graph and any autograd (checks that the ranks agree,
objects one rank decides, the ring groups made, barriers), here with the rest of what spdsl says
to other ranks. ``group``: a process group, None for every rank of the job.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def gather_each(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``t`` (the same shape and dtype on each), in rank order."""
    every = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, t, group=group)
    return every


def reduce_(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """``t`` summed (``op="sum"``) or its largest (``"max"``) over the ranks, in place."""
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op],
                    group=group)
    return t


def broadcast_(t: torch.Tensor, group=None) -> torch.Tensor:
    """The group's first rank's ``t`` on every rank, in place."""
    dist.broadcast(t, group=group, group_src=0)
    return t


def share(obj, group=None):
    """The group's first rank's ``obj`` (anything picklable) on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def barrier(group=None) -> None:
    dist.barrier(group=group)


def new_group(members: list[int]):
    """A process group of ``members`` (global ranks); every rank of the job must call it, for
    every group, in the same order."""
    return dist.new_group(members)
