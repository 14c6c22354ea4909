"""The propagation engine: one pass over the traced graph in order, one rule per op.

For every node it asks the op's rule for candidate strategies, prices each by the bytes its
input redistributions move (all-to-all ``1/P`` of a gather; local slices free; partial sums
charged their eventual reduction), keeps the cheapest (ties: the rule's order), and records the
decision. Replicated values consumed where the output is split are marked: their gradient is a
partial sum over the shards and is all-reduced in backward.
"""

from __future__ import annotations

import functools
import math
import operator
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from spdsl.errors import ShardingError
from spdsl.propagate import rules as _rules
from spdsl.propagate.issued import Issued, issued
from spdsl.propagate.moves import Move, fused
from spdsl.propagate.placement import (
    REPLICATE,
    Placement,
    Replicate,
    Shard,
    typed_shape,
)
from spdsl.propagate.rules import RuleCtx, Strategy
from spdsl.propagate.rules.dtensor import strategy_from_dtensor
from spdsl.propagate.source import module_of, source_of, where
from spdsl.propagate.viewmap import atoms_through_view

aten = torch.ops.aten
INF = float("inf")

_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_SAME_SHAPE_ATOMS = {aten.clone.default, aten._to_copy.default, aten.alias.default,
                     aten.detach.default}
# ops that sort, select or scan along a dim: along the split sequence each rank needs all of
# it, so the engine gathers it (an all-gather of the whole value, then every rank does the
# whole op); Propagator(gathers=...) says so
_ALONG_SEQUENCE = {aten.sort, aten.topk, aten.cumsum, aten.cumprod, aten.cummax, aten.cummin,
                   aten.logcumsumexp, aten.kthvalue, aten.median, aten.mode, aten._fft_r2c,
                   aten._fft_c2c, aten._fft_c2r}

# the dims argument of these ops' default overloads (ops along dims, same shape elsewhere)
_DIMS_ARG = {aten.cummax, aten.cummin, aten.cumprod, aten.logcumsumexp, aten._fft_r2c,
             aten._fft_c2c, aten._fft_c2r}


def _along_without_dtensor(node, ins, cur, val) -> Strategy:
    """For an op of ``_ALONG_SEQUENCE`` DTensor has no strategy for (before torch 2.13: the
    cumulative ops but cumsum, median, kthvalue, mode, the FFTs): a split it runs along is
    gathered, as DTensor's strategies for the others do, and one it does not run along kept."""
    p = cur[0] if len(ins) == 1 else None
    if isinstance(p, Shard) and node.target.overloadpacket in _DIMS_ARG and \
            node.target is node.target.overloadpacket.default and len(node.args) > 1:
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        rank = ins[0].meta["val"].dim()
        if p.dim not in {d % rank for d in dims}:
            out = tuple(p for _ in val) if isinstance(val, (tuple, list)) else p
            return Strategy((p,), out, None, "along another dim")
    out = tuple(REPLICATE for _ in val) if isinstance(val, (tuple, list)) else REPLICATE
    return Strategy(tuple(REPLICATE for _ in ins), out, None, "whole")


@dataclass
class Decision:
    """What propagation decided for one node."""

    output: Any                              # Placement, or tuple for tuple-valued ops
    strategy: Strategy
    redistribute: dict[int, tuple[Placement, Placement]] = field(default_factory=dict)
    moves: dict[int, Move] = field(default_factory=dict)     # the same, with kinds and bytes
    issued: tuple[Issued, ...] = ()         # collectives its named lowering issues itself
    fused: tuple[int, ...] = ()             # inputs moved by one shared all-to-all
    grad_reduce: list[int] = field(default_factory=list)   # inputs whose grads are partial
    origin: str = ""
    alternatives: int = 0                   # strategies the rule offered (plans explain them)
    cost: float = 0.0                       # bytes the chosen one's redistributions move


def tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Tensor-valued node arguments in ``tree_flatten((args, kwargs))`` order."""
    out: list[torch.fx.Node] = []
    _walk((node.args, node.kwargs), out)
    return out


def gradient_reaches(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes a gradient can flow back into: some path of uses reaches the output through
    floating values, without passing a ``detach``. An integer or boolean value carries none (the
    indices of a ``topk`` whose values nothing reads: what produced its input gets no gradient,
    and the collective that moved that input has no backward). An in-place op whose result is
    unread still carries a gradient into the tensor it writes (``buf[..., i] = x`` in a chunked
    recurrence): it counts where what it writes does. Reverse passes until nothing changes
    (one, in a graph without in-place writes)."""
    writes = {n: _written(n) for n in graph.nodes if n.op == "call_function"}
    writes = {n: w for n, w in writes.items() if w}
    live: set[torch.fx.Node] = set()
    while True:
        before = len(live)
        for n in reversed(graph.nodes):
            if n in live:
                continue
            if n.op == "output" or _may_carry_grad(n) and (
                    any(u in live and u.target is not torch.ops.aten.detach.default
                        for u in n.users) or any(w in live for w in writes.get(n, ()))):
                live.add(n)
        if len(live) == before:
            return live


def _written(n: torch.fx.Node) -> list[torch.fx.Node]:
    """The tensors an in-place or ``out=`` op writes: each written argument and, where it is
    a view (``buf[:, i]``), the tensors it views."""
    schema = getattr(n.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        x = n.args[i] if i < len(n.args) and not arg.kwarg_only else n.kwargs.get(arg.name)
        while isinstance(x, torch.fx.Node):
            out.append(x)
            x = x.args[0] if _is_view(x) and x.args else None
    return out


def _is_view(n: torch.fx.Node) -> bool:
    if n.target is operator.getitem:          # a piece of a split / unbind: a view too
        return True
    schema = getattr(n.target, "_schema", None)
    return schema is not None and not schema.is_mutable and bool(schema.returns) and \
        schema.returns[0].alias_info is not None


def _may_carry_grad(n: torch.fx.Node) -> bool:
    val = n.meta.get("val")
    if val is None:                 # a node made after tracing: assume it may
        return True
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
               for v in vals)


def _walk(x: Any, out: list[torch.fx.Node]) -> None:
    # pytree's flatten costs ~0.3 ms a node; planning a 70B model walks 6,000 nodes 3 times
    if isinstance(x, torch.fx.Node):
        if isinstance(x.meta.get("val"), torch.Tensor):
            out.append(x)
    elif isinstance(x, (tuple, list)):
        for y in x:
            _walk(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _walk(y, out)


def nbytes(meta: torch.Tensor) -> int:
    return meta.numel() * meta.element_size()


def redistribute_cost(src: Placement, dst: Placement, meta: torch.Tensor, parts: int) -> float:
    try:
        return Move(src, dst, nbytes(meta), parts).price
    except TypeError:
        return INF                                               # nothing becomes partial


@functools.lru_cache(maxsize=4096)
def _view_atoms(in_shape: tuple, atoms: tuple, out_shape: tuple) -> tuple:
    # cached: every copy of a repeated layer has the same views (1 ms each at 70B sizes)
    return tuple(atoms_through_view(in_shape, atoms, out_shape))


class Propagator:
    """Placements for every node of ``gm`` split over ``parts`` ranks of ``axis``.
    ``gathers``: what a sort, top-k, scan or FFT along the split dim does, which gathers the
    whole value on every rank: None (nothing), ``"warn"`` or ``"error"`` (``strict=True``).
    ``attention``: how attention runs over the axis (``spdsl.propagate.attention_choice``).
    ``taken``: the axes decided before this one (dp before sp), whose whole-dim splits this
    one must not cut (:meth:`_clashes`); several axes walk together in
    ``spdsl.propagate.mesh_propagation``."""

    def __init__(self, gm: torch.fx.GraphModule, parts: int, axis: str,
                 gathers: str | None = None, attention=None,
                 taken: tuple[Propagator, ...] = ()) -> None:
        self.gm, self.parts, self.axis, self.gathers = gm, parts, axis, gathers
        self.attention = attention
        self.taken = tuple(taken)
        self.decisions: dict[torch.fx.Node, Decision] = {}
        self.pins: Mapping[torch.fx.Node, Placement | None] = {}
        self.constraints: dict[torch.fx.Node, tuple[Placement, torch.fx.Node]] = {}

    def placement(self, node: torch.fx.Node, index: int | None = None) -> Placement:
        p = self.decisions[node].output
        return p[index] if index is not None else p

    def run(self, inputs: Mapping[torch.fx.Node, tuple[Placement, str]],
            pins: Mapping[torch.fx.Node, Placement | None] | None = None) -> None:
        """Decide every node from ``inputs`` (placeholder -> placement and where it was said).
        ``pins``: ``spdsl.constraint`` node -> the placement it pins over this axis (absent
        or None: the constraint names no split over this axis, the value stays as it is)."""
        self.start(inputs, pins)
        for node in self.gm.graph.nodes:
            self.step(node)

    def start(self, inputs: Mapping[torch.fx.Node, tuple[Placement, str]],
              pins: Mapping[torch.fx.Node, Placement | None] | None = None) -> None:
        """What :meth:`run` reads before its walk; :meth:`step` then decides one node."""
        self.inputs, self.pins = inputs, pins or {}
        # the global sizes of the split input dims: the sequence (a tie-break, ``_along``)
        self.split_sizes = {int(n.meta["val"].shape[p.dim]) for n, (p, _) in inputs.items()
                            if isinstance(p, Shard) and isinstance(n.meta.get("val"), torch.Tensor)}
        # values a gradient flows through (from a parameter that requires one)
        self.with_grad: set[torch.fx.Node] = set()
        for node in self.gm.graph.nodes:
            if node.meta.get("spdsl_requires_grad") or (
                    node.op == "call_function" and
                    any(a in self.with_grad for a in node.all_input_nodes)):
                self.with_grad.add(node)

    def step(self, node: torch.fx.Node) -> None:
        """Decide ``node``, its inputs (and the ``taken`` axes' of them) decided."""
        if node.op == "placeholder":
            p, origin = self.inputs[node]
            self.decisions[node] = Decision(p, Strategy((), p, None, "input"), origin=origin)
            node.meta["spdsl_atoms"] = tuple((int(n),) for n in node.meta["val"].shape)
        elif node.op == "get_attr":
            self.decisions[node] = Decision(REPLICATE, Strategy((), REPLICATE, None,
                                                                "constant"), origin="constant")
        elif node.op == "call_function":
            self._call(node)

    def _current(self, a: torch.fx.Node) -> Placement:
        out = self.decisions[a].output
        return out if not isinstance(out, tuple) else REPLICATE

    def _call(self, node: torch.fx.Node) -> None:
        import operator
        if node.target is operator.getitem:
            src, i = node.args
            out = self.decisions[src].output
            p = out[i] if isinstance(out, tuple) else out
            self.decisions[node] = Decision(p, Strategy((), p, None, "getitem"), origin="getitem")
            return
        val = node.meta.get("val")
        ins = tensor_inputs(node)
        cur = [self._current(a) for a in ins]
        if not isinstance(val, (torch.Tensor, tuple, list)):
            self.decisions[node] = Decision(REPLICATE, Strategy((), REPLICATE, None, "scalar"))
            return
        if isinstance(val, torch.Tensor) and not all(isinstance(n, int) for n in val.shape):
            self._data_dependent(node, ins)
        if node.target is torch.ops.spdsl.constraint.default:
            self._constraint(node, ins[0])
        rule = _rules.lookup(node.target)
        if rule is None and not all(isinstance(p, Replicate) for p in cur):
            s = strategy_from_dtensor(node, ins, cur, self.parts)
            if s is None and getattr(node.target, "overloadpacket", None) in _ALONG_SEQUENCE:
                s = _along_without_dtensor(node, ins, cur, val)
            if s is not None:
                def rule(_ctx, _s=s):
                    return [_s]
        if rule is None:
            if all(isinstance(p, Replicate) for p in cur):
                out = REPLICATE if isinstance(val, torch.Tensor) else tuple(
                    REPLICATE for _ in val)
                self.decisions[node] = Decision(out, Strategy(tuple(cur), out, None, "replicated"),
                                                origin="replicated inputs")
                self._atoms(node, ins)
                return
            self._unknown(node, ins, cur)
        ctx = RuleCtx(node, ins, cur, self.parts, self.attention, self.pins.get(node))
        best, best_cost = None, INF
        candidates = list(rule(ctx))
        for s in candidates:
            if self._clashes(s, cur, ins):
                continue
            cost = s.extra_cost + sum(
                redistribute_cost(c, r, a.meta["val"], self.parts)
                for c, r, a in zip(cur, s.inputs, ins))
            if cost < best_cost or (cost == best_cost and best is not None and
                                    self._along(s) and not self._along(best) and
                                    not any(a in self.with_grad for a in ins)):
                best, best_cost = s, cost
        if best is None:
            raise ShardingError(
                rule=f"no strategy for {node.target}",
                value=", ".join(self.typed(a) for a in ins), where=where(node),
                detail="every way of running this op needs an unsupported redistribution",
                fix="add spdsl.with_sharding_constraint(x, P(...)) on its inputs to choose one")
        d = Decision(best.output, best, alternatives=len(candidates), cost=best_cost)
        for i, (c, r) in enumerate(zip(cur, best.inputs)):
            if c != r:
                d.redistribute[i] = (c, r)
                d.moves[i] = Move(c, r, nbytes(ins[i].meta["val"]), self.parts)
        d.fused = fused(d.moves)
        if self.gathers and d.moves and self.parts > 1:
            self._gathered_along(node, ins, d)
        split_out = any(not isinstance(o, Replicate) for o in
                        (best.output if isinstance(best.output, tuple) else (best.output,)))
        if split_out:
            # a replicated operand of a split computation gets a partial gradient
            d.grad_reduce = [i for i, r in enumerate(best.inputs) if isinstance(r, Replicate)
                             and ins[i].meta["val"].is_floating_point()]
        d.origin = best.rule
        self.decisions[node] = d
        d.issued = issued(self, node, best.lowering, ins)
        self._atoms(node, ins)

    def _along(self, s: Strategy) -> bool:
        """``s`` splits its output along a dim as long as a split input's (the sequence). Of
        equally cheap ways, that one: work on replicated values (a rotary table computed as
        ``inv_freq[:, None] @ positions[None, :]`` from ``arange``) may split any dim for free,
        and splitting the frequencies instead of the positions had the table gathered again
        before ``q * cos`` (Gemma 3, Cohere: an all-gather or two all-to-alls per table). Only
        where no gradient flows through the inputs (the engine's ``with_grad``): a split of
        replicated work on a parameter would make its gradient partial, one more all-reduce of
        the whole parameter (a learned position table: ``max_positions x D`` a step)."""
        out = s.output[0] if isinstance(s.output, tuple) and s.output else s.output
        return isinstance(out, Shard) and out.size in getattr(self, "split_sizes", ())

    def _clashes(self, s: Strategy, cur: list[Placement], ins: list[torch.fx.Node]) -> bool:
        """``s`` would move an input to a split of a whole dim that an axis decided before
        (``taken``: the batch over dp) already splits: this axis would cut the other's local
        piece, which neither the engine's sizes nor the lowering's local shapes describe.
        Such a strategy is not taken (another is, or the op is refused)."""
        for c, r, a in zip(cur, s.inputs, ins):
            if c == r or not isinstance(r, Shard) or r.outer != 1:
                continue
            for other in self.taken:
                d = other.decisions.get(a)
                t = d.output if d is not None else None
                if isinstance(t, Shard) and t.outer == 1 and t.dim == r.dim:
                    return True
        return False

    def _atoms(self, node: torch.fx.Node, ins: list[torch.fx.Node]) -> None:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return
        atoms = tuple((int(n),) for n in val.shape)
        if ins and isinstance(ins[0].meta.get("val"), torch.Tensor):
            src = ins[0].meta.get("spdsl_atoms")
            in_shape = ins[0].meta["val"].shape
            if src is not None:
                if node.target in _VIEWS:
                    atoms = _view_atoms(tuple(in_shape), src, tuple(val.shape))
                elif node.target in _SAME_SHAPE_ATOMS and tuple(in_shape) == tuple(val.shape):
                    atoms = src
                elif node.target is aten.transpose.int:
                    n = len(val.shape)
                    a, b = node.args[1] % n, node.args[2] % n
                    lst = list(src)
                    lst[a], lst[b] = lst[b], lst[a]
                    atoms = tuple(lst)
                elif node.target is aten.permute.default:
                    atoms = tuple(src[d % len(src)] for d in node.args[1])
                elif node.target is aten.expand.default:
                    extra = len(val.shape) - len(src)
                    atoms = tuple((int(n),) for n in val.shape[:extra]) + tuple(
                        s if math.prod(s) == val.shape[extra + i] else (int(val.shape[extra + i]),)
                        for i, s in enumerate(src))
        node.meta["spdsl_atoms"] = atoms

    def _constraint(self, node: torch.fx.Node, src: torch.fx.Node) -> None:
        target = self.pins.get(node)
        if target is None:          # the constraint names no split over this axis
            return
        prev = self.constraints.get(src)
        if prev is not None and prev[0] != target:
            raise ShardingError(
                rule="conflicting constraints", value=self.typed(src),
                where=f"{where(prev[1])} and {where(node)}",
                detail=f"one constraint asks for {prev[0]!r}, another for {target!r} on the "
                       "same value",
                fix="keep one with_sharding_constraint on this value, or constrain the values "
                    "computed from it instead")
        self.constraints[src] = (target, node)

    def _data_dependent(self, node, ins) -> None:
        raise ShardingError(
            rule="data-dependent shape",
            value=", ".join(self.typed(a) for a in ins), where=where(node),
            detail=f"{node.target} makes a tensor whose shape depends on the data (boolean "
                   "mask indexing, nonzero, masked_select); placements are planned at global "
                   "shapes, before any data is seen",
            fix="keep shapes fixed: torch.where(mask, x, 0) or x.masked_fill(~mask, 0) "
                "instead of x[mask], then reduce")

    def _gathered_along(self, node, ins, d: Decision) -> None:
        """A sort/top-k/scan/FFT whose input is gathered: it runs along the split dim. Integer
        bookkeeping (document ids from position ids, say) is left alone: it is small, and
        Hugging Face's packed-sequence check scans position ids on purpose."""
        move = d.moves.get(0)
        packet = getattr(node.target, "overloadpacket", None)
        if packet not in _ALONG_SEQUENCE or move is None or not isinstance(
                move.src, Shard) or not isinstance(move.dst, Replicate):
            return
        if not (ins[0].meta["val"].is_floating_point() or ins[0].meta["val"].is_complex()):
            return
        err = ShardingError(
            rule="sequence gathered", value=self.typed(ins[0]), where=where(node),
            detail=f"{node.target} runs along the split dim {move.src.dim}: every rank "
                   "gathers the whole sequence and runs it whole",
            fix="run it along another dim, or gather on purpose with "
                "spdsl.with_sharding_constraint(x, P()) before it (strict=False warns instead)")
        if self.gathers == "error":
            raise err
        # reported at the user's line, which the warning's own location would not be
        path, _, line = source_of(node).rpartition(":")
        mod = module_of(node)
        warnings.warn_explicit(
            f"spdsl: {node.target} on {err.value}{f' in {mod}' if mod else ''} gathers the "
            f"whole sequence on every rank (dim {move.src.dim} is split over {self.axis!r}); "
            "strict=True makes this an error", UserWarning, path or "spdsl",
            int(line) if line.isdigit() else 0)

    def _unknown(self, node, ins, cur) -> None:
        op = node.target
        name = getattr(getattr(op, "overloadpacket", None), "__name__", "")
        if name.endswith("_") and not name.endswith("__"):
            raise ShardingError(
                rule="in-place write to a traced value",
                value=", ".join(self.typed(a) for a in ins), where=where(node),
                detail=f"{op} writes into a value split over {self.axis!r}; each rank holds "
                       "a piece of it, so a write through an index or slice of the whole "
                       "cannot be planned",
                fix="write it out of place: y = x.masked_fill(mask, v) or "
                    "y = torch.where(mask, v, x) instead of x[mask] = v, x[:, :n] = v or "
                    "x.fill_(v)")
        raise ShardingError(
            rule="unknown op",
            value=", ".join(self.typed(a) for a in ins), where=where(node),
            detail=f"spdsl has no propagation rule for {op}, and an input is split over "
                   f"{self.axis!r}",
            fix=f"teach it with spdsl.register_rule({op}, rule) (see spdsl.register_rule), or "
                "gather the input first with spdsl.with_sharding_constraint(x, P())")

    def typed(self, node: torch.fx.Node, index: int | None = None) -> str:
        val = node.meta.get("val")
        p = self.decisions[node].output if node in self.decisions else REPLICATE
        if isinstance(val, (tuple, list)):
            val = val[index or 0]
            p = p[index or 0] if isinstance(p, tuple) else p
        if isinstance(p, tuple):
            p = p[0]
        return typed_shape(tuple(val.shape), val.dtype, p, self.axis)

