"""Arguments to placements: what ``in_specs``/``sp_shard`` say each tensor argument is.

``InputSpecs`` is the part of ``Sharded`` that reads specs, DTensor arguments and the
data axis into the placements propagation starts from; ``with_sharding_constraint`` pins
a value inside a traced function."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Shard as DShard

from spdsl._torch import tree_flatten
from spdsl.annotate.mesh import axis_size
from spdsl.annotate.spec import P, as_spec
from spdsl.errors import ShardingError
from spdsl.propagate.placement import (
    PARTIAL,
    REPLICATE,
    Placement,
    Shard,
    typed_shape,
)
from spdsl.propagate.trace import tracing


def with_sharding_constraint(x: torch.Tensor, spec: P) -> torch.Tensor:
    """Pin the placement of ``x`` inside a sharded function; outside one it returns ``x``.

    Example::

        h = spdsl.with_sharding_constraint(h, P(None, "sp", None))
    """
    spec = as_spec(spec, "with_sharding_constraint spec", x.dim())
    if not tracing():
        return x
    return torch.ops.spdsl.constraint(x, _encode(spec))


def _encode(spec: P) -> str:
    return ",".join("" if e is None else e for e in spec) if len(spec) else "()"


def _decode(s: str) -> P:
    return P() if s == "()" else P(*[e or None for e in s.split(",")])


def _axis_of(specs, skip: str | None = None) -> str | None:
    """The first mesh axis the specs split over (other than ``skip``); a spec naming the
    data axis first (``P("dp", "sp")``) is read for its sequence axis by ``shard``."""
    found = []
    for s in tree_flatten(specs, is_leaf=lambda x: isinstance(x, P))[0] if specs else []:
        if isinstance(s, P):
            found += [ax for _, ax in s.sharded() if ax != skip]
    if skip is None and len(set(found)) > 1:
        return next((ax for ax in found if ax != "dp"), found[0])
    return found[0] if found else None


def _check_specs(specs, what: str) -> None:
    """A spec given as a bare string (``in_specs="sp"``, ``in_specs=("sp",)``) is refused
    here, when the function is wrapped (``as_spec`` says what to write instead)."""
    if isinstance(specs, str):
        as_spec(specs, what)
    if isinstance(specs, (tuple, list)) and not isinstance(specs, P):
        for i, s in enumerate(specs):
            if isinstance(s, str):
                as_spec(s, f"{what}[{i}]")


def _respelled(spec: P, ndim: int) -> str:
    """``spec`` spelled with ``ndim`` entries, keeping its axes: ``P('sp')`` for a 2-d tensor
    -> ``P(None, 'sp')`` (the sequence of ``[batch, seq]``) or ``P('sp', None)``."""
    axes = [e for e in spec if e is not None]
    if not axes or ndim == 0:
        return repr(P(*[None] * ndim))
    if len(axes) == 1:
        def at(d: int) -> str:
            seq = ", the sequence of [batch, seq, ...]" if d == 1 else ""
            return f"{P(*[axes[0] if e == d else None for e in range(ndim)])!r} (dim {d}{seq})"
        return " or ".join(at(d) for d in sorted(range(ndim), key=lambda d: (d != 1, d))[:4])
    kept = [e for e in spec][:ndim] if len(spec) > ndim else list(spec)
    return repr(P(*(kept + [None] * (ndim - len(kept)))))


class InputSpecs:
    """Specs and DTensor arguments -> the placements a trace starts from (part of
    ``Sharded``)."""

    def _leaf_placements(self, leaves: list, spec_leaves: list | None) -> list[tuple]:
        out = []
        for i, x in enumerate(leaves):
            if not isinstance(x, torch.Tensor):
                continue
            if isinstance(x, DTensor):
                out.append((self._from_dtensor(x), "DTensor input"))
                continue
            spec = spec_leaves[i] if spec_leaves is not None else None
            out.append((self._placement_of(x, spec, i), f"in_specs[{i}]"))
        return out

    def _from_dtensor(self, x: DTensor) -> Placement:
        names = x.device_mesh.mesh_dim_names or ()
        i = names.index(self.axis) if self.axis in names else 0
        p = x.placements[i]
        if isinstance(p, DShard):
            return Shard(p.dim, 1, x.shape[p.dim])
        if isinstance(p, DPartial):
            if p.reduce_op != "sum":
                raise ShardingError(
                    rule="partial input", value=f"{p!r} over {self.axis!r}",
                    detail="a DTensor argument holds a partial value whose reduction is not a "
                           "sum; spdsl's partial values are sums",
                    fix="pass it reduced (x.redistribute(placements=[Replicate()]))")
            return PARTIAL
        return REPLICATE

    def _placement_of(self, x: torch.Tensor, spec, i: int) -> Placement:
        spec = as_spec(spec, f"in_specs[{i}]", x.dim())
        if spec is None:
            return REPLICATE
        if len(spec) and len(spec) != x.dim():
            raise ShardingError(
                rule="spec rank", value=typed_shape(x.shape, x.dtype, REPLICATE, self.axis),
                where=f"argument {i}",
                detail=f"spec {spec!r} has {len(spec)} entries for a {x.dim()}-d tensor",
                fix="give one entry per dim: " + _respelled(spec, x.dim()))
        data = self.data_axis
        split = [(d, ax) for d, ax in spec.sharded() if ax != data or data is None]
        for _, ax in split:
            if ax != self.axis:
                names = tuple(self._mesh.mesh_dim_names or ()) if self._mesh is not None else ()
                if self._mesh is not None and ax not in names:
                    try:
                        axis_size(self._mesh, ax)
                    except ShardingError as e:
                        raise ShardingError(
                            rule=e.rule, detail=e.detail, fix=e.fix, where=f"argument {i}",
                            value=typed_shape(x.shape, x.dtype, REPLICATE, ax)) from None
                raise ShardingError(
                    rule="one split axis", where=f"argument {i}",
                    value=typed_shape(x.shape, x.dtype, REPLICATE, ax),
                    detail=f"spec {spec!r} splits over {ax!r} but this function splits over "
                           f"{self.axis!r}",
                    fix=f"name {self.axis!r} in every spec (other mesh axes, such as data "
                        "parallel ones, take different data per group instead)")
        if not split:
            return REPLICATE
        if len(split) > 1:
            raise ShardingError(rule="one split dim", where=f"argument {i}",
                                value=typed_shape(x.shape, x.dtype, REPLICATE, self.axis),
                                detail=f"spec {spec!r} splits two dims over one axis",
                                fix="split one dim per axis")
        d = split[0][0]
        s = Shard(d, 1, x.shape[d])
        if x.shape[d] % self.parts:
            n = x.shape[d]
            raise ShardingError(
                rule="divisible sequence", value=typed_shape(x.shape, x.dtype, s, self.axis),
                where=f"argument {i}",
                detail=f"dim {d} ({n}) must split evenly over the {self.parts} ranks of "
                       f"{self.axis!r}",
                fix=f"pad or trim it to a multiple of {self.parts} (e.g. {n + (-n) % self.parts})"
                    f", or use a degree that divides {n}")
        return s

    def _data_placement_of(self, x: torch.Tensor, spec, i: int) -> Placement:
        """The placement over the data axis: the dim the spec names it on (the batch)."""
        data = self.data_axis
        if data is None or spec is None or isinstance(x, DTensor):
            return self._data_from_dtensor(x) if isinstance(x, DTensor) else REPLICATE
        spec = spec if isinstance(spec, P) else P(*spec)
        dims = [d for d, ax in spec.sharded() if ax == data]
        if not dims:
            return REPLICATE
        d, D = dims[0], self.data_parts
        n = x.shape[d] * (D if self.batch == "local" else 1)
        if any(ax == self.axis for dd, ax in spec.sharded() if dd == d):
            raise ShardingError(rule="one split dim", where=f"argument {i}",
                                value=typed_shape(x.shape, x.dtype, REPLICATE, data),
                                detail=f"spec {spec!r} splits dim {d} over two axes",
                                fix="split the batch over the data axis, the sequence over "
                                    "the sequence axis")
        if n % D:
            raise ShardingError(
                rule="divisible batch", where=f"argument {i}",
                value=typed_shape(x.shape, x.dtype, Shard(d, 1, n), data),
                detail=f"dim {d} ({n} rows) must split evenly over the {D} ranks of {data!r}",
                fix=f"give a batch that is a multiple of {D} rows (e.g. {n + (-n) % D}), or "
                    f"a mesh with fewer {data!r} ranks")
        return Shard(d, 1, n)

    def _data_from_dtensor(self, x: DTensor) -> Placement:
        names = x.device_mesh.mesh_dim_names or ()
        if self.data_axis not in names:
            return REPLICATE
        p = x.placements[names.index(self.data_axis)]
        return Shard(p.dim, 1, x.shape[p.dim]) if isinstance(p, DShard) else REPLICATE

    def _specs_for(self, args: tuple, kwargs: dict, leaves: list) -> list | None:
        if self.seq_dim is not None:
            seq = next((x.shape[self.seq_dim] for x in leaves if isinstance(x, torch.Tensor)
                        and x.dim() > self.seq_dim), None)
            data = self.data_axis if self.seq_dim != 0 else None
            return [P(*[self.axis if d == self.seq_dim else data if d == 0 else None
                        for d in range(x.dim())])
                    if isinstance(x, torch.Tensor) and x.dim() > self.seq_dim
                    and x.shape[self.seq_dim] == seq else None for x in leaves]
        if self.in_specs is None:
            return None
        specs = self.in_specs
        if not isinstance(specs, tuple) or isinstance(specs, P):
            specs = (specs,)
        flat = []
        for a, sp in zip(args, specs):
            n = len(tree_flatten(a)[0])
            flat += [sp] * n
        flat += [None] * (len(leaves) - len(flat))
        return flat
