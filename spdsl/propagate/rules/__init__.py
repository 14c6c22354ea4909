"""Propagation rules, one file per op family, all applied by one engine (``engine.py``).

A rule looks at a node and the placements of its tensor inputs and returns candidate
``Strategy`` values: the placement each input must have, the placement of the output, and
(optionally) a named lowering. The engine prices each candidate by the bytes its
redistributions move and keeps the cheapest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from spdsl._torch import OpOverload
from spdsl.propagate.lowerings import check as check_lowering
from spdsl.propagate.placement import Placement

aten = torch.ops.aten


@dataclass(frozen=True)
class Strategy:
    inputs: tuple[Placement, ...]          # one per tensor input, in flat order
    output: Any                            # a Placement, or a tuple of them for tuple outputs
    lowering: str | None = None            # a named lowering (propagate.lowerings), None: the op
    rule: str = ""                         # the rule's name, shown by plans
    extra_cost: float = 0.0

    def __post_init__(self) -> None:
        check_lowering(self.lowering)


@dataclass
class RuleCtx:
    node: torch.fx.Node
    inputs: list[torch.fx.Node]            # tensor inputs, flat order
    placements: list[Placement]
    parts: int                             # size of the mesh axis
    attention: Any = None                  # the user's attention= (AttentionConfig)
    constraint: Placement | None = None    # what a with_sharding_constraint pins on this axis

    def meta(self, i: int):
        return self.inputs[i].meta["val"]

    @property
    def out(self):
        return self.node.meta["val"]

    def atoms(self, i: int):
        return self.inputs[i].meta.get("spdsl_atoms") or tuple((int(n),) for n in self.meta(i).shape)


Rule = Callable[[RuleCtx], list[Strategy]]
RULES: dict[Any, Rule] = {}
_RULE_NAMES: dict[Any, str] = {}


def _claim(op: Any, fn: Rule, name: str, replace: bool = False) -> None:
    # one rule per op: a second registration would silently win or lose by import order
    if op in RULES and RULES[op] is not fn and not replace:
        raise ValueError(f"{op} already has the rule {_RULE_NAMES[op]!r}; a second one "
                         f"({name!r}) would override it (register_rule(..., replace=True) "
                         "to override on purpose)")
    RULES[op] = fn
    _RULE_NAMES[op] = name


def rule(*ops: Any, name: str | None = None) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        for op in ops:
            _claim(op, fn, name or fn.__name__.strip("_"))
        return fn
    return deco


def register_rule(op: Any, fn: Rule, *, replace: bool = False) -> None:
    """Teach the engine an op: ``fn(ctx) -> list[Strategy]``; ``op`` is an aten overload or
    packet (``torch.ops.mylib.myop``). An op that already has a rule is an error unless
    ``replace=True``.

    Example::

        from spdsl import register_rule, Strategy
        from spdsl.propagate.placement import REPLICATE
        # an elementwise custom op keeps whatever placement its input has
        register_rule(torch.ops.mylib.gelu2, lambda ctx: [
            Strategy((ctx.placements[0],), ctx.placements[0], rule="mylib.gelu2")])
    """
    _claim(op, fn, getattr(fn, "__name__", str(op)), replace)


def lookup(op: Any) -> Rule | None:
    if op in RULES:
        return RULES[op]
    packet = getattr(op, "overloadpacket", None)
    if packet in RULES:
        return RULES[packet]
    if isinstance(op, OpOverload) and torch.Tag.pointwise in op.tags:
        from spdsl.propagate.rules.pointwise import pointwise
        return pointwise
    return None


from spdsl.propagate.rules import (  # noqa: F401  (registration side effects)
    attention,
    counts,
    factory,
    index,
    loss,
    matmul,
    mixers,
    pointwise,
    reduction,
    tokenwise,
    views,
)
