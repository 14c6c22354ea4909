"""Local-graph tests: one process, a gloo group of one rank (``sp_shard(seq=1)`` needs a group
to exist, and runs no collectives), and Triton under its CPU interpreter when there is no GPU.

``TRITON_INTERPRET`` must be set before a ``@triton.jit`` kernel is defined; spdsl's kernel
modules load lazily, so setting it here, at collection, is early enough.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_rank():
    """The default process group as one gloo rank, for one test module (left in place it would
    make later tests, which plan without a group, see a running job of one rank)."""
    made = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        made = True
    yield
    if made:
        dist.destroy_process_group()
