"""The plan of a function that reads tensor values in Python (``spdsl.annotate.breaks``): its
segments, each with its own ``ShardingPlan``, and its breaks -- where Python read a value, the
value as a typed shape, and the collective that made it global there.

Example::

    plan = spdsl.plan(step, x)        # step reads x.mean() in an `if`
    print(plan)
    # 2 segments, 1 break; the function reads tensor values in Python: ...
    # segment 0: 6 ops, 2 outputs
    #   break at model.py:12: if h.mean() > 0:   bool bool[] <- all_reduce 4 B
    # segment 1: 9 ops, 1 output
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Break:
    """One read of a value by Python: after segment ``segment`` ran (-1: none had), at
    ``where``.
    ``kind``: ``bool`` (a branch), ``item`` (a number), or the op that made a shape from data
    (``unique``, ``nonzero``, ``x[mask]``); ``value``: the typed shape as the segment left it;
    ``collectives`` (``all_reduce 4 B``, ...) what each rank moves to make the value whole on
    every rank, ``bytes`` their sum; ``whole``: the op then runs on the whole sequence on every
    rank (a shape from data cannot be computed on a piece)."""

    segment: int
    kind: str
    where: str
    value: str
    collectives: tuple[str, ...]
    bytes: int
    whole: bool = False
    module: str = ""          # the module being traced at the read
    note: str = ""            # a cheaper way, where one is known

    def __str__(self) -> str:
        cost = ", ".join(self.collectives) or "no collective"
        whole = "; the whole sequence on every rank" if self.whole else ""
        return f"break at {self.where}   {self.kind} {self.value} <- {cost}{whole}"


@dataclass(frozen=True)
class Segment:
    """One segment: ``ops`` traced ops, ``outputs`` values it hands on, and its plan."""

    index: int
    ops: int
    outputs: int
    plan: Any          # ShardingPlan


class SegmentedPlan:
    """Segments and breaks of one call; ``collectives``: every segment's, in order."""

    def __init__(self, segments: list[Segment], breaks: list[Break]) -> None:
        self.segments, self.breaks = segments, breaks

    @property
    def collectives(self) -> list:
        return [c for s in self.segments for c in s.plan.collectives]

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps({"segments": [{"index": s.index, "ops": s.ops, "outputs": s.outputs,
                                         "plan": json.loads(s.plan.to_json(None))}
                                        for s in self.segments],
                           "breaks": [asdict(b) for b in self.breaks]}, indent=indent)

    def __str__(self) -> str:
        lines = [(f"{len(self.segments)} segments, {len(self.breaks)} breaks; the function "
                 "reads tensor values in Python, so each new path of values traces")]
        for s in self.segments:
            n = len(s.plan.collectives)
            lines.append(f"segment {s.index}: {s.ops} ops, {s.outputs} outputs, "
                         f"{n} collectives")
            lines += [f"  {b}" for b in self.breaks if b.segment == s.index]
        lines += [f"  {b}" for b in self.breaks if b.segment < 0]
        lines += [f"note: {n}" for n in dict.fromkeys(b.note for b in self.breaks if b.note)]
        return "\n".join(lines)
