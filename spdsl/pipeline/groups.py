"""Every process group a rank's program names, decided once: :class:`Groups`.

A program calls collectives by process-group name: the sequence axis' group, the data axis'
group, the group of every rank (a partial sum over both axes in one all-reduce, printed
``dp+sp``), the group sharded parameters' gradients are summed over, and the Ulysses groups and
rings of hybrid attention. ``Sharded`` makes the job's ``Groups`` once from its mesh
(:meth:`Groups.of_mesh`); outside a job the pipeline lowers against a fake process group of the
axis' size (:func:`planning_group`, :meth:`Groups.planned`), and a lowering that is only read
names its groups without any process behind them (:meth:`Groups.named`).

Example::

    with planning_group(4) as name:
        groups = Groups.planned(4, "sp", name, rank=1)
        groups.axes()            # {name: "sp"}
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from spdsl._torch import fake_store
from spdsl.errors import ShardingError

# hybrid attention's groups per (sequence-axis group, Ulysses degree): creating a group takes
# every rank of the job, so each is created once and kept (the group object is held so that
# its id names it while the entry lives)
_HYBRID: dict[tuple[int, int], tuple[Any, tuple]] = {}


def unknown_axis(axis: str, names: tuple) -> ShardingError:
    """The error of a spec naming ``axis`` on a mesh of axes ``names``."""
    return ShardingError(
        rule="unknown mesh axis",
        detail=f"a spec names mesh axis {axis!r}, but the mesh has axes {tuple(names)}",
        fix=f"use one of {tuple(names)} in P(...), or build the mesh with "
            f"spdsl.mesh({axis}=N)")


def axis_size(mesh, axis: str) -> int:
    """The number of ranks along mesh axis ``axis`` (an error naming the axes if none)."""
    names = tuple(mesh.mesh_dim_names or ())
    if axis not in names:
        raise unknown_axis(axis, names)
    return mesh.size(names.index(axis))


@dataclass(frozen=True)
class Groups:
    """The process groups of one job, by name, and this rank's place in each.

    ``group``/``rank``: the sequence axis ``axis`` of ``parts`` ranks; ``data_group``/
    ``data_rank``: the data axis (``data_parts`` > 1 only); ``joint``: every rank of the mesh
    (partial sums over both axes in one call; the group sharded parameters are cut over);
    ``state_rank``: this rank among all of them. ``kind``: ``"job"`` (a running job's groups,
    ``mesh`` its DeviceMesh), ``"planning"`` (a fake process group, nothing runs) or
    ``"named"`` (names only: a lowering that is read, never run)."""

    axis: str
    parts: int
    group: str
    rank: int = 0
    data_axis: str | None = None
    data_parts: int = 1
    data_group: str | None = None
    data_rank: int = 0
    joint: str | None = None
    state_rank: int = 0
    kind: str = "job"
    mesh: Any = None

    @property
    def world(self) -> int:
        """Ranks of the whole mesh (a mesh may have axes the job splits nothing over)."""
        return self.mesh.size() if self.mesh is not None else self.parts * self.data_parts

    @property
    def joint_name(self) -> str:
        """The axis name of ``joint`` in plans: ``dp+sp`` (the data axis alone when the
        sequence axis has one rank)."""
        return f"{self.data_axis}+{self.axis}" if self.parts > 1 else str(self.data_axis)

    @property
    def state_group(self) -> str:
        """The group sharded parameters' gradients are summed over (their gather's backward):
        an axis that spans every rank is its own group, else every rank's."""
        if self.parts == self.world:
            return self.group
        if self.data_parts == self.world:
            return self.data_group
        return self.joint

    def axes(self) -> dict[str, str]:
        """Process group name -> the axis it reduces or exchanges over, as plans print it."""
        axes = {self.group: self.axis}
        if self.data_parts > 1:
            axes[self.data_group] = self.data_axis
            axes.setdefault(self.joint, self.joint_name)
        return axes

    def factor(self, u: int) -> tuple:
        """The sequence axis as ``u``-rank Ulysses groups and rings across them (hybrid
        attention, ``spdsl.lower.ring``): (Ulysses group, rank in it, ring group, rank in
        it, ring size)."""
        if u < 1 or self.parts % u:
            from spdsl.errors import ShardingError
            raise ShardingError(rule="hybrid attention",
                                value=f"U={u} over {self.axis}={self.parts}",
                                detail="the Ulysses degree must divide the axis",
                                fix=f"pick a divisor of {self.parts}")
        if self.kind == "named":
            return self.group, 0, self.group, 0, self.parts // u
        from spdsl.lower.ring import factor_ranks
        if self.kind == "planning":      # rank 0's groups in the fake group, made anew
            return factor_ranks(torch.arange(self.parts).view(1, self.parts), u)
        pg = self.mesh.get_group(self.axis)
        key = (id(pg), u)
        if key not in _HYBRID:
            dim = self.mesh.mesh_dim_names.index(self.axis)
            rows = self.mesh.mesh.movedim(dim, -1).reshape(-1, self.parts)
            _HYBRID[key] = pg, factor_ranks(rows, u)
        return _HYBRID[key][1]

    def most(self, index: int) -> int:
        """The largest ``index`` of any rank of the job's mesh: one all-reduce per axis of
        more than one rank (the ranks agree on a choice, ``remat="fit"``'s mode say)."""
        if self.kind != "job":
            return index
        import spdsl.collectives as C
        m = self.mesh
        t = torch.tensor([index], device="cuda" if m.device_type == "cuda" else "cpu")
        for i, name in enumerate(m.mesh_dim_names or ()):
            if m.size(i) > 1:
                C.reduce_(t, "max", group=m.get_group(name))
        return int(t.item())

    def data_axis_of(self, prop):
        """The lowering's data axis (``spdsl.lower.graph.DataAxis``) for the data axis'
        propagation ``prop``; None without one."""
        if prop is None:
            return None
        from spdsl.lower.graph import DataAxis
        return DataAxis(prop, self.data_rank, self.data_group, self.joint or self.group)

    def gather_of(self, sharded: list):
        """The parameter-gather pass (``spdsl.lower.param_gather.GatherState``) for the
        sharded parameters ``sharded``; None without any."""
        if not sharded:
            return None
        from spdsl.lower.param_gather import GatherState
        return GatherState(sharded, self.world, self.state_rank, self.state_group)

    @classmethod
    def of_mesh(cls, mesh, axis: str, data_axis: str | None = None,
                state_mesh=None) -> Groups:
        """A running job's groups: axis ``axis`` of ``mesh`` (and ``data_axis``, if the batch
        is split too); ``state_mesh``: the one-axis mesh over every rank
        (``spdsl.sharded_state.state_mesh``), needed with a data axis or sharded state."""
        names = tuple(mesh.mesh_dim_names or ())
        pg = mesh.get_group(axis)
        kw = {}
        if data_axis is not None and mesh.size(names.index(data_axis)) > 1:
            dpg = mesh.get_group(data_axis)
            kw.update(data_axis=data_axis, data_parts=mesh.size(names.index(data_axis)),
                      data_group=dpg.group_name, data_rank=dist.get_rank(dpg))
        if state_mesh is not None:
            every = state_mesh.get_group()
            kw.update(joint=every.group_name, state_rank=dist.get_rank(every))
        return cls(axis, mesh.size(names.index(axis)), pg.group_name, dist.get_rank(pg),
                   kind="job", mesh=mesh, **kw)

    @classmethod
    def planned(cls, parts: int, axis: str, group: str, rank: int = 0) -> Groups:
        """One axis against a fake process group ``group`` (:func:`planning_group`), planned
        for ``rank``."""
        return cls(axis, parts, group, rank, kind="planning")

    @classmethod
    def named(cls, parts: int, axis: str, data_parts: int = 1,
              data_axis: str | None = None) -> Groups:
        """Rank 0's groups by name alone, no process behind them: for a lowering that is read
        (which sharded parameters' gradients are one reduce-scatter), never run."""
        if data_parts == 1:
            return cls(axis, parts, axis, 0, kind="named")
        joint = f"{data_axis}+{axis}"       # a name of its own, even with one sequence rank
        return cls(axis, parts, axis, 0, data_axis, data_parts, str(data_axis), 0, joint,
                   kind="named")


@contextlib.contextmanager
def planning_group(parts: int):
    """A process group to lower against when none is running: a fake one, ``parts`` ranks
    (``torch.testing._internal.distributed.fake_pg``), torn down afterwards. Yields its name."""
    if dist.is_initialized():
        if dist.get_world_size() != parts:
            raise ValueError(f"cannot plan {parts} ranks inside a running job of "
                             f"{dist.get_world_size()}: plan in a process without one (the "
                             "`python -m spdsl memory` command does)")
        yield dist.group.WORLD.group_name
        return
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=parts)
    try:
        yield dist.group.WORLD.group_name
        return
    finally:
        dist.destroy_process_group()
