"""``plan.explain(value)``: why a value has its placement.

Each value records the input whose placement its rule carried over (``via``). Walking those
links back gives the chain ``input spec -> rule -> rule -> ... -> this value``; it stops at an
input spec, a constraint, or a value made whole on every rank (a factory such as ``arange``,
or a rule that replicated its inputs). Runs of steps that keep the placement unchanged are
folded when printed (a value in layer 31 follows the residual stream through every layer).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from spdsl.inspect.plan import Collective, ShardingPlan, Value


@dataclass(frozen=True)
class Explanation:
    """The chain of values from the one that started a placement to ``target``.

    Example::

        e = plan.explain("attention_3")
        e.rules            # ['in_specs[0]', 'embedding', 'pointwise', ..., 'attention.ulysses']
        print(e)
    """

    target: Value
    steps: tuple[Value, ...]                 # root first, target last
    collectives: tuple[Collective, ...]      # issued by the ops of the steps

    @property
    def rules(self) -> list[str]:
        return [v.origin for v in self.steps]

    @property
    def root(self) -> Value:
        return self.steps[0]

    def __str__(self) -> str:
        t = self.target
        where = ", ".join(x for x in (t.module, t.source) if x)
        lines = [f"{t.name}: {t.typed}  {t.placement}" + (f"  ({where})" if where else "")]
        lines.append(f"  because: {_why_root(self.root)}")
        issued: dict[str, list[Collective]] = {}
        for c in self.collectives:
            issued.setdefault(c.node, []).append(c)
        for item in _fold(self.steps):
            if isinstance(item, str):
                lines.append(f"    {item}")
                continue
            lines.append("    " + _step(item))
            for c in issued.get(item.name, ()):
                lines.append(f"      issues {c.kind} ({c.purpose}) of {', '.join(c.values)}")
        return "\n".join(lines)


def _why_root(v: Value) -> str:
    if v.op == "input":
        return f"{v.name} is {v.placement} by {v.origin}"
    if v.origin == "constraint":
        return f"with_sharding_constraint at {v.source or v.module}"
    return f"{v.name} ({v.op}) is made {v.placement} by rule {v.origin!r}"


def _step(v: Value) -> str:
    note = v.origin
    if v.moves and v.alternatives > 1:
        # a conflict the engine resolved: say it priced the other ways of running the op
        note += f" (cheapest of {v.alternatives} strategies)"
    for name, src, dst in v.moves:
        note += f"; moves {name} {src} -> {dst}"
    where = "  ".join(x for x in (v.source, v.module) if x)
    return f"{v.name:18} {v.typed:28} {v.placement:20} {note}  {where}".rstrip()


def _plain(prev: Value, v: Value) -> bool:
    return v.placement == prev.placement and not v.moves


def _fold(steps: tuple[Value, ...], keep: int = 1) -> list[Any]:
    """Steps, with runs of unremarkable ones (placement unchanged, no choice, nothing moved)
    longer than three replaced by a one-line summary."""
    out: list[Any] = [steps[0]]
    run: list[Value] = []

    def flush() -> None:
        if len(run) > 3:
            counts = Counter(v.origin for v in run[keep:])
            summary = ", ".join(f"{r} x{n}" for r, n in counts.most_common())
            out.extend(run[:keep])
            out.append(f"... {len(run) - keep} more steps keep {run[0].placement} "
                       f"({summary})")
        else:
            out.extend(run)
        run.clear()

    for prev, v in pairwise(steps[:-1]):
        if _plain(prev, v):
            run.append(v)
        else:
            flush()
            out.append(v)
    flush()
    if len(steps) > 1:
        out.append(steps[-1])
    return out


def _resolve(plan: ShardingPlan, value: Any) -> Value:
    if isinstance(value, Value):
        return value
    name = getattr(value, "name", value)        # an fx node
    if name in plan.by_name:
        return plan.by_name[name]
    inside = [v for v in plan.values if v.module == name or v.module.startswith(f"{name}.")]
    if inside:                                  # a module path: its last value
        return inside[-1]
    raise KeyError(f"no value or module {name!r} in this plan (value names are FX node names "
                   "such as 'mm_3'; module paths such as 'layers.3.attention')")


def explain(plan: ShardingPlan, value: Any) -> Explanation:
    """Walk back from ``value`` (a value name, ``Value``, fx node, or module path) through
    the inputs whose placements decided each step.

    Example::

        print(explain(plan, "layers.0.attention"))
    """
    v = _resolve(plan, value)
    chain = [v]
    seen = {v.name}
    while v.via and v.origin != "constraint" and v.via in plan.by_name:
        v = plan.by_name[v.via]
        if v.name in seen:
            break
        seen.add(v.name)
        chain.append(v)
    target = chain[0]
    colls = tuple(c for c in plan.collectives if c.node in seen and c.purpose != "gradient")
    return Explanation(target, tuple(reversed(chain)), colls)
