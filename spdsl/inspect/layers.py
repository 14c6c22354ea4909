"""Blocks of a plan: the program cut where its module changes (``tok_embeddings``,
``layers.3``, top-level code), runs of identical numbered layers folded into one block
(``layers.0-31``, 32 copies), with bytes per rank beside the analytic Ulysses floor.

A layer is a module path ending in a number (a child of an ``nn.ModuleList``); two layers are
identical when their values (op, typed shape, placement, rule) and collectives match after
their own prefix is dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from spdsl.inspect.plan import Collective, ShardingPlan, Value

_LAYER = re.compile(r"^((?:.*?\.)?)(\d+)(?:\.|$)")


def block_of(module: str) -> str:
    """``layers.3.attention.wq`` -> ``layers.3``; ``tok_embeddings`` -> itself; "" -> ""."""
    m = _LAYER.match(module)
    return m.group(1) + m.group(2) if m else module.split(".")[0]


@dataclass(frozen=True)
class Row:
    """One module inside a block: its output (the last value of its subtree) and the
    collectives its own code issues. ``module`` is relative to the block."""

    module: str
    depth: int
    value: Value | None
    collectives: tuple[Collective, ...]


@dataclass(frozen=True)
class Block:
    """A run of the program under one module, or several identical layers folded.
    Values, rows and bytes are those of one member."""

    name: str
    members: tuple[str, ...]
    values: tuple[Value, ...]
    collectives: tuple[Collective, ...]
    rows: tuple[Row, ...]
    own: tuple[Collective, ...]          # issued by the block's own code (not a submodule)
    floor: int                           # analytic Ulysses floor, forward bytes per member
    output: Value | None = None          # the value the block hands on

    @property
    def count(self) -> int:
        return len(self.members)

    @property
    def bytes_fwd(self) -> int:
        return sum(c.bytes for c in self.collectives if c.purpose not in NOT_ACTIVATION)

    @property
    def bytes_bwd(self) -> int:
        return sum(c.bytes_bwd for c in self.collectives if c.purpose not in NOT_ACTIVATION)

    @property
    def grad_bwd(self) -> int:
        return sum(c.bytes_bwd for c in self.collectives if c.purpose == "gradient")

    @property
    def ratio(self) -> float | None:
        return self.bytes_fwd / self.floor if self.floor else None


# collectives of parameters and their gradients, not of activations: not measured against the
# Ulysses floor
NOT_ACTIVATION = ("gradient", "state", "check")   # check: the same-inputs all-reduce


@dataclass(frozen=True)
class Totals:
    """Per rank per step: activation collectives forward and backward, gradient
    all-reduces, and the Ulysses floor they are measured against."""

    bytes_fwd: int
    bytes_bwd: int
    grad_bwd: int
    floor_fwd: int
    floor_bwd: int
    state_fwd: int = 0        # sharded parameters: all-gathers (forward, and backward again
    state_bwd: int = 0        # under remat) and gradient reduce-scatters

    @property
    def ratio_fwd(self) -> float | None:
        return self.bytes_fwd / self.floor_fwd if self.floor_fwd else None

    @property
    def ratio_bwd(self) -> float | None:
        return self.bytes_bwd / self.floor_bwd if self.floor_bwd else None


def totals(plan: ShardingPlan) -> Totals:
    """Sum the plan's collectives and attention floors over one step."""
    act = [c for c in plan.collectives if c.purpose not in NOT_ACTIVATION]
    fwd, bwd = sum(c.bytes for c in act), sum(c.bytes_bwd for c in act)
    floor = sum(a.floor for a in plan.attention)
    state = [c for c in plan.collectives if c.purpose == "state"]
    return Totals(fwd, bwd, sum(c.bytes_bwd for c in plan.collectives
                                if c.purpose == "gradient"), floor, floor if bwd else 0,
                  sum(c.bytes for c in state), sum(c.bytes_bwd for c in state))


def _segments(plan: ShardingPlan) -> list[tuple[str, list[Value]]]:
    segs: list[tuple[str, list[Value]]] = []
    for v in plan.values:
        if v.op == "input":
            continue
        key = block_of(v.module)
        if segs and segs[-1][0] == key:
            segs[-1][1].append(v)
        else:
            segs.append((key, [v]))
    return segs


def _rel(module: str, key: str) -> str:
    if not key:
        return module
    return module[len(key) + 1:] if module.startswith(key + ".") else ""


def _signature(key: str, values: list[Value], colls: list[Collective], floor: int) -> tuple:
    return (tuple((_rel(v.module, key), v.op, v.typed, v.placement, v.origin) for v in values),
            tuple((_rel(c.module, key), c.kind, c.purpose, c.bytes, c.bytes_bwd, c.values)
                  for c in colls), floor)


def _inside(module: str, sub: str) -> bool:
    return not sub or module == sub or module.startswith(sub + ".")


def _rows(key: str, values: list[Value], colls: list[Collective],
          users: dict[str, list[str]]) -> tuple[Row, ...]:
    """A module's output is the last value of its subtree used outside it (a layer norm's
    normalised tensor, not the statistics it also returns)."""
    order: list[str] = []
    last: dict[str, Value] = {}
    escaping: dict[str, Value] = {}
    for v in values:
        rel = _rel(v.module, key)
        parts = rel.split(".") if rel else []
        for n in range(len(parts) + 1):
            m = ".".join(parts[:n])
            if m not in last:
                order.append(m)
            last[m] = v
            full = f"{key}.{m}" if key and m else key or m
            if any(not _inside(u, full) for u in users.get(v.name, ())):
                escaping[m] = v
    last.update(escaping)
    own: dict[str, list[Collective]] = {}
    for c in colls:
        own.setdefault(_rel(c.module, key), []).append(c)
    return tuple(Row(m, m.count(".") + 1 if m else 0, last.get(m), tuple(own.get(m, ())))
                 for m in order)


def _siblings(a: str, b: str) -> bool:
    """Two layers of one container (``layers.3``, ``layers.4``)."""
    ma, mb = _LAYER.match(a), _LAYER.match(b)
    return bool(ma and mb and ma.group(1) == mb.group(1))


def _fold_name(key: str, members: list[str]) -> str:
    if len(members) == 1:
        return key
    m = _LAYER.match(key)
    idx = [int(_LAYER.match(x).group(2)) for x in members]
    prefix = m.group(1)
    if idx == list(range(idx[0], idx[0] + len(idx))):
        return f"{prefix}{idx[0]}-{idx[-1]}"
    return prefix + "{" + ",".join(map(str, idx)) + "}"


def blocks(plan: ShardingPlan) -> list[Block]:
    """The plan's blocks in program order, consecutive identical layers folded."""
    segs = _segments(plan)
    where = {v.name: i for i, (_, vs) in enumerate(segs) for v in vs}
    colls: list[list[Collective]] = [[] for _ in segs]
    for c in plan.collectives:
        if c.node in where:
            colls[where[c.node]].append(c)
    floors = [0] * len(segs)
    for a in plan.attention:
        if a.name in where:
            floors[where[a.name]] += a.floor
    users: dict[str, list[str]] = {}
    for v in plan.values:
        for i in v.inputs:
            users.setdefault(i, []).append(v.module)
    for name, _ in plan.outputs:
        users.setdefault(name, []).append("<out>")
    out: list[Block] = []
    sigs: list[tuple] = []
    for i, (key, vs) in enumerate(segs):
        sig = _signature(key, vs, colls[i], floors[i])
        prev = out[-1] if out else None
        if prev is not None and _siblings(prev.members[0], key) and sigs[-1] == sig:
            members = prev.members + (key,)
            out[-1] = Block(_fold_name(key, list(members)), members, prev.values,
                            prev.collectives, prev.rows, prev.own, prev.floor, prev.output)
            continue
        rows = _rows(key, vs, colls[i], users)
        root = rows[0]                   # module "" (the block itself) comes first
        out.append(Block(key, (key,), tuple(vs), tuple(colls[i]), rows[1:], root.collectives,
                         floors[i], root.value))
        sigs.append(sig)
    return out
