"""The propagated plan: every value's placement and every collective, with where it came from.

Values, placements and attention sites come from the propagation decisions (fake tensors, no
process group; collected by ``spdsl.inspect.decided``), so a model too large for this machine
can be planned here; the other modules of ``spdsl.inspect`` present what a plan holds. The
collectives of a plan ``spdsl.plan`` returns are read off the rank's final local program, one
entry per call (``spdsl.inspect.program``); the list derived from the decisions (``decided``)
stands in only where that program cannot be built (and in plans built from decisions alone).

A plan is a frozen value. What costs a build of the program (its collectives, the schedule
the cost model walks, the memory simulation) is computed when first asked, by the functions of
the ``PlanSources`` it was built with, and kept in a memo the plan creates with itself; a plan
with other fields (``dataclasses.replace``) starts a memo of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spdsl.inspect.explain import Explanation
    from spdsl.inspect.layers import Block, Totals
    from spdsl.inspect.timing import Schedule, Timing
    from spdsl.propagate.attention_choice import Links


@dataclass(frozen=True)
class Collective:
    """One collective call per rank per step: ``bytes`` is the local buffer it moves in
    forward, ``bytes_bwd`` in backward (0: none there). ``recomputed``: a forward collective
    that remat runs again in backward (listed with backward bytes only); ``carries``: the
    parameters whose gradients a gradient bucket reduces together."""

    kind: str            # all_to_all | all_reduce | all_gather | reduce_scatter | halo_exchange
    axis: str
    bytes: int
    bytes_bwd: int
    purpose: str         # ulysses | loss | gradient | reshard | halo | output | input | check
    values: tuple[str, ...]
    source: str
    module: str
    node: str
    recomputed: bool = False
    carries: tuple[str, ...] = ()


@dataclass(frozen=True)
class Value:
    """One value of the traced program: ``typed`` is its typed shape (``f32[2,64@sp,64]``),
    ``origin`` why it has its placement (an input spec, ``parameter x``, a rule name), ``via``
    the input whose placement it follows ("" where the chain starts), ``moves`` the
    redistributions of its inputs as ``(input, from, to)``."""

    name: str
    op: str
    typed: str
    placement: str
    source: str
    module: str
    origin: str
    inputs: tuple[str, ...] = ()
    via: str = ""
    moves: tuple[tuple[str, str, str], ...] = ()
    alternatives: int = 0


@dataclass(frozen=True)
class Attention:
    """An attention site and its analytic Ulysses floor: the forward bytes per rank that
    moving q, k, v and the output between sequence and heads must cost (kv heads fewer than
    the axis counted as repeated up to it)."""

    name: str
    kind: str            # the attention form (spdsl.propagate.forms: sdpa, written_out,
    #                      flash_kernel), or eager: q @ k^T left as ops (v and the output
    #                      assumed shaped like k and q)
    module: str
    source: str
    floor: int
    mask: str = ""       # how its mask is carried: none, a function of per-token values
    #                      (spdsl.propagate.masks), or a dense tensor and its bytes per rank
    runs: str = ""       # how it runs over the ranks: ulysses, ring, hybrid UxR
    #                      (spdsl.propagate.attention_choice), and why: the cost model's
    why: str = ""        # figures (seconds per step, forward and backward) per candidate


@dataclass(frozen=True)
class ProgramRead:
    """What a plan reads off the rank's program: the collectives it calls, one entry per call
    (``spdsl.inspect.program``), the schedule the cost model walks (None where the program
    could not be built here, and ``collectives`` are propagation's), and what ``remat="fit"``
    chose while building it (``RematChoice``; None where nothing was chosen)."""

    collectives: tuple[Collective, ...]
    schedule: Schedule | None = None
    chosen: Any = None


@dataclass(frozen=True)
class PlanSources:
    """How a plan computes its costly parts when first asked: ``program(plan)`` builds the
    rank's program and reads it (a ``ProgramRead``); ``memory()`` simulates one step's memory
    (``spdsl.memory.MemoryPlan``). ``spdsl.plan`` closes them over its step; a plan read
    from JSON, or built from decisions alone, has neither."""

    program: Callable[[ShardingPlan], ProgramRead] | None = None
    memory: Callable[[], Any] | None = None


class _Memo:
    """The parts of one plan computed when first asked, each once: the one mutable thing a
    plan owns, created with it and never shared."""

    __slots__ = ("_known",)

    def __init__(self) -> None:
        self._known: dict[str, Any] = {}

    def get(self, key: str, compute: Callable[[], Any]) -> Any:
        if key not in self._known:
            self._known[key] = compute()
        return self._known[key]


_NO_SOURCES = PlanSources()


@dataclass(frozen=True, eq=False)
class ShardingPlan:
    """Placements and collectives of one traced function on one mesh axis.

    Example::

        plan = spdsl.plan(spdsl.sp_shard(seq=4)(model), ids, labels)
        print(plan)                       # per-layer table, identical layers folded
        [c.kind for c in plan.collectives]
        print(plan.explain("attention"))  # the rules behind one value's placement
        plan.to_html("plan.html")

    ``decided`` are the collectives propagation decided (or JSON listed): ``collectives``
    where the plan has no program to read them off. ``timed``: the cost model's figures as
    JSON gave them, for a plan without a program. Two plans are equal when what they list
    is: values, collectives, outputs, attention, title and remat.
    """

    axis: str
    parts: int
    values: tuple[Value, ...] = ()
    decided: tuple[Collective, ...] = ()
    outputs: tuple[tuple[str, str], ...] = ()     # (value, final placement)
    attention: tuple[Attention, ...] = ()
    title: str = ""
    remat: Any = None     # spdsl.remat.RematChoice: what remat="fit" chose, once the step is built
    remat_mode: str = ""  # the remat= the function asks for ("fit", "full", ...), as described
    timed: Timing | None = None
    sources: PlanSources = field(default=_NO_SOURCES, repr=False)
    _memo: _Memo = field(default_factory=_Memo, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("values", "decided", "attention"):     # lists accepted, tuples kept
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "outputs", tuple(map(tuple, self.outputs)))

    def _listed(self) -> tuple:
        return (self.axis, self.parts, self.values, self.collectives, self.outputs,
                self.attention, self.title, self.remat, self.remat_mode)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardingPlan):
            return NotImplemented
        return self is other or self._listed() == other._listed()

    def __hash__(self) -> int:      # what equal plans share without reading their programs
        return hash((self.axis, self.parts, self.values, self.outputs, self.attention,
                     self.title, self.remat_mode))

    def _program(self) -> ProgramRead | None:
        """The rank's program as read, built when first asked; None without one."""
        read = self.sources.program
        return None if read is None else self._memo.get("program", lambda: read(self))

    @property
    def collectives(self) -> tuple[Collective, ...]:
        """Every collective call per rank per step: read off the rank's program where the
        plan knows it (``spdsl.inspect.program``), else ``decided``."""
        read = self._program()
        return self.decided if read is None else read.collectives

    @property
    def bytes_fwd(self) -> int:
        return sum(c.bytes for c in self.collectives)

    @property
    def bytes_bwd(self) -> int:
        return sum(c.bytes_bwd for c in self.collectives)

    @property
    def memory(self):
        """Predicted per-rank peak memory of one training step under the function's remat
        policy (``spdsl.memory.MemoryPlan``), simulated on fake tensors when first asked."""
        simulate = self.sources.memory
        if simulate is None:
            raise AttributeError("this plan has no function to simulate (build it with "
                                 "spdsl.plan on an sp_shard/shard-ed function)")
        return self._memo.get("memory", simulate)

    @property
    def by_name(self) -> dict[str, Value]:
        return self._memo.get("by_name", lambda: {v.name: v for v in self.values})

    def value(self, name: str) -> Value:
        """The value named ``name`` (an FX node name, as printed by ``explain``)."""
        try:
            return self.by_name[name]
        except KeyError:
            raise KeyError(f"no value {name!r} in this plan") from None

    @property
    def layers(self) -> list[Block]:
        """Blocks of the program in order, runs of identical layers folded into one."""
        from spdsl.inspect.layers import blocks
        return self._memo.get("layers", lambda: blocks(self))

    @property
    def totals(self) -> Totals:
        """Bytes per rank per step beside the analytic Ulysses floor."""
        from spdsl.inspect.layers import totals
        return self._memo.get("totals", lambda: totals(self))

    @property
    def has_timing(self) -> bool:
        """Whether :meth:`timing` has figures to give: a program to time, or JSON's."""
        read = self._program()
        return self.timed is not None or read is not None and read.schedule is not None

    def timing(self, links: Links | None = None) -> Timing:
        """The step's communication against its compute from a cost model of the program
        that runs: each transfer's seconds, how much of it is exposed and what hides the rest
        (``spdsl.inspect.timing``; ``links`` default to the plan's device model, the one its
        attention choice priced: ``spdsl.propagate.attention_choice.device_model``)."""
        read = self._program()
        schedule = read.schedule if read is not None else None
        if schedule is None and links is None and self.timed is not None:
            return self.timed                   # read from JSON: its figures only
        if schedule is None:
            raise AttributeError("this plan has no program to time (build it with spdsl.plan "
                                 "on an sp_shard/shard-ed function)")
        from spdsl.inspect.timing import simulate
        if links is not None:
            return simulate(schedule, links)
        return self._memo.get("timed", lambda: simulate(schedule))   # table, JSON, HTML

    def explain(self, value: Any) -> Explanation:
        """The chain of rules that gave ``value`` (a name, a ``Value`` or an fx node) its
        placement, from the input spec (or constraint) that started it."""
        from spdsl.inspect.explain import explain
        return explain(self, value)

    def to_json(self, indent: int | None = 1) -> str:
        """The plan as JSON (schema ``spdsl.plan``, see docs/plan.md)."""
        from spdsl.inspect.schema import to_json
        return to_json(self, indent)

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        """Read back what ``to_json`` wrote."""
        from spdsl.inspect.schema import from_json
        return from_json(text)

    def to_html(self, path: str | None = None) -> str:
        """A self-contained HTML page of the plan; written to ``path`` when given."""
        from spdsl.inspect.html import to_html
        return to_html(self, path)

    def __str__(self) -> str:
        from spdsl.inspect.text import render
        return render(self)


def render(plan: ShardingPlan) -> str:
    """The compact text table ``print(plan)`` shows."""
    return str(plan)
