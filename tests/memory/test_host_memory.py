"""Host memory as the allocators take it: the pinned allocator's rounding rule, the planner's
host bytes against the copies activation offload actually requests, and a host optimizer."""

from __future__ import annotations

import pytest
import torch

import spdsl
from spdsl.memory import plan_memory
from spdsl.memory.host import pinned_bytes, round_threshold
from spdsl.memory.model import model_plan
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.remat import Remat
from spdsl.remat.offload import recording_host_requests

GiB = 2 ** 30


def test_pinned_bytes_is_the_next_power_of_two():
    """``CachingHostAllocator::allocate``: 0 stays 0, a power of two stays, anything else goes
    up to the next; the issue's case: a 601,728-token bf16 layer input of 4.59 GiB pins 8."""
    assert [pinned_bytes(n) for n in (0, 1, 2, 3, 4, 5, 1023, 1024, 1025)] == \
        [0, 1, 2, 4, 4, 8, 1024, 1024, 2048]
    layer_input = 601_728 * 4096 * 2
    assert layer_input / GiB == pytest.approx(4.59, abs=0.005)
    assert pinned_bytes(layer_input) == 8 * GiB
    assert pinned_bytes(GiB) == GiB and pinned_bytes(GiB + 1) == 2 * GiB
    # above the allocator's threshold a request is taken as it is
    assert pinned_bytes(layer_input, threshold=64 * 2 ** 20) == layer_input
    assert pinned_bytes(3 * 2 ** 20, threshold=64 * 2 ** 20) == 4 * 2 ** 20


def test_round_threshold_reads_the_allocator_settings():
    assert round_threshold({}) is None
    assert round_threshold({"PYTORCH_ALLOC_CONF": "pinned_max_round_threshold_mb:64"}) == 64 * 2 ** 20
    assert round_threshold({"PYTORCH_CUDA_ALLOC_CONF":
                            "expandable_segments:True,pinned_max_cached_size_mb:512"}) == 512 * 2 ** 20
    assert round_threshold({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}) is None


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_planned_host_bytes_are_the_requests_offload_makes(one_rank):
    """A real step with offload (one process: the CPU path makes the same requests as the CUDA
    one, a tensor of the moved tensor's shape and dtype each) against the plan of that step:
    the planner's host peak is every request live at once (end of forward), in the tensors'
    bytes, and with ``pinned_host`` each rounded as the pinned allocator takes it."""
    torch.manual_seed(0)
    cfg = LlamaConfig.tiny().replace(n_layers=3)
    model = Llama(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 384))     # 384 * dim * 4 B: not a power of two
    remat = Remat("full", offload=True)
    f = spdsl.sp_shard(seq=1, remat=remat)(model)
    f(ids, ids).backward()                               # built
    with recording_host_requests() as asked:
        f(ids, ids).backward()
    sizes = [n for n, _ in asked]
    assert sizes and len(sizes) % cfg.n_layers == 0
    assert any(pinned_bytes(n) != n for n in sizes)      # the rounding is visible here
    plan = plan_memory(f, ids, ids, remat=remat, pinned_host=False)
    assert plan.host == plan.host_requested == sum(sizes)
    pinned = plan_memory(f, ids, ids, remat=remat, pinned_host=True)
    assert pinned.host_requested == sum(sizes)
    assert pinned.host == sum(pinned_bytes(n) for n in sizes)
    assert pinned.peak == plan.peak                      # the device side is the same


OPT_CASES = {"adamw-bf16": (False, 12, 0), "adamw-fp32-master": (False, 16, 0),
             "adamw-torch": (False, 8, 0),
             "adamw-fp32-master/host": (True, 4, 12)}


@pytest.mark.parametrize("name", OPT_CASES)
def test_optimizer_bytes_per_parameter(name):
    """Weights, gradients and optimizer state per bf16 parameter, device and host, replicated
    (the optimizer phase: every gradient exists), from the simulation itself."""
    on_host, device_b, host_b = OPT_CASES[name]
    cfg = LlamaConfig.tiny()
    params = list(Llama(cfg).parameters())
    n = sum(p.numel() for p in params)
    counters = 4 * len(params)                  # AdamW's step, a 4 B tensor per parameter
    plan = model_plan(cfg, 256, 2, "full", optimizer=name.split("/")[0],
                      optimizer_on_host=on_host, shard=spdsl.sp_shard)
    buffers = plan.parameters - 2 * n           # state that is not a parameter (RoPE's)
    at = plan.phases["optimizer"]
    state = at["parameter"] + at["gradient"] + at["optimizer"]
    assert state == device_b * n + buffers + (0 if on_host else counters), (state, n)
    if not on_host:
        assert plan.host == 0
    else:   # while a parameter updates, its fp32 gradient and temporaries are on the host too
        biggest = max(p.numel() for p in params)
        assert 0 <= plan.host - host_b * n - counters <= 4 * 4 * biggest, (plan.host, n)


def test_host_optimizer_needs_masters():
    with pytest.raises(ValueError, match="fp32-master"):
        model_plan(LlamaConfig.tiny(), 256, 2, "full", optimizer_on_host=True,
                   shard=spdsl.sp_shard)
