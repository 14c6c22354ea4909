"""The compiled planner with sharded state against the allocator: dp=2 x sp=2, tiny Llama 4x256,
``sp_shard(..., shard_state=True, compile=True)``, remat none/auto/full, one launch of 4 gloo
ranks (what ``tests/memory/test_measured_mesh.py`` runs eager, compiled here: several minutes a
mode on two cores, so it is a benchmark, not a test).

    python bench/memory_measure_mesh.py          # ~25 min on 2 cores

Prints every rank's row: planned / measured - 1 (bytes above the step's start).
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODES = ("none", "auto", "full")


def _run(rank: int, world: int) -> dict:
    import spdsl
    from spdsl.memory.measure import track_cpu_allocations
    from tests.memory.test_measured_mesh import _case
    track_cpu_allocations()
    return _case("tiny_4x256", 2, 2, spdsl.mesh(dp=2, sp=2), compile=True, modes=MODES)


def main() -> None:
    from bench.compare import source_revision
    from tests.dist import spawn
    print(f"revision {source_revision()}", flush=True)
    t = time.time()
    results = spawn(_run, 4, timeout=3600)
    print(f"dp=2 x sp=2, tiny 4x256, compiled, shard_state=True ({time.time() - t:.0f} s)")
    for rank, modes in enumerate(results):
        for mode, o in modes.items():
            print(f"r{rank} {mode:5} planned {o['planned']:>11,} measured {o['measured']:>11,} "
                  f"{o['planned'] / o['measured'] - 1:+.2%} (the step kept {o['end']} B)")


if __name__ == "__main__":
    main()
