"""One redistribution as propagation decides it: the collective it is, and its bytes.

The engine prices strategies with it, the lowering runs the collective its ``kind`` names, and
the plan lists its ``collectives`` -- one table, so what a plan says is what runs:

=====================  ==============  =====================  ============================
redistribution         kind            forward                backward
=====================  ==============  =====================  ============================
Partial -> Replicate   all_reduce      all-reduce (whole)     identity
Partial -> Shard       reduce_scatter  reduce-scatter         all-gather (local piece)
Shard -> Replicate     all_gather      all-gather (piece)     local slice
Replicate -> Shard     take            local slice            all-gather (local piece)
Shard -> Shard         all_to_all      all-to-all (piece)     all-to-all back
=====================  ==============  =====================  ============================

Bytes are per rank: those of the buffer each rank hands to the collective (the whole value
for a reduction, the local piece for a gather or an all-to-all), as a process group counts
them.
"""

from __future__ import annotations

from dataclasses import dataclass

from spdsl.propagate.placement import Partial, Placement, Replicate, Shard

INF = float("inf")
PRICED_PARTS = 2         # the degree one rank prices its strategies at (Move.price)


def kind_of(src: Placement, dst: Placement) -> str:
    """The collective that takes a value from ``src`` to ``dst`` (``"none"`` if equal)."""
    if src == dst:
        return "none"
    if isinstance(src, Partial):
        return "reduce_scatter" if isinstance(dst, Shard) else "all_reduce"
    if isinstance(dst, Partial):
        raise TypeError(f"nothing becomes partial by a redistribution ({src!r} -> {dst!r})")
    if isinstance(src, Replicate):
        return "take"
    return "all_gather" if isinstance(dst, Replicate) else "all_to_all"


@dataclass(frozen=True)
class Move:
    """``src -> dst`` of a value of ``nbytes`` (global) over an axis of ``parts`` ranks."""

    src: Placement
    dst: Placement
    nbytes: int
    parts: int

    @property
    def kind(self) -> str:
        return kind_of(self.src, self.dst)

    @property
    def local(self) -> int:
        return self.nbytes // self.parts

    def collectives(self, grad: bool = True) -> list[tuple[str, int, int]]:
        """``(kind, bytes forward, bytes backward)`` of each collective it runs (backward
        bytes only where the value needs a gradient)."""
        k, b, p = self.kind, self.nbytes, self.local
        if self.parts == 1 or k == "none":
            return []
        g = p if grad else 0
        return {
            "all_reduce": [("all_reduce", b, 0)],
            "reduce_scatter": [("reduce_scatter", b, 0), ("all_gather", 0, g)],
            "all_gather": [("all_gather", p, 0)],
            "take": [("all_gather", 0, g)],
            "all_to_all": [("all_to_all", p, g)],
        }[k]

    @property
    def cost(self) -> float:
        """Bytes that leave a rank in forward. A move into a partial sum raises ``TypeError``
        on any number of ranks."""
        kind = self.kind
        if self.parts == 1 or kind in ("none", "take"):
            return 0.0
        return self._sent(self.parts, kind, exact=True)

    @property
    def price(self) -> float:
        """What the engine minimises: ``cost`` on two ranks or more. On one rank nothing
        leaves and every strategy would cost 0, so the engine would break ties by order and
        could take a strategy no larger degree takes: a reduce-scatter of a partial sum into a
        split that an in-place ``copy_`` into a partial destination then cannot accept
        (Qwen3.5's Gated DeltaNet scan). There the price is the bytes the move would send on
        two ranks, divisibility aside: one rank decides as the smallest real degree does."""
        if self.parts > 1:
            return self.cost
        kind = self.kind
        return 0.0 if kind in ("none", "take") else self._sent(PRICED_PARTS, kind, exact=False)

    def _sent(self, parts: int, kind: str, exact: bool) -> float:
        frac = (parts - 1) / parts
        if kind == "all_to_all":
            if exact and (self.src.size % parts or self.dst.size % parts):
                return INF
            return self.nbytes / parts * frac
        if kind == "reduce_scatter":
            return self.nbytes * frac if not exact or self.dst.size % parts == 0 else INF
        if kind == "all_gather":
            return self.nbytes * frac
        return 2 * self.nbytes * frac                        # all_reduce


def fused(moves: dict[int, Move]) -> tuple[int, ...]:
    """Inputs of one op that change split dims together (q and k of a score): they share one
    all-to-all. Empty unless there are at least two."""
    # a split moving within one dim is its own exchange (spdsl.collectives.rechunk)
    idx = tuple(sorted(i for i, m in moves.items()
                       if m.kind == "all_to_all" and m.src.dim != m.dst.dim))
    return idx if len(idx) > 1 else ()
