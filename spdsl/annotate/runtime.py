"""The run of a built step: the rank's pieces of the global inputs, the outputs
wrapped as DTensors, the check that every rank passed the same batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard

import spdsl.collectives as C
from spdsl._torch import tree_flatten
from spdsl.annotate.mesh import axis_size
from spdsl.errors import ShardingError, user_line
from spdsl.lower.local import bounds
from spdsl.propagate.order import digest, follow, merge_equal, structure_keys
from spdsl.propagate.placement import (
    PARTIAL,
    REPLICATE,
    Placement,
    Shard,
    typed_shape,
)
from spdsl.propagate.trace import Traced

if TYPE_CHECKING:
    from spdsl.annotate.sharded import _Compiled


def _out_nodes(traced: Traced) -> list:
    out_node = next(n for n in traced.graph.graph.nodes if n.op == "output")
    return list(out_node.args[0])


class Runtime:
    """Global arguments in, local program run, DTensors out (part of ``Sharded``)."""

    def _most(self, index: int) -> int:
        """The largest ``index`` of any rank of the mesh: one all-reduce per axis."""
        return self.groups.most(index)

    def _same_order(self, gm: torch.fx.GraphModule) -> bool:
        """Put this rank's traced program in the order of the mesh's first rank where the
        ranks traced the same work in different orders (``spdsl.propagate.order``): two
        all-reduces of a digest when they agree; True if this rank's order changed. Every rank
        raises, before any exchange of the step, if one traced other work."""
        if not dist.is_initialized():
            return False
        keys = structure_keys(gm)
        mine = digest(keys)
        if self._most(mine) == -self._most(-mine):
            return False
        moved, failed = merge_equal(gm) > 0, None
        keys = structure_keys(gm)
        mesh = self.mesh
        for name in mesh.mesh_dim_names or ():
            if axis_size(mesh, name) == 1:
                continue
            first = C.share(keys, group=mesh.get_group(name))
            if failed is None:
                try:
                    moved = follow(gm, first) or moved
                except ShardingError as e:
                    failed = e
            if self._most(int(failed is not None)):
                raise failed or ShardingError(
                    rule="one program on every rank",
                    detail="another rank of the mesh traced a different program (its error "
                           "says where); no exchange of the step ran")
            keys = structure_keys(gm)
        return moved

    def _local_inputs(self, entry: _Compiled, args: tuple, kwargs: dict) -> list:
        """This rank's pieces of the inputs: the one place global tensors become local (cut
        as ``spdsl.lower.local`` says; the step's input specs read the same)."""
        leaves, _ = tree_flatten((args, kwargs))
        groups = entry.step.groups
        local_in = []
        for j, i in enumerate(entry.traced.tensor_leaf_index):
            x = leaves[i]
            p = entry.in_placements[j]
            dp = entry.data_in[j] if entry.data is not None else REPLICATE
            if isinstance(x, DTensor):
                local_in.append(x.to_local())
                continue
            if isinstance(dp, Shard) and self.batch == "global":
                x = self._split_input(x, dp, groups.data_parts, groups.data_rank,
                                      self.data_axis)
            if isinstance(p, Shard):
                x = self._split_input(x, p, groups.parts, groups.rank, self.axis)
            local_in.append(x.contiguous() if x is not leaves[i] else x)
        return local_in

    def _split_input(self, x: torch.Tensor, p: Shard, parts: int, rank: int, axis: str):
        """This rank's chunk of a global input. The global tensor is the same on every rank
        (replicated), so its gradient is the whole one: gathered in backward where it is
        asked for."""
        if x.requires_grad and torch.is_grad_enabled() and parts > 1:
            return C.take(x, (p.dim, 1, p.size, 1), parts, rank,
                          self._group_and_rank(axis)[0])
        lo, hi = bounds(p, parts, rank)
        return x.narrow(p.dim, lo, hi - lo)

    def _check_same_inputs(self, args: tuple, kwargs: dict, full: bool = False) -> None:
        """Every rank of the axis must pass the same global tensors: a mismatch (a
        ``DistributedSampler`` over the sp ranks, say) would otherwise train on a batch no
        rank holds, without a word, or hang in a collective. On every call, one checksum per
        tensor argument (its sum in float64), its largest and smallest over the ranks in one
        all-reduce of 16 bytes per argument. ``full`` (``debug=True``): a position-weighted
        checksum too (a permuted batch), every rank's gathered, listed in the error."""
        if self.parts == 1 or not dist.is_initialized():
            return
        leaves, _ = tree_flatten((args, kwargs))
        idx = [i for i, x in enumerate(leaves)
               if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)]
        if not idx:
            return
        pg = self.mesh.get_group(self.axis)
        device = "cuda" if self.mesh.device_type == "cuda" else "cpu"
        with torch.no_grad():
            mine = torch.stack([_checksum(leaves[i], full) for i in idx]).to(device)  # [n, k]
        if full:
            sums = torch.stack(C.gather_each(mine, group=pg)).cpu()                    # [ranks, n, k]
            bad = [j for j in range(len(idx)) if not bool((sums[:, j] == sums[0, j]).all())]
            seen = {j: [[round(float(c), 4) for c in r] for r in sums[:, j]] for j in bad}
        else:
            both = torch.cat([mine, -mine])
            C.reduce_(both, "max", group=pg)
            hi, lo = both[:len(idx)].cpu(), -both[len(idx):].cpu()
            bad = [j for j in range(len(idx)) if not bool((hi[j] == lo[j]).all())]
            seen = {j: [round(float(lo[j, 0]), 4), round(float(hi[j, 0]), 4)] for j in bad}
        if bad:
            j = bad[0]
            x = leaves[idx[j]]
            name = _leaf_names(getattr(self.fn, "forward", self.fn), args, kwargs,
                               len(leaves))[idx[j]]
            what = "checksums by rank" if full else "checksums from"
            raise ShardingError(
                rule="same global inputs", where=user_line(),
                value=f"{name}: {typed_shape(x.shape, x.dtype, REPLICATE, self.axis)}",
                detail=f"ranks of axis {self.axis!r} passed different values for {name} "
                       f"({what} {seen[j]}); every rank must pass the whole global batch",
                fix=f"give every rank of axis {self.axis!r} the same batch: a DistributedSampler "
                    "(or any loader split by rank) over the sp ranks is the commonest cause -- "
                    "split the data over the dp ranks only (or none), seed every sp rank "
                    "alike, or pass DTensors already split")

    def _check_collectives(self, leaves: list) -> tuple:
        """The collective ``_check_same_inputs`` runs on every call, as the plan lists it."""
        from spdsl.inspect.plan import Collective
        n = sum(isinstance(x, torch.Tensor) and not isinstance(x, DTensor) for x in leaves)
        if self.parts == 1 or not n:
            return ()
        kind, typed = ("all_gather", f"f64[{n},2]") if self.debug else ("all_reduce",
                                                                        f"f64[{2 * n}]")
        return (Collective(kind, self.axis, 16 * n, 0, "check", (typed,), "", "", ""),)

    def _wrap(self, local, p: Placement, node, dp: Placement = REPLICATE):
        if (isinstance(p, Shard) or isinstance(dp, Shard)) and isinstance(local, torch.Tensor):
            val = node.meta["val"]
            return self._as_dtensor(local, p, dp, val.shape, val.stride())
        return local

    def _as_dtensor(self, local: torch.Tensor, p: Placement, dp: Placement, shape,
                    stride) -> DTensor:
        """``local`` as the piece it is of a global tensor of ``shape``: placed ``p`` over the
        sequence axis and ``dp`` over the data axis (a partial sum is a ``Partial``)."""
        if self.data_parts > 1:
            names = self.mesh.mesh_dim_names
            sub = self.mesh[(names[0], names[1])] if self.mesh.ndim > 2 else self.mesh
            pl = {self.axis: p, self.data_axis: dp}
            places = [_dtensor_placement(pl[n]) for n in sub.mesh_dim_names]
        else:
            sub = self.mesh[self.axis] if self.mesh.ndim > 1 else self.mesh
            places = [_dtensor_placement(p)]
        return DTensor.from_local(local, sub, places, run_check=False, shape=shape,
                                  stride=stride)


def _dtensor_placement(p: Placement):
    return DShard(p.dim) if isinstance(p, Shard) else DPartial() if p == PARTIAL else \
        DReplicate()


def _checksum(x: torch.Tensor, full: bool) -> torch.Tensor:
    """``[sum]`` (``full``: ``[sum, position-weighted sum]``) of ``x`` in float64; NaN counts
    as 0 so that equal tensors holding NaN compare equal."""
    x = x.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    s = [x.sum(dtype=torch.float64)]
    if full:
        w = torch.arange(x.numel(), device=x.device, dtype=torch.float64).remainder_(251) + 1
        s.append((x.reshape(-1).to(torch.float64) * w).sum())
    return torch.nan_to_num(torch.stack(s), nan=0.0)


def _leaf_names(fn, args: tuple, kwargs: dict, count: int) -> list[str]:
    """A name for each leaf of ``(args, kwargs)``: the parameter's (``input_ids``), with
    ``[j]`` inside a container; ``argument i`` where the signature says nothing."""
    import inspect
    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names: list[str] = []
    for base, value in [(params[i] if i < len(params) else f"argument {i}", a)
                        for i, a in enumerate(args)] + list(kwargs.items()):
        n = len(tree_flatten(value)[0])
        names += [base] if n == 1 else [f"{base}[{j}]" for j in range(n)]
    return names if len(names) == count else [f"input {i}" for i in range(count)]
