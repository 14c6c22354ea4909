"""``spdsl.annotate.mesh`` on one gloo rank: meshes refused before any group is made, the
size check against the job, axis sizes and the hybrid factoring's checks."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import spdsl.annotate.mesh as M
from spdsl.errors import ShardingError


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


def test_a_one_rank_mesh(one_rank):
    with pytest.raises(ShardingError) as e:
        M.mesh(dp=2, sp=2)
    assert e.value.rule == "mesh size" and "has 4 ranks but the job has 1" in e.value.detail
    m = M.mesh(sp=1)
    assert m.mesh_dim_names == ("sp",) and M.axis_size(m, "sp") == 1
    with pytest.raises(ShardingError) as e:
        M.axis_size(m, "tp")
    assert e.value.rule == "unknown mesh axis" and "spdsl.mesh(tp=N)" in e.value.fix
