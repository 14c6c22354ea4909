"""Run a function on several gloo ranks from a test: ``spawn(fn, world, *args)``.

Process start-up costs ~10 s a launch on this machine, so a test module runs all of its cases
in one launch and the tests read the results.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    # the ranks share the cores: Inductor's compile workers (a process pool a rank, each
    # worker importing torch: ~5 s of CPU a rank that compiles) only add to a launch of as
    # many ranks as cores; the program compiled is the same
    if world >= len(os.sched_getaffinity(0)):
        threads = os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        config = sys.modules.get("torch._inductor.config")   # read once, when imported
        if config is not None:
            config.compile_threads = int(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        # what exists now (torch, the test's modules, their imports) is never garbage: out of
        # the collector's reach, a full collection (the allocator measurements settle with
        # one before and after every step) walks only what the test made, 0.14 s instead of
        # 0.37 s a collection with 4 ranks on 2 cores
        gc.collect()
        gc.freeze()
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:  # noqa: BLE001 - reported to the parent test
        torch.save({"ok": False, "error": traceback.format_exc()},
                   os.path.join(out_dir, f"{rank}.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world: int, *args, timeout: float = 600) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; returns every rank's result."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        port = _free_port()
        procs = [ctx.Process(target=_entry, args=(fn, r, world, port, d, args))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
                raise TimeoutError(f"rank of {world} did not finish in {timeout} s")
        results = []
        for r in range(world):
            path = os.path.join(d, f"{r}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} exited without a result (exit code "
                                   f"{procs[r].exitcode})")
            out = torch.load(path, weights_only=False)
            if not out["ok"]:
                raise RuntimeError(f"rank {r} failed:\n{out['error']}")
            results.append(out["result"])
        return results
