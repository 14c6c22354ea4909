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
    # the collectives the read itself runs (a split value gathered, a partial sum reduced), as
    # ``spdsl.inspect.plan.Collective``; those of ``collectives`` no segment's program runs
    issued: tuple = ()

    def __str__(self) -> str:
        cost = ", ".join(self.collectives) or "no collective"
        whole = "; the whole sequence on every rank" if self.whole else ""
        return f"break at {self.where}   {self.kind} {self.value} <- {cost}{whole}"


@dataclass(frozen=True)
class Segment:
    """One segment: ``ops`` traced ops, ``outputs`` values it hands on, and its plan;
    ``before``: the collectives the call runs before its program (the check that every rank
    passed the same arguments, before the first); ``after``: those it runs after it (the last:
    a partial sum an earlier segment handed on, reduced to be handed back)."""

    index: int
    ops: int
    outputs: int
    plan: Any          # ShardingPlan
    before: tuple = ()
    after: tuple = ()


class SegmentedPlan:
    """Segments and breaks of one call; ``collectives``: every segment's, in order."""

    def __init__(self, segments: list[Segment], breaks: list[Break], memory=None) -> None:
        self.segments, self.breaks = segments, breaks
        self._memory = memory

    @property
    def memory(self):
        """Predicted per-rank peak of one training step along the paths planned so far
        (``spdsl.memory.segmented.SegmentedMemoryPlan``), simulated when first asked and
        kept."""
        if self._memory is None:
            raise AttributeError("this plan has no function to simulate (build it with "
                                 "spdsl.plan on an sp_shard/shard-ed function)")
        if callable(self._memory):
            self._memory = self._memory()
        return self._memory

    @property
    def collectives(self) -> list:
        """Every collective of one call, in order (``spdsl.inspect.plan.Collective``): per
        segment, what runs before its program, its program's (forward, backward and its
        gradient buckets), then what the reads after it run. The segments' gradient buckets
        are merged as backward merges them (:func:`merged_buckets`)."""
        out = [c for s in self.segments[:1] for c in s.before]
        out += [c for b in self.breaks if b.segment < 0 for c in b.issued]
        for s in self.segments:
            out += list(s.before if s.index else ()) + list(s.plan.collectives)
            out += list(s.after)
            out += [c for b in self.breaks if b.segment == s.index for c in b.issued]
        return merged_buckets(out)

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


def merged_buckets(colls: list, cap: int | None = None) -> list:
    """``colls`` (one call's, in forward order) with the merged gradient buckets of its
    segments' programs replaced by the all-reduces backward issues for them
    (``spdsl.collectives.grads``): walked in backward order (the reverse of the list), a bucket
    is held, and the held ones of its group and dtype are reduced as one where adding it would
    pass ``cap`` bytes (default ``spdsl.lower.grad_buckets.GRAD_BUCKET_BYTES``, read now),
    listed at that bucket; those still held where backward ends are listed at the last bucket
    backward reaches."""
    from spdsl.inspect.plan import Collective
    from spdsl.lower import grad_buckets
    cap = grad_buckets.GRAD_BUCKET_BYTES if cap is None else cap
    held: dict = {}         # (axis, dtype) -> the buckets held, in backward order
    at: dict[int, list] = {}     # list position -> the merged all-reduces issued there
    last = None

    def merged(group: list) -> Collective:
        first = group[0]
        return Collective("all_reduce", first.axis, 0, sum(c.bytes_bwd for c in group),
                          "gradient", tuple(v for c in group for v in c.values), "",
                          first.module, grad_buckets.MERGED,
                          carries=tuple(p for c in group for p in c.carries))

    for i in reversed(range(len(colls))):
        c = colls[i]
        if c.node != grad_buckets.MERGED:
            continue
        key = (c.axis, c.values[0].lstrip("(").split("[")[0] if c.values else "")
        group = held.pop(key, [])
        if group and sum(g.bytes_bwd for g in group) + c.bytes_bwd > cap:
            at.setdefault(i, []).append(merged(group))
            group = []
        held[key] = [*group, c]
        last = i
    if last is None:
        return list(colls)
    at.setdefault(last, []).extend(merged(g) for g in held.values())
    out = []
    for i, c in enumerate(colls):
        out += at.get(i, [])
        if c.node != grad_buckets.MERGED:
            out.append(c)
    return out
