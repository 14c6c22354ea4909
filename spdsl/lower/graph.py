"""Lowering: the global graph and its decisions -> one rank's graph over local tensors.

This is the one place where global shapes become local ones: shape arguments of views are
rewritten to the rank's local shape, redistributions become calls into ``spdsl.collectives``,
and nodes with a named lowering become calls into ``spdsl.lower.ops``. Backward is autograd's
job: every inserted call carries its own gradient rule.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch

import spdsl.collectives as C
from spdsl._torch import make_graph_module, tree_map
from spdsl.lower import mixers, ops, ring, tokenwise
from spdsl.lower.factories import VAL as REPLICATED_VAL
from spdsl.lower.factories import split_factories
from spdsl.lower.grad_buckets import bucket_gradient_reduces, move_markers_to_inputs
from spdsl.lower.local import bounds, data_shape, local_shape, sequence_inside
from spdsl.propagate.attention_nodes import COMPUTE_DTYPE, OUT_DTYPE
from spdsl.propagate.engine import Propagator, gradient_reaches, tensor_inputs
from spdsl.propagate.forms import FORM, form_of
from spdsl.propagate.issued import slice_window
from spdsl.propagate.lowerings import AT_ONE_RANK, DATA_SHARED
from spdsl.propagate.lowerings import Lowering as L
from spdsl.propagate.moves import kind_of
from spdsl.propagate.placement import (
    REPLICATE,
    Partial,
    Placement,
    Replicate,
    Shard,
)
from spdsl.propagate.rules.attention import CHOICE

aten = torch.ops.aten

# special lowerings that mean the same thing whichever axis asked for them (a sum over the
# tokens of both axes is one sum)
_SHARED = DATA_SHARED


@dataclass
class DataAxis:
    """The second mesh axis: the batch split over data-parallel groups (``dp``). Its own
    propagation (the same rules over the same graph) says where the batch rows meet: partial
    sums over it are reduced over ``group``, together with the sequence axis' (``joint``, the
    group of both) where both ask at the same point."""

    prop: Propagator
    rank: int
    group: str
    joint: str

    @property
    def parts(self) -> int:
        return self.prop.parts


class Lowering:
    def __init__(self, prop: Propagator, rank: int, group: str,
                 data: DataAxis | None = None, state=None, factor=None) -> None:
        self.prop, self.parts, self.rank, self.group = prop, prop.parts, rank, group
        self.factor = factor        # Ulysses degree U -> the axis' (Ulysses x ring) groups
        self.data = data if data is not None and data.parts > 1 else None
        self.state = state          # a pass over the local graph (spdsl.lower.param_gather)
        self.graph = torch.fx.Graph()
        self.env: dict[torch.fx.Node, torch.fx.Node] = {}
        self.marked: dict[tuple, torch.fx.Node] = {}
        # values no gradient comes back to: moved detached, their collectives have no backward
        self.live = gradient_reaches(prop.gm.graph)

    def call(self, fn, *args) -> torch.fx.Node:
        return self.graph.call_function(fn, tuple(args))

    # -- shapes: the data axis splits first (the batch), the sequence axis inside it --------
    def _dp(self, node: torch.fx.Node, index: int | None = None) -> Placement:
        if self.data is None or node not in self.data.prop.decisions:
            return Replicate()
        out = self.data.prop.decisions[node].output
        if isinstance(out, tuple):
            return out[index or 0] if index is not None else Replicate()
        return out

    def _dp_shape(self, shape, dp: Placement) -> list[int]:
        D = self.data
        return data_shape(shape, dp, D.parts, D.rank) if D is not None else list(shape)

    def _sp_in(self, p: Placement, dp: Placement, node: torch.fx.Node | None = None) -> Placement:
        return sequence_inside(p, dp, self.data.parts if self.data is not None else 1, node)

    def local_shape_of(self, node: torch.fx.Node, sp: Placement, dp: Placement,
                       shape=None) -> list[int]:
        shape = node.meta["val"].shape if shape is None else shape
        D = self.data
        return local_shape(shape, sp, self.parts, self.rank, dp, D.parts if D else 1,
                           D.rank if D else 0, node)

    def redistribute(self, x: torch.fx.Node, src: Placement, dst: Placement,
                     meta: torch.Tensor, dp: Placement = REPLICATE,
                     node: torch.fx.Node | None = None) -> torch.fx.Node:
        """``src -> dst`` over the sequence axis of a value whose data-axis placement is
        ``dp``."""
        if src == dst or self.parts == 1:
            return x
        P, r, g = self.parts, self.rank, self.group
        shape = tuple(self._dp_shape(meta.shape, dp))
        src, dst = self._sp_in(src, dp, node), self._sp_in(dst, dp, node)
        return self._move(x, src, dst, shape, P, r, g)

    def _move(self, x: torch.fx.Node, src: Placement, dst: Placement, shape,
              parts: int, rank: int, group: str) -> torch.fx.Node:
        """One redistribution over one axis, of a local tensor of ``shape``: the collective
        ``spdsl.propagate.moves.kind_of`` names (the one the plan lists)."""
        kind, shape = kind_of(src, dst), tuple(shape)
        if kind == "none":
            return x
        if kind == "all_reduce":
            return self.call(C.all_reduce, x, group)
        if kind == "reduce_scatter":
            return self.call(C.reduce_scatter, x, (dst.dim, dst.outer, dst.size,
                                                   dst.inner(shape)), parts, rank, group)
        if kind == "take":
            return self.call(C.take, x, (dst.dim, dst.outer, dst.size, dst.inner(shape)), parts,
                             rank, group)
        if kind == "all_gather":
            return self.call(C.gather, x, (src.dim, src.outer, src.size, src.inner(shape)),
                             parts, rank, group)
        if src.dim == dst.dim:
            # one dim split two ways ([heads*seq] split inside vs as a whole): the packing
            # of all_to_all assumes two dims, one gathered and one split
            return self.call(C.rechunk, x, src.dim, (src.outer, src.size, src.inner(shape)),
                             (dst.outer, dst.size, dst.inner(shape)), parts, rank, group)
        return self.call(C.all_to_all, x, (src.dim, src.outer), (dst.dim, dst.outer), parts,
                         group)

    def _move_data(self, x, a: torch.fx.Node, move, sp_move, sp_now: Placement):
        """The data-axis redistribution of input ``a``; returns the new local value and
        whether a sequence-axis partial sum was reduced with it (one joint all-reduce)."""
        src, dst = move
        joint = isinstance(src, Partial) and sp_move is not None and \
            isinstance(sp_move[0], Partial)
        if joint:
            x = self.call(C.all_reduce, x, self.data.joint)
            src = Replicate()
            if src == dst:
                return x, True
        for q in (src, dst):
            if isinstance(q, Shard) and isinstance(sp_now, Shard) and q.dim == sp_now.dim \
                    and self.parts > 1:
                from spdsl.errors import ShardingError
                from spdsl.propagate.source import where
                raise ShardingError(
                    rule="data and sequence axes", where=where(a),
                    value=f"{sp_now!r} over sp, {src!r} -> {dst!r} over dp",
                    detail="the batch split would change on a dim the sequence axis splits",
                    fix="keep the batch split from the inputs on (pass batch tensors with "
                        "their batch dim split over dp)")
        # the data axis splits the outer factor: read shapes as the sequence axis leaves them
        shape = local_shape(a.meta["val"].shape, sp_now, self.parts, self.rank)
        D = self.data
        return self._move(x, src, dst, shape, D.parts, D.rank, D.group), joint

    def _grad_group(self, d, dd, i: int) -> str | None:
        sp = i in d.grad_reduce and self.parts > 1
        dp = dd is not None and i in dd.grad_reduce
        if sp and dp:
            return self.data.joint
        return self.group if sp else self.data.group if dp else None

    def _inputs(self, node: torch.fx.Node) -> dict[int, torch.fx.Node]:
        d = self.prop.decisions[node]
        dd = self.data.prop.decisions.get(node) if self.data is not None else None
        ins = tensor_inputs(node)
        moved, reduced = {}, set()
        for i, a in enumerate(ins):        # the data axis first
            x = self.env[a]
            floating = a.meta["val"].is_floating_point() or a.meta["val"].is_complex()
            if floating and a not in self.live and (i in d.redistribute or dd is not None and
                                                    i in dd.redistribute):
                x = self.call(aten.detach.default, x)
                x.meta["spdsl_origin"] = a.name          # what the plan names it by
            if dd is not None and i in dd.redistribute:
                sp_now = self.prop.decisions[a].output if a in self.prop.decisions else \
                    Replicate()
                sp_now = sp_now if not isinstance(sp_now, tuple) else Replicate()
                x, joint = self._move_data(x, a, dd.redistribute[i], d.redistribute.get(i),
                                           sp_now)
                if joint:
                    reduced.add(i)
            moved[i] = x
        fused = self._fused_all_to_all(d, ins, moved)
        out = {}
        for i, a in enumerate(ins):
            x = moved[i]
            dp = dd.strategy.inputs[i] if dd is not None and i < len(dd.strategy.inputs) \
                else self._dp(a)
            touched = i in fused or i in d.redistribute or x is not self.env[a]
            if i in fused:
                x = fused[i]
            elif i in d.redistribute:
                src, dst = d.redistribute[i]
                x = self.redistribute(x, Replicate() if i in reduced else src, dst,
                                      a.meta["val"], dp, node)
            group = self._grad_group(d, dd, i)
            if group is not None:
                if touched:
                    x = self.call(C.grad_all_reduce, x, group)
                else:                 # one gradient all-reduce per replicated value and group
                    key = (a, group)
                    if key not in self.marked:
                        self.marked[key] = self.call(C.grad_all_reduce, self.env[a], group)
                    x = self.marked[key]
            out[i] = x
        return out

    def _fused_all_to_all(self, d, ins, moved) -> dict[int, torch.fx.Node]:
        """Several operands of one op changing split dims (q and k of a score) share one
        all-to-all."""
        if not d.fused or self.parts == 1:
            return {}
        idx = list(d.fused)
        moves = {i: d.redistribute[i] for i in idx}
        xs = [moved[i] for i in idx]
        dps = [self._dp(ins[i]) for i in idx]
        srcs = [(self._sp_in(moves[i][0], p).dim, self._sp_in(moves[i][0], p).outer)
                for i, p in zip(idx, dps)]
        dsts = [(self._sp_in(moves[i][1], p).dim, self._sp_in(moves[i][1], p).outer)
                for i, p in zip(idx, dps)]
        many = self.call(C.all_to_all_many, xs, srcs, dsts, self.parts, self.group)
        return {i: self.call(operator.getitem, many, k) for k, i in enumerate(idx)}

    def _args(self, node: torch.fx.Node, local: dict[int, torch.fx.Node]):
        counter = iter(range(10 ** 9))

        def sub(a: Any) -> Any:
            if isinstance(a, torch.fx.Node):
                if isinstance(a.meta.get("val"), torch.Tensor):
                    return local[next(counter)]
                return self.env[a]
            return a
        return tree_map(sub, node.args), tree_map(sub, node.kwargs)

    def lower(self, out_placements: list[Placement],
              data_out: list[Placement] | None = None) -> torch.fx.GraphModule:
        for node in self.prop.gm.graph.nodes:
            if node.op == "placeholder":
                self.env[node] = self.graph.placeholder(node.name)
                val = node.meta.get("val")
                if isinstance(val, torch.Tensor):   # what this rank is passed
                    shape = self.local_shape_of(node, self.prop.placement(node), self._dp(node))
                    self.env[node].meta["spdsl_local"] = (tuple(shape), val.dtype)
                self.env[node].meta["spdsl_requires_grad"] = node.meta.get("spdsl_requires_grad")
                self._note_replicated(node)
            elif node.op == "get_attr":
                self.env[node] = self.graph.get_attr(node.target)
            elif node.op == "call_function":
                tail = next(iter(reversed(self.graph.nodes)), None)
                self.env[node] = self._node(node)
                self._note_replicated(node)
                for new in reversed(self.graph.nodes):   # the nodes just added, newest first
                    if new is tail:
                        break        # module path and source travel to the local nodes
                    new.meta.setdefault("spdsl_module", node.meta.get("spdsl_module", ""))
                    new.meta.setdefault("stack_trace", node.meta.get("stack_trace"))
                    new.meta.setdefault("spdsl_origin", node.name)
            elif node.op == "output":
                outs = []
                data_out = data_out or [Replicate()] * len(out_placements)
                for o, want, dwant in zip(node.args[0], out_placements, data_out):
                    x = self.env[o]
                    if isinstance(o.meta.get("val"), torch.Tensor):
                        x = self._output(o, x, want, dwant)
                    outs.append(x)
                self.graph.output(outs)
        if self.parts > 1 or self.data is not None:
            split_factories(self.graph, self.parts, self.rank)
        move_markers_to_inputs(self.graph)
        if self.state is not None:
            self.state(self.graph)
        bucket_gradient_reduces(self.graph)
        return make_graph_module(self.prop.gm, self.graph)   # lazily compiled when planning

    def _output(self, o: torch.fx.Node, x: torch.fx.Node, want: Placement,
                dwant: Placement) -> torch.fx.Node:
        have, dhave = self.prop.placement(o), self._dp(o)
        joint = self.data is not None and self.parts > 1 and isinstance(have, Partial) and \
            isinstance(dhave, Partial) and want != have and dwant != dhave
        if self.data is not None and dhave != dwant and not joint and _same_dim(have, dhave,
                                                                                dwant):
            # both axes split one dim (a [batch*seq, ...] view): the sequence axis gives
            # up its split first, then the data axis moves on a dim no longer shared
            x = self.redistribute(x, have, want, o.meta["val"], dhave)
            have = want
        if self.data is not None and dhave != dwant:
            x, _ = self._move_data(x, o, (dhave, dwant), (have, want) if joint else None, have)
            dhave = dwant
        return self.redistribute(x, Replicate() if joint else have, want, o.meta["val"], dhave)

    def _note_replicated(self, node: torch.fx.Node) -> None:
        """A replicated tensor's local value is its global one: kept for later passes."""
        val, d = node.meta.get("val"), self.prop.decisions.get(node)
        if isinstance(val, torch.Tensor) and d is not None and isinstance(d.output, Replicate):
            self.env[node].meta[REPLICATED_VAL] = val

    def _ring(self, node: torch.fx.Node, args) -> torch.fx.Node:
        """Ring or hybrid attention (``spdsl.lower.ring``), as the node's choice says."""
        choice = node.meta[CHOICE]
        groups = _ring_groups(self.factor, choice.ulysses, self.parts, self.rank, self.group)
        if node.target is torch.ops.spdsl.attention_fn.default:
            q, k, v, leaves, program, _, is_causal, scale = args[:8]
            out = self.graph.call_function(
                ring.ring_attention_fn, (q, k, v, leaves, program, bool(is_causal), scale,
                                         choice.ulysses, groups),
                {**_dtypes(node), "layout": choice.layout})
        else:
            a = list(args) + [None] * (8 - len(args))
            q, k, v, mask, _, is_causal, scale = a[:7]
            out = self.graph.call_function(
                ring.ring_attention, (q, k, v, mask, bool(is_causal), scale, choice.ulysses,
                                      groups), {**_dtypes(node), "layout": choice.layout})
        out.meta[FORM] = form_of(node).name
        return out

    def _node(self, node: torch.fx.Node) -> torch.fx.Node:
        if node.target is operator.getitem:
            return self.call(operator.getitem, self.env[node.args[0]], node.args[1])
        d = self.prop.decisions.get(node)
        if d is None:
            args, kwargs = tree_map(lambda a: self.env[a] if isinstance(a, torch.fx.Node) else a,
                                    (node.args, node.kwargs))
            if node.target is torch.ops.spdsl.mixer.default:
                return self.graph.call_function(mixers.run, args, kwargs)
            return self.graph.call_function(node.target, args, kwargs)
        local = self._inputs(node)
        args, kwargs = self._args(node, local)
        if node.target is torch.ops.spdsl.token_wise.default:   # the module on the rank's tokens
            return self.graph.call_function(tokenwise.run, args, kwargs)
        low = d.strategy.lowering
        if self.parts == 1 and low not in AT_ONE_RANK:
            low = None
        if node.target is torch.ops.spdsl.mixer.default:        # the mixer on the rank's part
            if low == L.MIXER_STATE:
                return self.call(mixers.run_state, args[0], args[1], self.parts, self.rank,
                                 self.group)
            return self.graph.call_function(mixers.run, args, kwargs)
        P, r, g = self.parts, self.rank, self.group
        dd = self.data.prop.decisions.get(node) if self.data is not None else None
        dlow = dd.strategy.lowering if dd is not None else None
        if dlow is not None and dlow != low:
            if low is not None or dlow not in _SHARED:
                from spdsl.errors import ShardingError
                from spdsl.propagate.source import where
                raise ShardingError(
                    rule="data and sequence axes", where=where(node),
                    value=f"{self.prop.typed(node)} / {self.data.prop.typed(node)}",
                    detail=f"the batch split over dp needs {dlow!r} here, the sequence split "
                           f"{low or 'nothing'!r}",
                    fix="keep batch rows independent until the loss (no op that mixes rows), "
                        "or run without a dp axis")
            low, g = dlow, self.data.group
        elif dlow is not None and dlow == L.NLL_MEAN and P > 1:
            g = self.data.joint            # the token counts of both axes in one all-reduce
        if low == L.VIEW:
            shape = self.local_shape_of(node, d.output, dd.output if dd is not None
                                        else Replicate())
            # local pieces need not be contiguous where the global value was: reshape
            target = aten.expand.default if node.target is aten.expand.default else \
                aten.reshape.default
            return self.graph.call_function(target, (args[0], shape) + tuple(args[2:]), kwargs)
        if low == L.CONSTRAINT or node.target is torch.ops.spdsl.constraint.default:
            return args[0]
        if low in (L.RING, L.HYBRID):
            return self._ring(node, args)
        if low == L.ULYSSES and node.target is torch.ops.spdsl.attention_fn.default:
            q, k, v, leaves, program, _, is_causal, scale = args[:8]
            out = self.graph.call_function(
                ops.ulysses_attention_fn, (q, k, v, leaves, program, bool(is_causal), scale,
                                           P, r, g), _dtypes(node))
            out.meta[FORM] = form_of(node).name
            return out
        if low == L.ULYSSES:
            a = list(args) + [None] * (8 - len(args))
            q, k, v, mask, dropout_p, is_causal, scale, gqa = a[:8]
            out = self.graph.call_function(
                ops.ulysses_attention, (q, k, v, mask, dropout_p or 0.0, bool(is_causal), scale,
                                        bool(gqa), P, r, g), written_out(node))
            out.meta[FORM] = form_of(node).name      # for the kernel pass
            return out
        if low == L.ULYSSES_FLEX:          # q, k, v, score_mod, block_mask, scale, options, bufs
            return self.call(ops.ulysses_flex, *args[:9], P, r, g)
        if low == L.NLL_MEAN:
            two_d = node.target.overloadpacket is aten.nll_loss2d_forward
            return self.call(ops.nll_mean, args[0], args[1], args[2], args[4], g, two_d)
        if low == L.MEAN_PARTIAL:
            src = node.args[0].meta["val"]
            dims = node.args[1] if len(node.args) > 1 else None
            dims = list(range(src.dim())) if not dims else [x % src.dim() for x in dims]
            keep = node.args[2] if len(node.args) > 2 else False
            count = math.prod(src.shape[x] for x in dims)
            return self.call(ops.mean_partial, args[0], dims, keep, count,
                             node.kwargs.get("dtype"))
        if low == L.LOSS_MEAN:
            count = node.args[0].meta["val"].numel()
            return self.call(ops.loss_mean, node.target, tuple(args), count)
        if low == L.SLICE_WINDOW:           # the halo exchange d.issued lists
            dim, start, n = slice_window(node)
            return self.call(C.window, args[0], dim, node.args[0].meta["val"].shape[dim], start,
                             n, P, r, g)
        if low == L.SELECT_OWNER:
            src = node.args[0].meta["val"]
            dim = node.args[1] % src.dim()
            index = node.args[2] % src.shape[dim]
            lo, hi = bounds(Shard(dim, 1, src.shape[dim]), P, r)
            return self.call(ops.select_owner, args[0], dim, index, lo, hi)
        if node.target is torch.ops.spdsl.attention_fn.default:    # replicated attention
            q, k, v, leaves, program, _, is_causal, scale = args[:8]
            out = self.graph.call_function(
                ops.ulysses_attention_fn, (q, k, v, leaves, program, bool(is_causal), scale,
                                           1, 0, g), _dtypes(node))
            out.meta[FORM] = form_of(node).name
            return out
        if node.target is torch.ops.spdsl.attention.default:    # replicated attention
            out = self.graph.call_function(ops.local_attention, args,
                                           {**kwargs, **written_out(node)})
            out.meta[FORM] = form_of(node).name
            return out
        return self.graph.call_function(node.target, args, kwargs)


def _same_dim(sp: Placement, *dps: Placement) -> bool:
    """The sequence axis splits a dim one of the data-axis placements ``dps`` splits too."""
    return isinstance(sp, Shard) and any(isinstance(d, Shard) and d.dim == sp.dim for d in dps)


def _ring_groups(factor, u: int, parts: int, rank: int, group: str) -> tuple:
    """(Ulysses group, rank in it, ring group, rank in it, ring size) of ``rank`` when the
    axis ``group`` of ``parts`` ranks runs Ulysses over ``u`` and a ring across."""
    if u == 1:
        return (None, 0, group, rank, parts)
    if factor is None:
        raise ValueError("hybrid attention needs the axis' subgroups (Lowering(factor=...))")
    return factor(u)


def _dtypes(node: torch.fx.Node) -> dict:
    """The casts around attention that ``uncast_attention`` moved past the exchange."""
    return {k: node.meta[m] for k, m in (("compute_dtype", COMPUTE_DTYPE),
                                         ("out_dtype", OUT_DTYPE)) if m in node.meta}


def written_out(node: torch.fx.Node) -> dict:
    """How each rank computes its heads, by the node's attention form: with the user's own
    ops (attention written out), or with the kernel the user called."""
    form = form_of(node)
    return {**({"written_out": True} if form.written_out else {}),
            **({"kernel": True} if form.runs_kernel else {}),
            **_dtypes(node)}


def lower(prop: Propagator, rank: int, group: str, out_placements: list[Placement],
          data: DataAxis | None = None, data_out: list[Placement] | None = None,
          state=None, factor=None) -> torch.fx.GraphModule:
    """The local graph of ``rank`` (``group``: the axis' process group name); ``data``: the
    data-parallel axis, if the batch is split too; ``state``: a pass that gathers sharded
    parameters (``spdsl.lower.param_gather``); ``factor``: Ulysses degree ``U`` -> the groups of a
    hybrid attention (``spdsl.lower.ring``)."""
    return Lowering(prop, rank, group, data, state, factor).lower(out_placements, data_out)
