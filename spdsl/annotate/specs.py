"""Specs as the user writes them: ``with_sharding_constraint`` pins a value inside a traced
function; the checks ``Sharded`` makes of its specs when a function is wrapped, and the axis
they name. A call's specs are read into placements by ``spdsl.pipeline.starts``."""

from __future__ import annotations

import torch

from spdsl._torch import tree_flatten
from spdsl.pipeline.spec import P, as_spec
from spdsl.pipeline.starts import encode
from spdsl.propagate.trace import tracing


def with_sharding_constraint(x: torch.Tensor, spec: P) -> torch.Tensor:
    """Pin the placement of ``x`` inside a sharded function; outside one it returns ``x``.

    Example::

        h = spdsl.with_sharding_constraint(h, P(None, "sp", None))
    """
    spec = as_spec(spec, "with_sharding_constraint spec", x.dim())
    if not tracing():
        return x
    return torch.ops.spdsl.constraint(x, encode(spec))


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
