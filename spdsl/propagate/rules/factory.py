"""Values made from nothing (arange, ones, full, constants) are replicated: every rank builds
the global tensor. Where one meets a split value it is sliced locally, for free."""

from __future__ import annotations

from spdsl.propagate.placement import REPLICATE
from spdsl.propagate.rules import RuleCtx, Strategy, aten, rule


@rule(aten.arange, aten.ones, aten.zeros, aten.full, aten.empty, aten.scalar_tensor,
      aten.lift_fresh_copy, aten.empty_strided, aten.eye, aten.randn, aten.rand, aten.tensor,
      aten._local_scalar_dense, name="factory")
def factory(ctx: RuleCtx) -> list[Strategy]:
    return [Strategy(tuple(REPLICATE for _ in ctx.inputs), REPLICATE, "factory", "factory")]


@rule(aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty, name="factory")
def new_factory(ctx: RuleCtx) -> list[Strategy]:
    """``x.new_ones(size)``: only ``x``'s dtype and device are read, so ``x`` stays as it is
    (split, partial or whole) and the new tensor is whole."""
    return [Strategy(tuple(ctx.placements), REPLICATE, "factory", "factory")]
