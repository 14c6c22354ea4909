"""Shared pieces of the GPU check sections: the device, a one-rank process group, timing, JSON."""

from __future__ import annotations

import json
import os
import platform
import time

import torch
import torch.distributed as dist


def device_info(device: str) -> dict:
    info = {"device": device, "torch": torch.__version__, "python": platform.python_version()}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return info


def one_rank_mesh(device: str = "cpu"):
    """A process group of one rank and a one-rank ``sp`` mesh on it.

    ``sp_shard(seq=1)`` needs a group to exist and runs no collective, so a CPU (gloo) mesh
    serves CUDA tensors too, with no NCCL initialisation or network. Sharded state
    (``shard_state=True``) is the exception: ``distribute_tensor`` moves each parameter to the
    mesh's device type, and its gathers run on the group, so ``device="cuda"`` makes a CUDA
    mesh over gloo (CPU tensors) and NCCL (CUDA tensors).
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        backend = "gloo"
        if device == "cuda":
            torch.cuda.set_device(0)
            backend = "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh(device, (1,), mesh_dim_names=("sp",))


def close_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, device: str, reps: int, warm: bool = False) -> float:
    """Median wall milliseconds of ``fn()`` over ``reps`` calls (after one untimed call, unless
    ``warm``: the caller made it)."""
    if not warm:
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return times[len(times) // 2]


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
    print(f"wrote {path}", flush=True)
