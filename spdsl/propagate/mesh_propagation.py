"""Every mesh axis in one walk over the traced graph, as Shardy propagates all of a mesh's
axes in one framework.

A :class:`MeshPropagator` holds one ``Propagator`` (``spdsl.propagate.engine``) per axis, in
priority order (the data axis, then the sequence axis), and decides each node over every
axis before the next node: an axis' decision sees the decisions of the axes before it on
the node's inputs, and does not cut a whole dim one of them splits (``Propagator._clashes``:
the sequence axis never splits the batch dp already splits). Each axis' record is a plain
``Propagator``, read as the one-axis engine's is (``Decisions.data`` is the data axis',
``Decisions.prop`` the sequence axis'). What a ``with_sharding_constraint`` pins is passed
per axis as values (node -> placement; None where its spec names no split over that axis).

No axis reads a later axis' decisions, so the walk decides what one pass per axis in priority
order decides, node for node. A failure is raised as that order would raise it: when an axis
fails, the axes after it stop, those before it go on to the end of the graph, and the first
axis' failure is raised.

Example (a batch over dp and a sequence over sp; ``gm`` traced at global shapes, ``x`` its
one input, ``[2, 16, 8]``)::

    mesh = MeshPropagator(gm, [MeshAxis("dp", 2), MeshAxis("sp", 4)])
    mesh.run({"dp": {x: (Shard(0, 1, 2), "in_specs[0]")},
              "sp": {x: (Shard(1, 1, 16), "in_specs[0]")}})
    mesh.placements(node)       # {'dp': Shard(0), 'sp': Shard(1)} for a pointwise op of x
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spdsl.propagate.engine import Propagator
from spdsl.propagate.placement import Placement


@dataclass(frozen=True)
class MeshAxis:
    """One axis of the mesh to propagate over: its ``name``, its ``parts`` (ranks), and the
    engine's options over it (``gathers``, ``attention``: as ``Propagator`` takes them)."""

    name: str
    parts: int
    gathers: str | None = None
    attention: Any = None


class MeshPropagator:
    """Placements for every node of ``gm`` over every axis of ``axes``, highest priority
    first; ``self[name]`` is one axis' ``Propagator``, its ``taken`` the axes before it."""

    def __init__(self, gm: torch.fx.GraphModule, axes: Sequence[MeshAxis]) -> None:
        names = [a.name for a in axes]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"one MeshAxis per mesh axis, at least one; got {names}")
        self.gm = gm
        self.props: dict[str, Propagator] = {}
        for a in axes:
            self.props[a.name] = Propagator(gm, a.parts, a.name, a.gathers, a.attention,
                                            taken=tuple(self.props.values()))

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(self.props)

    def __getitem__(self, axis: str) -> Propagator:
        return self.props[axis]

    def placements(self, node: torch.fx.Node) -> dict[str, Any]:
        """``node``'s placement over each axis."""
        return {name: p.placement(node) for name, p in self.props.items()}

    def run(self, inputs: Mapping[str, Mapping[torch.fx.Node, tuple[Placement, str]]],
            pins: Mapping[str, Mapping[torch.fx.Node, Placement | None]] | None = None
            ) -> None:
        """Decide every node over every axis. ``inputs``: per axis, placeholder -> (placement,
        where it was said); ``pins``: per axis, ``spdsl.constraint`` node -> the placement it
        pins there (an axis or node left out: free)."""
        props = list(self.props.values())
        for p in props:
            p.start(inputs[p.axis], (pins or {}).get(p.axis))
        live, failure = len(props), None
        for node in self.gm.graph.nodes:
            for i, p in enumerate(props[:live]):
                try:
                    p.step(node)
                except Exception as e:      # noqa: BLE001  raised below, in priority order
                    live, failure = i, e
                    break
            if live == 0:
                break
        if failure is not None:
            raise failure
