"""More errors a user can cause while planning, each message read for its parts: the rule,
the value in typed-shape notation, the user's line and module path, and the fix. Mesh errors
use torch's in-process fake process group (4 ranks, no communication)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import spdsl
from spdsl import P, ShardingError


@torch.library.custom_op("spdsl_test::reverse_seq", mutates_args=())
def reverse_seq(x: torch.Tensor) -> torch.Tensor:
    return x.flip(1)


@reverse_seq.register_fake
def _(x):
    return torch.empty_like(x)


class _Inner(nn.Module):
    def forward(self, x):
        return reverse_seq(x)


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixer = nn.ModuleList([_Inner()])

    def forward(self, x):
        return self.mixer[0](x * 2).sum()


def test_unknown_op_names_its_module_path_and_line():
    with pytest.raises(ShardingError) as e:
        spdsl.plan(spdsl.sp_shard(seq=2)(_Outer()), torch.randn(2, 8, 4))
    msg = str(e.value)
    assert msg.startswith("[unknown op] spdsl has no propagation rule for "
                          "spdsl_test.reverse_seq.default")
    assert "value: f32[2,8@sp,4]" in msg
    assert "test_errors_planning.py:" in msg and "(mixer.0)" in msg
    assert "spdsl.register_rule(" in msg and "with_sharding_constraint(x, P())" in msg


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


def test_mesh_size_must_match_the_world(fake_world):
    with pytest.raises(ShardingError) as e:
        spdsl.mesh(sp=3)
    msg = str(e.value)
    assert msg.startswith("[mesh size] mesh sp=3 has 3 ranks but the job has 4")
    assert "torchrun --nproc_per_node=3" in msg


def test_spec_naming_a_missing_mesh_axis(fake_world):
    mesh = spdsl.mesh(sp=4)
    step = spdsl.shard(lambda t: t.sum(), mesh=mesh, in_specs=(P(None, "tp"),), out_specs=P())
    with pytest.raises(ShardingError) as e:
        spdsl.plan(step, torch.randn(2, 8))
    msg = str(e.value)
    assert msg.startswith("[unknown mesh axis] a spec names mesh axis 'tp', but the mesh has "
                          "axes ('sp',)")
    assert "spdsl.mesh(tp=N)" in msg


def test_planning_on_a_mesh_works_without_running(fake_world):
    mesh = spdsl.mesh(sp=4)
    step = spdsl.shard(lambda t: (t * 2).sum(), mesh=mesh, in_specs=(P(None, "sp"),),
                       out_specs=P())
    plan = spdsl.plan(step, torch.randn(2, 8))
    assert [(c.kind, c.purpose) for c in plan.collectives] == [("all_reduce", "loss"),
                                                               ("all_reduce", "check")]
