"""One rule asked directly: a tiny function traced on fake tensors, the ``RuleCtx`` of one of
its ops with the input placements a test chooses, and the strategies printed the way plans
print them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spdsl.propagate.engine import tensor_inputs
from spdsl.propagate.placement import REPLICATE, Placement
from spdsl.propagate.rules import RuleCtx, Strategy, lookup


def ctx_of(fn: Callable, args: Sequence[torch.Tensor], op: str | Any,
           placements: Sequence[Placement] | None = None, parts: int = 4,
           which: int = -1) -> RuleCtx:
    """The context of the ``which``-th call of ``op`` (``aten.<op>`` when a name, else an op
    packet) in ``fn(*args)`` traced on fake tensors; ``placements``: one per tensor input (all
    replicated when None)."""
    packet = getattr(torch.ops.aten, op) if isinstance(op, str) else op
    gm = make_fx(fn, tracing_mode="fake")(*args)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"
             and getattr(n.target, "overloadpacket", None) is packet]
    assert nodes, [str(n.target) for n in gm.graph.nodes]
    node = nodes[which]
    ins = tensor_inputs(node)
    placements = [REPLICATE] * len(ins) if placements is None else list(placements)
    assert len(placements) == len(ins), (len(placements), len(ins))
    return RuleCtx(node, ins, placements, parts)


def strategies(ctx: RuleCtx) -> list[Strategy]:
    """The strategies the op's own rule offers in ``ctx``."""
    rule = lookup(ctx.node.target)
    assert rule is not None, ctx.node.target
    return list(rule(ctx))


def table(ss: Sequence[Strategy]) -> list[tuple]:
    """Each strategy as ``(rule, inputs, output)`` in placement reprs: what a failing assert
    shows."""
    def show(p):
        return tuple(map(repr, p)) if isinstance(p, tuple) else repr(p)
    return [(s.rule, show(s.inputs), show(s.output)) for s in ss]
