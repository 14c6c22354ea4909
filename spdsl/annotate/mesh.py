"""``spdsl.mesh``: a DeviceMesh with named axes over the ranks of the job."""

from __future__ import annotations

import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from spdsl.errors import ShardingError, one_error_per_job
from spdsl.pipeline.groups import axis_size

__all__ = ["axis_size", "ensure_process_group", "mesh"]


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def ensure_process_group() -> None:
    """Initialise the default process group from torchrun's environment if nobody did; in a
    job of several ranks, an uncaught ShardingError then prints once
    (``spdsl.errors.one_error_per_job``)."""
    one_error_per_job()
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ShardingError(
            rule="process group",
            detail="sharded execution needs a process group, and none is initialised",
            fix="launch with `torchrun --standalone --nproc_per_node=N script.py`, call "
                "torch.distributed.init_process_group first, or use spdsl.plan(...) to plan "
                "without running",
        )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(backend, store=_attempt_store(), rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group(backend)


def _attempt_store() -> dist.Store:
    # torchrun (torch 2.13) keeps one agent store for every attempt of a job, so after a
    # restart (--max-restarts) gloo reads the addresses of the previous attempt's ranks,
    # including the dead one's, and fails ("connectFullMesh failed ... Connection refused").
    # A key prefix per attempt keeps the attempts apart.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(minutes=10))
    return dist.PrefixStore(f"spdsl/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                            store)


def mesh(**axes: int) -> DeviceMesh:
    """Build a DeviceMesh whose named axes cover the whole job, outermost axis first.

    Example::

        mesh = spdsl.mesh(sp=4)          # 4 ranks, one axis "sp"
        mesh = spdsl.mesh(dp=2, sp=2)    # rows are dp groups, columns sp groups
    """
    if not axes:
        raise ShardingError(rule="mesh axes", detail="spdsl.mesh needs at least one axis",
                            fix="spdsl.mesh(sp=4)")
    for name, size in axes.items():
        if not isinstance(size, int) or size < 1:
            raise ShardingError(rule="mesh axes", detail=f"axis {name!r} has size {size!r}",
                                fix="give every axis a positive integer size")
    ensure_process_group()
    world = dist.get_world_size()
    if math.prod(axes.values()) != world:
        shape = " x ".join(f"{k}={v}" for k, v in axes.items())
        raise ShardingError(
            rule="mesh size",
            detail=f"mesh {shape} has {math.prod(axes.values())} ranks but the job has {world}",
            fix=f"launch {math.prod(axes.values())} ranks (torchrun --nproc_per_node="
                f"{math.prod(axes.values())}) or change the axis sizes to multiply to {world}",
        )
    return init_device_mesh(_device_type(), tuple(axes.values()), mesh_dim_names=tuple(axes))
