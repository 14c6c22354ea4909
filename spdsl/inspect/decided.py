"""A plan's records collected from propagation's decisions (fake tensors, no process group):
every value with its placement and why, each attention site with its Ulysses floor, and the
collectives the decisions imply (bytes per rank, forward and backward). It reads the decision
record (``spdsl.propagate.engine.Decision`` and its ``Move``s) and never writes to it.

The collectives of a plan ``spdsl.plan`` returns are read off the rank's final local program
instead (``spdsl.inspect.program``); the list collected here is the plan's ``decided``, which
stands in where that program cannot be built.

Example::

    plan = plan_of(step.build((ids, ids), {}).decisions)     # or build_plan(prop, ...)
    [v.typed for v in plan.values]
"""

from __future__ import annotations

import operator

import torch

from spdsl._torch import OpOverload
from spdsl.inspect.plan import Attention, Collective, ShardingPlan, Value
from spdsl.propagate.engine import Decision, Propagator, gradient_reaches, nbytes, tensor_inputs
from spdsl.propagate.forms import form_of, is_attention_node
from spdsl.propagate.heads import kv_repeat
from spdsl.propagate.masks import MASK
from spdsl.propagate.moves import Move
from spdsl.propagate.placement import Partial, Replicate, Shard, typed_shape
from spdsl.propagate.rules.attention import CHOICE
from spdsl.propagate.source import module_of, source_of


def _needs_grad(prop: Propagator, requires: dict[torch.fx.Node, bool]) -> dict:
    """Values with a gradient in backward: computed from one that requires it, and with a
    gradient coming back to them (``gradient_reaches``)."""
    out = dict(requires)
    live = gradient_reaches(prop.gm.graph)
    for node in prop.gm.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        floating = any(isinstance(v, torch.Tensor) and v.is_floating_point()
                       for v in (val if isinstance(val, (tuple, list)) else (val,)))
        # no gradient flows through detach(): a parameter read only so keeps none
        out[node] = floating and node.target is not torch.ops.aten.detach.default and \
            any(out.get(a, False) for a in node.all_input_nodes)
    return {n: g and n in live for n, g in out.items()}


def _op_name(node: torch.fx.Node) -> str:
    if node.op == "placeholder":
        return "input"
    return getattr(node.target, "__name__", "") if not isinstance(
        node.target, OpOverload) else str(node.target)


def _via(prop: Propagator, node: torch.fx.Node, d: Decision, ins: list[torch.fx.Node]) -> str:
    """The input whose placement decided this node's: the first one its rule needs split or
    partial (preferring one that arrives so); else, for a replicated result, an input that had
    to be gathered or reduced, else the first computed (not parameter) input."""
    if not ins:
        src = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        return src.name if src is not None and node.op == "call_function" else ""
    split_moved = ""
    for i, a in enumerate(ins):
        req = d.strategy.inputs[i] if i < len(d.strategy.inputs) else Replicate()
        if isinstance(req, Replicate):
            continue
        if i not in d.redistribute:
            return a.name
        split_moved = split_moved or a.name
    if split_moved:
        return split_moved
    if d.redistribute:
        return ins[min(d.redistribute)].name
    computed = [a for a in ins if a.op == "call_function"]
    return computed[0].name if computed else ""


def _typed(prop: Propagator, node: torch.fx.Node, d: Decision) -> tuple[str, str]:
    val = node.meta["val"]
    if isinstance(val, torch.Tensor):
        return prop.typed(node), repr(d.output)
    outs = d.output if isinstance(d.output, tuple) else (d.output,) * len(val)
    typed = [typed_shape(tuple(x.shape), x.dtype, p, prop.axis) if isinstance(x, torch.Tensor)
             else type(x).__name__ for x, p in zip(val, outs)]
    return f"({', '.join(typed)})", f"({', '.join(map(repr, outs))})"


def _value(prop: Propagator, node: torch.fx.Node, d: Decision) -> Value:
    ins = tensor_inputs(node) if node.op == "call_function" else []
    moves = tuple((ins[i].name, repr(s), repr(t)) for i, (s, t) in sorted(d.redistribute.items()))
    via = _via(prop, node, d, ins)
    origin = d.origin
    if node.target is operator.getitem and node.args[0] in prop.decisions:
        origin = prop.decisions[node.args[0]].origin     # an element gets its op's rule
    module = module_of(node)
    if node.op == "placeholder" and origin.startswith("parameter "):
        module = origin.removeprefix("parameter ").rpartition(".")[0]   # its owner
    typed, placement = _typed(prop, node, d)
    return Value(node.name, _op_name(node), typed, placement, source_of(node), module, origin,
                 tuple(a.name for a in ins) or ((via,) if via else ()), via, moves,
                 d.alternatives)


def _attention(node: torch.fx.Node, prop: Propagator, ins: list) -> Attention | None:
    P = prop.parts
    if P == 1:
        return None
    flex = node.target is torch.ops.higher_order.flex_attention
    fn = node.target is torch.ops.spdsl.attention_fn.default
    if is_attention_node(node) and len(ins) >= 3:
        q, k, v = (ins[j].meta["val"] for j in range(3))
        if q.dim() != 4:
            return None
        out = node.meta["val"][0] if flex else node.meta["val"]
        rep = kv_repeat(q.shape[1], k.shape[1], P)    # kv heads repeated up to the degree
        floor = (nbytes(q) + (nbytes(k) + nbytes(v)) * rep + nbytes(out)) / P
        choice = node.meta.get(CHOICE)
        runs, why = ("ulysses", "") if choice is None else (choice.label, _why(choice))
        return Attention(node.name, form_of(node).name, module_of(node), source_of(node),
                         int(floor), _mask_words(node, ins, fn, flex), runs, why)
    if node.target is torch.ops.aten.bmm.default and len(ins) == 2:
        a, b = (prop.placement(x) if not isinstance(prop.decisions[x].output, tuple)
                else None for x in ins)
        if isinstance(a, Shard) and a.dim == 1 and isinstance(b, Shard) and b.dim == 2:
            q, k = ins[0].meta["val"], ins[1].meta["val"]
            return Attention(node.name, "eager", module_of(node), source_of(node),
                             int(2 * (nbytes(q) + nbytes(k)) / P))
    return None


def _why(choice) -> str:
    costs = ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in choice.costs.items())
    return f"{choice.why}" + (f"; cost model, one layer's attention per step: {costs}"
                              if len(choice.costs) > 1 else "")


def _mask_words(node: torch.fx.Node, ins: list, fn: bool, flex: bool) -> str:
    if fn:
        return node.meta.get(MASK, "function")
    if flex:
        return "BlockMask"
    if len(ins) > 3:
        m = ins[3].meta["val"]
        return f"dense tensor {typed_shape(m.shape, m.dtype, Replicate())} ({nbytes(m):,} B on every rank)"
    return "causal" if len(node.args) > 5 and node.args[5] else "none"


def plan_of(decisions) -> ShardingPlan:
    """The plan of one call's ``decisions`` (``spdsl.pipeline.Decisions``): the sequence
    axis' records, with the data axis' and the sharded parameters' collectives where there
    are any (``spdsl.inspect.mesh_plan``)."""
    d = decisions
    phs = [n for n in d.traced.graph.graph.nodes if n.op == "placeholder"]
    plan = build_plan(d.prop, d.requires, list(d.out_placements), frozenset(
        phs[s.index].name for s in d.sharded if d.reduced.get(s.index)))
    if d.data is None and not d.sharded:
        return plan
    from spdsl.inspect.mesh_plan import with_mesh_collectives
    return with_mesh_collectives(plan, d.traced.graph, d.data, d.requires, list(d.data_out),
                                 list(d.sharded), dict(d.reduced), d.regathered)


def build_plan(prop: Propagator, requires: dict[torch.fx.Node, bool],
               out_placements: list, state_reduced: frozenset = frozenset()) -> ShardingPlan:
    """Collect values, collectives (bytes per rank, forward and backward) and attention
    floors from propagation decisions. ``state_reduced``: names of sharded parameters whose
    gradients are reduce-scattered instead (``spdsl.inspect.mesh_plan``)."""
    P, axis = prop.parts, prop.axis
    grad = _needs_grad(prop, requires)
    values: list[Value] = []
    collectives: list[Collective] = []
    attention: list[Attention] = []
    marked = set()

    def add(kind, b, b_bwd, purpose, node, metas):
        if P == 1 or (b == 0 and b_bwd == 0):
            return
        collectives.append(Collective(kind, axis, int(b), int(b_bwd), purpose, tuple(metas),
                                      source_of(node), module_of(node), node.name))

    for node in prop.gm.graph.nodes:
        if node.op not in ("call_function", "placeholder"):
            continue
        d = prop.decisions.get(node)
        if d is None:
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) or isinstance(val, (tuple, list)) and any(
                isinstance(x, torch.Tensor) for x in val):
            values.append(_value(prop, node, d))
        if node.op == "placeholder":
            # a global input split on entry: its (whole) gradient is gathered in backward
            if isinstance(d.output, Shard) and grad.get(node, False) and \
                    not d.origin.startswith(("parameter ", "DTensor")):
                add("all_gather", 0, nbytes(val) // P, "input", node, [prop.typed(node)])
            continue
        ins = tensor_inputs(node)
        site = _attention(node, prop, ins)
        if site is not None:
            attention.append(site)
        if d.fused:
            b = sum(d.moves[i].local for i in d.fused)
            g = any(grad.get(ins[i], False) for i in d.fused)
            add("all_to_all", b, b if g else 0, "ulysses", node,
                [prop.typed(ins[i]) for i in d.fused])
        for i, m in d.moves.items():
            if i in d.fused:
                continue
            purpose = "ulysses" if m.kind == "all_to_all" and (
                m.src.dim != m.dst.dim or m.src.outer != m.dst.outer) else "reshard"
            for kind, b, b_bwd in m.collectives(grad.get(ins[i], False)):
                add(kind, b, b_bwd, purpose, node, [prop.typed(ins[i])])
        for i in d.grad_reduce:
            a = ins[i]
            # one reduction per parameter however often it is read (a tied embedding's
            # weight and its transpose): the lowering folds them into one bucket entry
            key = (node, i) if i in d.redistribute else _root(a)
            if key not in marked and grad.get(a, False) and \
                    _root(a).name not in state_reduced:
                marked.add(key)
                add("all_reduce", 0, nbytes(a.meta["val"]), "gradient", node, [prop.typed(a)])
        for c in d.issued:
            for kind, b, b_bwd in c.collectives(grad.get(node, False)):
                add(kind, b, b_bwd, c.purpose, node, list(c.values))
    outputs = _output_collectives(prop, out_placements, add, grad)
    return ShardingPlan(axis, P, tuple(values), tuple(collectives), outputs, tuple(attention))


def _root(a: torch.fx.Node) -> torch.fx.Node:
    """The graph input a one-input chain (``t(w)``, a cast) starts from, else ``a``."""
    b = a
    while b.op == "call_function" and len(b.all_input_nodes) == 1:
        b = b.all_input_nodes[0]
    return b if b.op == "placeholder" else a


def _output_collectives(prop: Propagator, out_placements: list, add, grad: dict
                        ) -> tuple[tuple[str, str], ...]:
    """Each output and the placement it is returned in; what its redistribution to its
    out_spec runs goes to ``add``: the same ``Move`` the lowering executes
    (``Lowering._output`` -> ``_move``)."""
    out_node = next(n for n in prop.gm.graph.nodes if n.op == "output")
    outputs = []
    for o, want in zip(out_node.args[0], out_placements):
        if isinstance(o, torch.fx.Node) and isinstance(o.meta.get("val"), torch.Tensor):
            have, val = prop.placement(o), o.meta["val"]
            outputs.append((o.name, repr(want)))
            purpose = "loss" if isinstance(have, Partial) and val.dim() == 0 else "output"
            for kind, b, b_bwd in Move(have, want, nbytes(val), prop.parts).collectives(
                    grad.get(o, False)):
                add(kind, b, b_bwd, purpose, o, [prop.typed(o)])
    return tuple(outputs)
