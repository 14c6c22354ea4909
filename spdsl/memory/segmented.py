"""What the memory planner gives for a forward that reads tensor values in Python (it runs in
segments, ``spdsl.annotate.breaks``): a plan per *path* (the segments one call runs and the
values its reads gave), the step's peak the worst path planned. How a path is planned is
``spdsl.annotate.segments_memory``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from spdsl.memory.report import MemoryPlan, fmt_bytes


@dataclass(frozen=True)
class PathMemory:
    """One path's step: the values its reads gave (``reads``, as Python saw them), the
    segments it ran, and its ``MemoryPlan``."""

    reads: tuple[str, ...]
    segments: int
    plan: MemoryPlan
    guards: tuple = dataclasses.field(default=(), compare=False, repr=False)

    @property
    def peak(self) -> int:
        return self.plan.peak


@dataclass(frozen=True)
class SegmentedMemoryPlan:
    """Per-rank memory of a step of a function that reads values: one ``PathMemory`` per path
    planned (``this``: the index of the path of the call just planned), ``peak`` the worst.
    Reads of a ``MemoryPlan`` (``parameters``, ``activations``, ``peak_phase``, ...) are the
    worst path's; ``unplanned``: paths the runner recorded that no plan has taken.

    Example::

        mem = plan_memory(step, x_pos)          # step branches on x.mean() > 0
        mem = plan_memory(step, x_neg)          # the other branch: both paths now
        mem.peak == max(p.peak for p in mem.paths)
        print(mem)         # the worst path's breakdown, then one line per path
    """

    paths: tuple[PathMemory, ...]
    this: int = 0
    unplanned: int = 0

    @property
    def worst(self) -> PathMemory:
        return max(self.paths, key=lambda p: p.peak)

    @property
    def peak(self) -> int:
        return self.worst.peak

    def __getattr__(self, name: str):
        if name.startswith("_") or name in ("paths", "this", "unplanned"):
            raise AttributeError(name)
        return getattr(self.worst.plan, name)

    def __str__(self) -> str:
        worst = self.worst
        lines = [str(worst.plan), (f"{len(self.paths)} paths planned; the step's peak is the "
                                   "worst (the function reads tensor values in Python):")]
        for i, p in enumerate(self.paths):
            reads = ", ".join(p.reads) or "none"
            mark = (" (this call)" if i == self.this else "") + \
                (" <- worst" if p is worst else "")
            lines.append(f"  path {i}: {p.segments} segments, reads {reads}: peak "
                         f"{fmt_bytes(p.peak)}{mark}")
        if self.unplanned:
            lines.append(f"  {self.unplanned} recorded paths not planned (plan with arguments "
                         "that take them)")
        return "\n".join(lines)
