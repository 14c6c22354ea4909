"""``spdsl.pipeline.groups`` in one process: a job's ``Groups`` made from a dp 2 x sp 2 mesh
over a fake process group name the right ranks for every rank of the mesh, hybrid attention's
groups are made once per degree and split the axis as ``spdsl.lower.ring`` says, and the
names a read-only lowering uses decide the gradient group as the job's do."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from spdsl._torch import fake_store, process_group
from spdsl.errors import ShardingError
from spdsl.pipeline import Groups, planning_group
from spdsl.sharded_state import state_mesh


def _ranks(name: str) -> list[int]:
    return dist.get_process_group_ranks(process_group(name))


def _as_rank(rank: int, world: int, fn):
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world)
    try:
        return fn()
    finally:
        dist.destroy_process_group()


def test_dp2_x_sp2_names_the_ranks_of_each_group():
    def read():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
        g = Groups.of_mesh(mesh, "sp", "dp", state_mesh(mesh))
        return (g, _ranks(g.group), _ranks(g.data_group), _ranks(g.joint), g.axes(),
                g.state_group == g.joint)

    for rank in range(4):
        g, sp, dp, every, axes, state_is_joint = _as_rank(rank, 4, read)
        # mesh [[0, 1], [2, 3]]: sp groups are its rows, dp groups its columns
        assert sp == [rank // 2 * 2, rank // 2 * 2 + 1], (rank, sp)
        assert dp == [rank % 2, rank % 2 + 2], (rank, dp)
        assert every == [0, 1, 2, 3]
        assert (g.rank, g.data_rank, g.state_rank) == (rank % 2, rank // 2, rank)
        assert (g.parts, g.data_parts, g.world) == (2, 2, 4)
        assert axes == {g.group: "sp", g.data_group: "dp", g.joint: "dp+sp"}
        assert state_is_joint      # neither axis spans the job: gradients sum over every rank


def test_one_axis_over_the_job_is_its_own_gradient_group():
    def read():
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("sp",))
        g = Groups.of_mesh(mesh, "sp")
        return g, _ranks(g.group)

    g, ranks = _as_rank(1, 4, read)
    assert ranks == [0, 1, 2, 3] and g.rank == 1 and g.joint is None
    assert g.state_group == g.group and g.axes() == {g.group: "sp"}
    assert g.data_axis_of(None) is None and g.gather_of([]) is None


def test_hybrid_groups_are_made_once_and_split_the_axis():
    def read():
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("sp",))
        g = Groups.of_mesh(mesh, "sp")
        first, again = g.factor(2), dataclasses.replace(g, rank=0).factor(2)
        ug, ur, rg, rr, ring = first
        return first == again, _ranks(ug), ur, _ranks(rg), rr, ring

    for rank in range(4):
        same, ulysses, ur, ring_ranks, rr, ring = _as_rank(rank, 4, read)
        assert same                     # no second set of groups for the same degree
        # rank r: member r % 2 of Ulysses group r // 2, member r // 2 of ring r % 2
        assert ulysses == [rank // 2 * 2, rank // 2 * 2 + 1] and ur == rank % 2
        assert ring_ranks == [rank % 2, rank % 2 + 2] and rr == rank // 2 and ring == 2


def test_frozen():
    g = Groups.named(2, "sp")
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.rank = 1


@pytest.mark.parametrize("parts, data_parts, want", [(4, 1, "sp"), (1, 4, "dp"),
                                                      (2, 2, "dp+sp")])
def test_named_groups_decide_the_gradient_group_as_a_job_does(parts, data_parts, want):
    g = Groups.named(parts, "sp", data_parts, "dp" if data_parts > 1 else None)
    assert g.state_group == want and g.world == parts * data_parts
    if data_parts > 1:
        assert len({g.group, g.data_group, g.joint}) == 3     # three names, three groups
    if parts > 1:
        assert g.factor(2) == ("sp", 0, "sp", 0, parts // 2)
    with pytest.raises(ShardingError, match="hybrid attention"):
        g.factor(3)                          # divides none of the axes here


def test_planning_groups_live_inside_the_with():
    with planning_group(4) as name:
        g = Groups.planned(4, "sp", name, rank=3)
        assert dist.get_world_size() == 4 and g.axes() == {name: "sp"}
        ug, _, rg, _, ring = g.factor(2)       # rank 0's, in the fake group
        assert _ranks(ug) == [0, 1] and _ranks(rg) == [0, 2] and ring == 2
        assert g.most(7) == 7                   # nothing to agree with: no collective
    assert not dist.is_initialized()

