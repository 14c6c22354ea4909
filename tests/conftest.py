from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Without a GPU the kernel tests run Triton under its CPU interpreter. The flag must be set
# before triton is first imported, and collecting the Hugging Face tests imports it (a modeling
# file imports torch._dynamo, which imports triton): so here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def one_rank():
    """The default process group as one gloo rank for one test (``sp_shard`` needs a group to
    exist; one rank runs no collectives), taken down after it if the test made it."""
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if made:
        dist.destroy_process_group()


@pytest.fixture
def fake_world():
    """A 4-rank fake process group for this test only (planning needs no real one)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield 4
    finally:
        dist.destroy_process_group()
