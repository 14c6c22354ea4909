"""The propagated plan: every value's placement and every collective, with where it came from.

Built from the propagation decisions alone (fake tensors, no process group), so a model too
large for this machine can be planned here.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

import torch

from spdsl.collectives import window_plan
from spdsl.propagate.engine import Propagator, nbytes, tensor_inputs
from spdsl.propagate.placement import Partial, Replicate, Shard, chunk_bounds, typed_shape
from spdsl.propagate.source import module_of, source_of


@dataclass(frozen=True)
class Collective:
    """One collective per rank per step: ``bytes`` is the local buffer it moves in forward,
    ``bytes_bwd`` in backward (0: none there)."""

    kind: str            # all_to_all | all_reduce | all_gather | reduce_scatter | halo_exchange
    axis: str
    bytes: int
    bytes_bwd: int
    purpose: str         # ulysses | loss | gradient | reshard | halo | output
    values: tuple[str, ...]
    source: str
    module: str
    node: str


@dataclass(frozen=True)
class Value:
    name: str
    op: str
    typed: str
    placement: str
    source: str
    module: str
    origin: str


@dataclass
class ShardingPlan:
    """Placements and collectives of one traced function on one mesh axis.

    Example::

        plan = spdsl.plan(spdsl.sp_shard(seq=4)(model), ids, labels)
        print(plan)                       # per-module table
        [c.kind for c in plan.collectives]
    """

    axis: str
    parts: int
    values: list[Value] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)

    @property
    def bytes_fwd(self) -> int:
        return sum(c.bytes for c in self.collectives)

    @property
    def bytes_bwd(self) -> int:
        return sum(c.bytes_bwd for c in self.collectives)

    def to_json(self) -> str:
        return json.dumps({"axis": self.axis, "parts": self.parts,
                           "values": [asdict(v) for v in self.values],
                           "collectives": [asdict(c) for c in self.collectives]}, indent=1)

    def __str__(self) -> str:
        return render(self)


def _needs_grad(prop: Propagator, requires: dict[torch.fx.Node, bool]) -> dict:
    out = dict(requires)
    for node in prop.gm.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        floating = any(isinstance(v, torch.Tensor) and v.is_floating_point()
                       for v in (val if isinstance(val, (tuple, list)) else (val,)))
        out[node] = floating and any(out.get(a, False) for a in node.all_input_nodes)
    return out


def build_plan(prop: Propagator, requires: dict[torch.fx.Node, bool],
               out_placements: list) -> ShardingPlan:
    P, axis = prop.parts, prop.axis
    grad = _needs_grad(prop, requires)
    plan = ShardingPlan(axis, P)
    marked = set()

    def add(kind, b, b_bwd, purpose, node, metas):
        if P == 1 or (b == 0 and b_bwd == 0):
            return
        plan.collectives.append(Collective(kind, axis, int(b), int(b_bwd), purpose,
                                           tuple(metas), source_of(node), module_of(node),
                                           node.name))

    for node in prop.gm.graph.nodes:
        if node.op not in ("call_function", "placeholder"):
            continue
        d = prop.decisions.get(node)
        if d is None:
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            plan.values.append(Value(node.name, str(node.target) if node.op != "placeholder"
                                     else "input", prop.typed(node), repr(d.output),
                                     source_of(node), module_of(node), d.origin))
        if node.op == "placeholder":
            continue
        ins = tensor_inputs(node)
        fused = [(i, ins[i]) for i, (src, dst) in d.redistribute.items()
                 if isinstance(src, Shard) and isinstance(dst, Shard) and src != dst]
        if len(fused) > 1:
            b = sum(nbytes(a.meta["val"]) // P for _, a in fused)
            g = any(grad.get(a, False) for _, a in fused)
            add("all_to_all", b, b if g else 0, "ulysses", node, [prop.typed(a) for _, a in fused])
        fused_idx = {i for i, _ in fused} if len(fused) > 1 else set()
        for i, (src, dst) in d.redistribute.items():
            if i in fused_idx:
                continue
            a = ins[i]
            meta = a.meta["val"]
            local = nbytes(meta) // P
            typed = prop.typed(a)
            g = grad.get(a, False)
            if isinstance(src, Partial):
                add("all_reduce", nbytes(meta), 0, "reshard", node, [typed])
            elif isinstance(src, Replicate) and isinstance(dst, Shard):
                add("all_gather", 0, local if g else 0, "reshard", node, [typed])
            elif isinstance(src, Shard) and isinstance(dst, Replicate):
                add("all_gather", local, 0, "reshard", node, [typed])
            elif isinstance(src, Shard) and isinstance(dst, Shard):
                purpose = "ulysses" if src.dim != dst.dim or src.outer != dst.outer else "reshard"
                add("all_to_all", local, local if g else 0, purpose, node, [typed])
        for i in d.grad_reduce:
            a = ins[i]
            key = (node, i) if i in d.redistribute else a
            if key not in marked and grad.get(a, False):
                marked.add(key)
                add("all_reduce", 0, nbytes(a.meta["val"]), "gradient", node, [prop.typed(a)])
        low = d.strategy.lowering
        if low == "ulysses":
            q, k, v = (ins[j].meta["val"] for j in range(3))
            rep = max(1, P // k.shape[1])
            kv = (nbytes(k) + nbytes(v)) * rep
            g = grad.get(node, False)
            qkv = (nbytes(q) + kv) // P
            add("all_to_all", qkv, qkv if g else 0, "ulysses", node,
                [prop.typed(ins[j]) for j in range(3)])
            o = nbytes(val) // P
            add("all_to_all", o, o if g else 0, "ulysses", node, [prop.typed(node)])
        elif low == "nll_mean":
            add("all_reduce", 2 * ins[0].meta["val"].element_size(), 0, "loss", node,
                [typed_shape((2,), ins[0].meta["val"].dtype, Partial(), axis)])
        elif low == "slice_window":
            a = ins[0].meta["val"]
            dim = node.args[1] % a.dim()
            start = node.args[2] or 0
            wp = window_plan(a.shape[dim], start, val.shape[dim], P)
            if wp is not None:
                row = nbytes(a) // a.shape[dim]
                own, sends = wp
                sent = max(sum(max(0, b - lo) for q, (lo, b) in enumerate(sends[r]) if q != r)
                           for r in range(P))
                add("halo_exchange", sent * row, sent * row if grad.get(node) else 0, "halo",
                    node, [prop.typed(ins[0])])
    out_node = next(n for n in prop.gm.graph.nodes if n.op == "output")
    for o, want in zip(out_node.args[0], out_placements):
        if isinstance(o, torch.fx.Node) and isinstance(o.meta.get("val"), torch.Tensor):
            have = prop.placement(o)
            if isinstance(have, Partial):
                add("all_reduce", nbytes(o.meta["val"]), 0, "loss" if o.meta["val"].dim() == 0
                    else "output", o, [prop.typed(o)])
            elif have != want and isinstance(have, Shard):
                add("all_gather", nbytes(o.meta["val"]) // P, 0, "output", o, [prop.typed(o)])
    return plan


_LAYER = re.compile(r"^(.*?\.)(\d+)(\..*|)$")


def render(plan: ShardingPlan) -> str:
    """A compact table: one block per module, identical numbered layers folded."""
    groups: OrderedDict[str, list[Collective]] = OrderedDict()
    for c in plan.collectives:
        groups.setdefault(c.module or "<top>", []).append(c)
    folded: OrderedDict[str, tuple[list[Collective], list[str]]] = OrderedDict()
    for mod, cs in groups.items():
        m = _LAYER.match(mod)
        key = (m.group(1) + "{}" + m.group(3)) if m else mod
        sig = tuple((c.kind, c.bytes, c.bytes_bwd, c.purpose) for c in cs)
        fk = f"{key}|{sig}"
        if fk in folded:
            folded[fk][1].append(m.group(2) if m else "")
        else:
            folded[fk] = (cs, [m.group(2)] if m else [""])
    lines = [f"ShardingPlan(axis={plan.axis!r}, size={plan.parts}): "
             f"{len(plan.values)} values, {len(plan.collectives)} collectives, "
             f"{_fmt(plan.bytes_fwd)} fwd + {_fmt(plan.bytes_bwd)} bwd per rank per step"]
    lines.append(f"  {'module':34} {'kind':14} {'purpose':9} {'fwd':>10} {'bwd':>10}  values")
    for fk, (cs, idx) in folded.items():
        key = fk.split("|")[0]
        name = key.format(_span(idx)) if "{}" in key else key
        if len(idx) > 1:
            name += f" (x{len(idx)})"
        for c in cs:
            lines.append(f"  {name[:34]:34} {c.kind:14} {c.purpose:9} {_fmt(c.bytes):>10} "
                         f"{_fmt(c.bytes_bwd):>10}  {', '.join(c.values)[:70]}")
            name = ""
    return "\n".join(lines)


def _span(idx: list[str]) -> str:
    nums = sorted(int(i) for i in idx)
    return f"{nums[0]}-{nums[-1]}" if len(nums) > 1 else str(nums[0])


def _fmt(b: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if b < 1024 or unit == "TiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return str(b)


_ = chunk_bounds
