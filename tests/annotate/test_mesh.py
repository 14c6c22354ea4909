"""``spdsl.annotate.mesh`` and the process group it needs: meshes refused before any group is
made, no process group (how to launch), the size check against the job (one gloo rank, or
torch's in-process fake group of 4 ranks, which runs no communication), axis sizes, and
planning on a mesh without running."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import spdsl
import spdsl.annotate.mesh as M
from spdsl import P
from spdsl.errors import ShardingError
from spdsl.models.llama import Llama, LlamaConfig


@pytest.mark.parametrize("axes,text", [({}, "at least one axis"), ({"sp": 0}, "size 0"),
                                       ({"sp": 2.0}, "size 2.0")])
def test_axes_are_checked_first(axes, text):
    with pytest.raises(ShardingError, match=text) as e:
        M.mesh(**axes)
    assert e.value.rule == "mesh axes"


def test_no_process_group_says_how_to_launch(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group is up")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ShardingError) as e:
        M.ensure_process_group()
    assert e.value.rule == "process group" and "torchrun" in e.value.fix


def test_running_without_a_process_group_says_how_to_launch():
    model = Llama(LlamaConfig.tiny().replace(n_layers=1))
    ids = torch.randint(0, 256, (1, 16))
    with pytest.raises(ShardingError, match="torchrun"):
        spdsl.sp_shard(seq=2)(model)(ids, ids)


def test_a_one_rank_mesh(one_rank):
    with pytest.raises(ShardingError) as e:
        M.mesh(dp=2, sp=2)
    assert e.value.rule == "mesh size" and "has 4 ranks but the job has 1" in e.value.detail
    m = M.mesh(sp=1)
    assert m.mesh_dim_names == ("sp",) and M.axis_size(m, "sp") == 1
    with pytest.raises(ShardingError) as e:
        M.axis_size(m, "tp")
    assert e.value.rule == "unknown mesh axis" and "spdsl.mesh(tp=N)" in e.value.fix


def test_mesh_size_must_match_the_world(fake_world):
    with pytest.raises(ShardingError) as e:
        spdsl.mesh(sp=3)
    msg = str(e.value)
    assert msg.startswith("[mesh size] mesh sp=3 has 3 ranks but the job has 4")
    assert "torchrun --nproc_per_node=3" in msg


def test_planning_on_a_mesh_works_without_running(fake_world):
    mesh = spdsl.mesh(sp=4)
    step = spdsl.shard(lambda t: (t * 2).sum(), mesh=mesh, in_specs=(P(None, "sp"),),
                       out_specs=P())
    plan = spdsl.plan(step, torch.randn(2, 8))
    assert [(c.kind, c.purpose) for c in plan.collectives] == [("all_reduce", "loss"),
                                                               ("all_reduce", "check")]
