"""What a call's arguments say, as placements: the :class:`Starts` propagation begins from.

A wrapped function describes how its arguments are read as a frozen :class:`Reading` (its
axes, its specs, ``seq_dim``, ``batch``, the mesh's axis names); :meth:`Reading.starts` reads a
call's tensors, DTensor arguments, ``with_sharding_constraint`` nodes and ``out_specs`` into a
:class:`Starts`. Every spec error of a call (a wrong rank, an axis the mesh lacks, a sequence
that does not split evenly) is raised here, naming the argument.

Example::

    r = Reading(axis="sp", parts=4)
    r.placement_of(torch.zeros(1, 64), P(None, "sp"), 0)     # Shard(1, 1, 64)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Shard as DShard

from spdsl._torch import tree_flatten
from spdsl.errors import ShardingError
from spdsl.pipeline.groups import unknown_axis
from spdsl.pipeline.spec import P, as_spec
from spdsl.propagate.placement import PARTIAL, REPLICATE, Placement, Shard, typed_shape
from spdsl.propagate.trace import Traced


@dataclass(frozen=True)
class Starts:
    """What the call's arguments say, as placements. Per tensor argument (in
    ``Traced.tensor_leaf_index`` order): ``inputs`` its placement over the sequence axis and
    where that was said (``"in_specs[0]"``), ``data_in`` over the data axis, ``requires``
    whether it needs a gradient. ``constraints``: per ``with_sharding_constraint`` node, the
    placement it pins over the sequence axis and over the data axis (None: left free there).
    ``outs``: per output, the placement ``out_specs`` pins (None: as propagated);
    ``keep_partial``: outputs that are partial sums stay so (a segment before the last hands
    them on, ``spdsl.annotate.breaks``)."""

    inputs: tuple[tuple[Placement, str], ...]
    data_in: tuple[Placement, ...]
    requires: tuple[bool, ...]
    constraints: tuple[tuple[torch.fx.Node, Placement, Placement | None], ...] = ()
    outs: tuple[Placement | None, ...] = ()
    keep_partial: bool = False


def encode(spec: P) -> str:
    """A spec as the string a ``spdsl.constraint`` node carries (``with_sharding_constraint``)."""
    return ",".join("" if e is None else e for e in spec) if len(spec) else "()"


def decode(s: str) -> P:
    return P() if s == "()" else P(*[e or None for e in s.split(",")])


@dataclass(frozen=True)
class Reading:
    """How a wrapped function's arguments are read: the sequence ``axis`` and its ``parts``,
    the data axis and its parts (``data_axis`` None: none), ``batch`` (``"global"`` or
    ``"local"`` rows per data group), ``seq_dim`` (``sp_shard``: every input whose dim
    ``seq_dim`` is the sequence is split there), ``in_specs``/``out_specs`` (``shard``),
    ``mesh_axes`` (the mesh's axis names, None before a mesh exists). For a segment of a
    function that reads values (``spdsl.annotate.breaks``): ``partial_in``, an input spec
    may say ``PARTIAL`` (a planned segment is handed a partial sum as its placement, with
    no DTensor to carry it); ``keep_partial``, outputs that are partial sums stay so (a
    segment before the last hands them on)."""

    axis: str
    parts: int
    data_axis: str | None = None
    data_parts: int = 1
    batch: str = "global"
    seq_dim: int | None = None
    in_specs: object = None
    out_specs: object = None
    mesh_axes: tuple[str, ...] | None = None
    partial_in: bool = False
    keep_partial: bool = False

    # -- specs per argument ------------------------------------------------------------------
    def specs_for(self, args: tuple, leaves: list) -> list | None:
        """One spec per leaf of ``(args, kwargs)`` (None: replicated), or None for none."""
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
            flat += [sp] * len(tree_flatten(a)[0])
        flat += [None] * (len(leaves) - len(flat))
        return flat

    def leaf_placements(self, leaves: list, spec_leaves: list | None) -> list[tuple]:
        """Per tensor leaf, its placement over the sequence axis and where that was said."""
        out = []
        for i, x in enumerate(leaves):
            if not isinstance(x, torch.Tensor):
                continue
            if isinstance(x, DTensor):
                out.append((self.from_dtensor(x), "DTensor input"))
                continue
            spec = spec_leaves[i] if spec_leaves is not None else None
            out.append((self.placement_of(x, spec, i), f"in_specs[{i}]"))
        return out

    def from_dtensor(self, x: DTensor) -> Placement:
        names = x.device_mesh.mesh_dim_names or ()
        p = x.placements[names.index(self.axis) if self.axis in names else 0]
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

    def placement_of(self, x: torch.Tensor, spec, i: int) -> Placement:
        """``x``'s placement over the sequence axis as ``spec`` says (``i``: the argument, for
        errors)."""
        if self.partial_in and spec == PARTIAL:
            return PARTIAL
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
            if ax == self.axis:
                continue
            if self.mesh_axes is not None and ax not in self.mesh_axes:
                e = unknown_axis(ax, self.mesh_axes)
                raise ShardingError(rule=e.rule, detail=e.detail, fix=e.fix,
                                    where=f"argument {i}",
                                    value=typed_shape(x.shape, x.dtype, REPLICATE, ax))
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

    def data_placement_of(self, x: torch.Tensor, spec, i: int) -> Placement:
        """The placement over the data axis: the dim the spec names it on (the batch)."""
        data = self.data_axis
        if isinstance(x, DTensor):
            return self._data_from_dtensor(x)
        if data is None or spec is None:
            return REPLICATE
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
        if self.data_axis is None or self.data_axis not in names:
            return REPLICATE
        p = x.placements[names.index(self.data_axis)]
        return Shard(p.dim, 1, x.shape[p.dim]) if isinstance(p, DShard) else REPLICATE

    # -- a call's starts -----------------------------------------------------------------------
    def arguments(self, args: tuple, leaves: list) -> tuple[list, list]:
        """Per tensor leaf: its sequence placement (and where said), its data placement."""
        specs = self.specs_for(args, leaves)
        placements = self.leaf_placements(leaves, specs)
        data_in = [self.data_placement_of(x, specs[i] if specs is not None else None, i)
                   for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        return placements, data_in

    def starts(self, traced: Traced, leaves: list, placements: list, data_in: list) -> Starts:
        """What the arguments (read by :meth:`arguments`), ``with_sharding_constraint`` and
        ``out_specs`` say about ``traced``, as placements."""
        constraints = []
        for node in traced.graph.graph.nodes:
            if node.target is torch.ops.spdsl.constraint.default:
                sp, val = decode(node.args[1]), node.meta["val"]
                data = self.data_placement_of(val, sp, -1) if self.data_parts > 1 and \
                    self.data_axis in sp else None
                constraints.append((node, self.placement_of(val, sp, -1) if len(sp)
                                    else REPLICATE, data))
        return Starts(tuple(placements), tuple(data_in),
                      tuple(leaves[i].requires_grad for i in traced.tensor_leaf_index),
                      tuple(constraints), self._out_pins(traced), self.keep_partial)

    def _out_pins(self, traced: Traced) -> tuple:
        """Per output, the placement ``out_specs`` gives it (None: as propagated)."""
        if self.out_specs is None:
            return ()
        specs = self.out_specs if isinstance(self.out_specs, (list, tuple)) and not \
            isinstance(self.out_specs, P) else [self.out_specs]
        out_node = next(n for n in traced.graph.graph.nodes if n.op == "output")
        pins = []
        for i, o in enumerate(out_node.args[0]):
            val = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
            if not isinstance(val, torch.Tensor) or i >= len(specs) or specs[i] is None:
                pins.append(None)
            else:
                pins.append(self.placement_of(val, specs[i], i) if len(specs[i]) else REPLICATE)
        return tuple(pins)


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
    kept = list(spec)[:ndim] if len(spec) > ndim else list(spec)
    return repr(P(*(kept + [None] * (ndim - len(kept)))))
