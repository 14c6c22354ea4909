"""Masks as functions: an attention mask built elementwise from per-token values becomes a
program over those values, evaluated a block of queries at a time by the attention kernel;
the ``[B, 1, S, S]`` tensor is never made, on any rank, forward or backward.

What is recognised. Walking back from an attention node's mask, a *pair* value is one whose
last two dims are the query and key lengths (``[.., S_q, S_k]``); a *token* value is any
other (``[B, 1, 1, S]``, ``[S, 1]``, a scalar). Hugging Face builds its masks as pair values
from token values by broadcasting: ``kv_idx <= q_idx`` (causal), ``q_idx - kv_idx < window``
(sliding window), ``padding[batch_idx, kv_idx]`` (the 2-D mask, indexed to ``[B, 1, 1, S]``),
``doc[batch_idx, q_idx] == doc[batch_idx, kv_idx]`` (packed documents from restarting
positions), then ``&``, ``where(keep, 0, finfo.min)`` and ``expand``. So does written-out
attention's additive mask and an ALiBi bias (``slope * (k_pos - q_pos)``). When every pair
value in the mask's cone is an elementwise op (or a broadcast ``expand``, a full-range
slice) and is read by nothing but attention masks, the cone becomes one program whose
inputs, the *leaves*, are the token values it reads (each reshaped to 4-D). The token values
stay ordinary graph values: O(S) each, replicated like any small tensor.

What is not: a mask passed in as a tensor ``[B, 1, S, S]``, one read by other ops, one with a
gather or a reduction over a pair value, attention dropout ``p > 0`` (the kernel has none),
or a bias that needs a gradient: those keep the dense mask and the plan lists its bytes.

The result is an ``spdsl.attention_fn(q, k, v, leaves, program, dropout_p, is_causal,
scale, enable_gqa)`` node in place of ``spdsl.attention``; ``SPDSL_MASK_FUNCTIONS=0`` turns
the pass off.
"""

from __future__ import annotations

import torch

import spdsl.env as env
from spdsl._torch import OpOverload, use_lazy_graph_module
from spdsl.errors import ShardingError
from spdsl.kernels.masked_attn import register_mask_program
from spdsl.propagate.eager_attention import SOFTCAP
from spdsl.propagate.source import where

aten = torch.ops.aten
MASK = "spdsl_mask"       # on an attention_fn node: what its mask is, in words, for the plan

_ELEMENTWISE = {aten.clone.default, aten._to_copy.default, aten.alias.default,
                aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self,
                aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar,
                aten.type_as.default, aten.clamp.default, aten.lift_fresh_copy.default}
_RANDOM = {aten.rand_like.default, aten.randn_like.default, aten.bernoulli.default,
           aten.bernoulli.p, aten.native_dropout.default}
_BROADCAST = {aten.expand.default}
# a constant [S_q, S_k] made in forward (torch.ones(S, S)): one scalar in the program
_FACTORIES = {aten.ones.default: 1, aten.zeros.default: 0, aten.full.default: None}
# tril / triu of a pair value: a comparison of positions in the program (qpos, kpos leaves)
_TRIANGLES = {aten.tril.default: "tril", aten.triu.default: "triu"}


@torch.library.custom_op("spdsl::attention_fn", mutates_args=())
def attention_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list[torch.Tensor],
                 program: str, dropout_p: float, is_causal: bool, scale: float | None,
                 enable_gqa: bool) -> torch.Tensor:
    from spdsl.kernels.masked_attn import masked_attn
    return masked_attn(q, k, v, mask_fn=program, leaves=leaves, causal=is_causal, scale=scale)


@attention_fn.register_fake
def _(q, k, v, leaves, program, dropout_p, is_causal, scale, enable_gqa):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def _is_pair(n, s_q: int, s_k: int) -> bool:
    v = _val(n)
    return isinstance(v, torch.Tensor) and v.dim() >= 2 and tuple(v.shape[-2:]) == (s_q, s_k)


def _elementwise(n: torch.fx.Node) -> bool:
    t = n.target
    if t in _RANDOM:
        return False
    if t in _ELEMENTWISE or t in _BROADCAST:
        return True
    if t is aten.slice.Tensor:       # a slice over the whole dim (HF's mask[..., :S_k])
        v, src = _val(n), _val(n.args[0])
        return v is not None and src is not None and tuple(v.shape) == tuple(src.shape)
    return isinstance(t, OpOverload) and torch.Tag.pointwise in t.tags


def _cone(mask: torch.fx.Node, s_q: int, s_k: int) -> tuple[list, list] | None:
    """The pair nodes computing ``mask`` (topological order) and the token leaves they read;
    None when a pair value is not elementwise (a tensor passed in, a gather, a reduction)."""
    pairs, leaves, seen = [], [], set()

    def visit(n) -> bool:
        if n in seen:
            return True
        seen.add(n)
        if not _is_pair(n, s_q, s_k):
            v = _val(n)
            if not isinstance(v, torch.Tensor) or v.dim() > 4 or v.requires_grad:
                return False
            shape = (1,) * (4 - v.dim()) + tuple(v.shape)
            if shape[-2] not in (1, s_q) or shape[-1] not in (1, s_k):
                return False
            leaves.append(n)
            return True
        if n.op != "call_function" or _val(n).requires_grad:
            return False
        if n.target in _FACTORIES and tuple(_val(n).shape) == (s_q, s_k):
            pairs.append(n)
            return True
        if not (_elementwise(n) or n.target in _TRIANGLES):
            return False
        if not all(visit(a) for a in n.all_input_nodes):
            return False
        pairs.append(n)
        return True

    return (pairs, leaves) if visit(mask) else None


def _program(pairs: list, leaves: list, mask: torch.fx.Node,
             positions: bool) -> torch.fx.GraphModule:
    """The cone as a graph of its own over 4-D leaves (then the query and key positions,
    when a triangle needs them); ``expand`` and full slices dropped (the kernel broadcasts),
    constant factories become scalars."""
    g = torch.fx.Graph()
    env = {leaf: g.placeholder(f"leaf{i}") for i, leaf in enumerate(leaves)}
    qpos, kpos = (g.placeholder("qpos"), g.placeholder("kpos")) if positions else (None, None)
    for n in pairs:
        if n.target in _BROADCAST or n.target is aten.slice.Tensor:
            env[n] = env[n.args[0]]
        elif n.target in _FACTORIES:
            v = _val(n)
            fill = _FACTORIES[n.target]
            fill = n.args[1] if fill is None else fill
            env[n] = g.call_function(aten.full.default, ([], fill),
                                     {"dtype": v.dtype, "device": v.device})
        elif n.target in _TRIANGLES:
            diag = n.args[1] if len(n.args) > 1 else n.kwargs.get("diagonal", 0)
            off = g.call_function(aten.sub.Tensor, (kpos, qpos))         # k - q
            cmp = aten.le.Scalar if n.target is aten.tril.default else aten.ge.Scalar
            inside = g.call_function(cmp, (off, diag))
            x = env[n.args[0]]
            env[n] = g.call_function(aten.bitwise_and.Tensor, (inside, x)) \
                if _val(n).dtype == torch.bool else \
                g.call_function(aten.where.ScalarOther, (inside, x, 0))
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[mask])
    # an ordinary GraphModule, its code made now: the trace runs under lazy graph modules,
    # whose first call regenerates code, and the kernel calls this inside a compiled program
    with use_lazy_graph_module(False):
        program = torch.fx.GraphModule(torch.nn.Module(), g)
    program.recompile()
    return program


def _describe(pairs: list, leaves: list, positions: bool) -> str:
    """The plan's words for a mask program: what it reads and the ops it applies."""
    ops = sorted({n.target.overloadpacket.__name__ for n in pairs
                  if hasattr(n.target, "overloadpacket") and n.target not in _BROADCAST
                  and n.target is not aten.slice.Tensor})
    reads = [f"{len(leaves)} per-token value{'s' if len(leaves) != 1 else ''}"] + \
        (["positions"] if positions else [])
    return f"function of {' and '.join(reads)} ({', '.join(ops)}), no [S, S] tensor"


def masks_as_functions(gm: torch.fx.GraphModule) -> int:
    """Rewrite every ``spdsl.attention`` whose mask is a program of per-token values into
    ``spdsl.attention_fn``; returns how many were rewritten."""
    if not env.on("SPDSL_MASK_FUNCTIONS"):
        return 0
    g = gm.graph
    done = _unmasked_written_out(g)
    nodes = [n for n in g.nodes if n.target is torch.ops.spdsl.attention.default
             and len(n.args) > 3 and isinstance(n.args[3], torch.fx.Node)]
    programs: dict[torch.fx.Node, tuple] = {}
    for att in nodes:
        q, k = _val(att.args[0]), _val(att.args[1])
        dropout = att.args[4] if len(att.args) > 4 else 0.0
        if dropout or q is None or q.dim() != 4:
            continue
        mask, cap = att.args[3], att.meta.get(SOFTCAP)
        if (mask, cap) not in programs:
            found = _cone(mask, q.shape[2], k.shape[2])
            if found is None or not _read_by_attention_only(found[0], mask):
                programs[mask, cap] = None
                continue
            pairs, leaves = found
            positions = any(n.target in _TRIANGLES for n in pairs)
            dtypes = tuple(_val(x).dtype for x in leaves) + \
                ((torch.long, torch.long) if positions else ())
            programs[mask, cap] = (register_mask_program(
                _program(pairs, leaves, mask, positions), leaf_dtypes=dtypes, softcap=cap),
                pairs, leaves, positions)
        entry = programs[mask, cap]
        if entry is None:
            continue
        key, pairs, leaves, positions = entry
        with g.inserting_before(att):
            four = [g.call_function(aten.reshape.default, (x, _four(x))) for x in leaves]
            for x, f in zip(leaves, four):
                f.meta["val"] = _val(x).reshape(_four(x))
            if positions:
                four += _positions(g, q, k)
            for f in four:     # where the plan and the layer folding place them: the attention's
                f.meta.update({m: v for m, v in att.meta.items() if m not in f.meta})
                if f.args[0].op == "call_function" and f.args[0].target is aten.arange.default:
                    f.args[0].meta.update({m: v for m, v in att.meta.items()
                                           if m not in f.args[0].meta})
            a = list(att.args) + [None] * (8 - len(att.args))
            new = g.call_function(torch.ops.spdsl.attention_fn.default,
                                  (a[0], a[1], a[2], four, key, float(a[4] or 0.0), bool(a[5]),
                                   a[6], bool(a[7])))
        new.meta.update(att.meta)
        new.meta[MASK] = _describe(pairs, leaves, positions) + _capped(att)
        att.replace_all_uses_with(new)
        g.erase_node(att)
        done += 1
    for (mask, _cap), entry in programs.items():     # the pair values nobody reads any more
        if entry is not None:
            for n in reversed(entry[1]):
                if not n.users:
                    g.erase_node(n)
    done += _dense_written_out(g)
    _uncapped(g)
    if done:
        gm.recompile()
    return done


def _unmasked_written_out(g: torch.fx.Graph) -> int:
    """Written-out attention without a mask (bidirectional; ``nn.MultiheadAttention``) runs
    in the same kernel: its user's ops would materialise ``[S, S]`` scores per head."""
    from spdsl.propagate.forms import form_of
    done = 0
    for att in [n for n in g.nodes if n.target is torch.ops.spdsl.attention.default]:
        a = list(att.args) + [None] * (8 - len(att.args))
        if a[3] is not None or a[4] or not form_of(att).written_out or \
                _val(a[0]) is None or _val(a[0]).dim() != 4:
            continue
        cap = att.meta.get(SOFTCAP)
        key = "" if cap is None else register_mask_program(None, "softcap", softcap=cap)
        with g.inserting_before(att):
            new = g.call_function(torch.ops.spdsl.attention_fn.default,
                                  (a[0], a[1], a[2], [], key, 0.0, bool(a[5]), a[6],
                                   bool(a[7])))
        new.meta.update(att.meta)
        new.meta[MASK] = ("causal" if a[5] else "none") + _capped(att)
        att.replace_all_uses_with(new)
        g.erase_node(att)
        done += 1
    return done


def _dense_written_out(g: torch.fx.Graph) -> int:
    """Written-out attention whose mask is a tensor no program can replace (one the caller
    passes): the kernel takes that tensor as its one leaf, so the scores, probabilities and
    their gradients (several ``[S, S]`` per head) are never made; the mask itself stays."""
    from spdsl.propagate.forms import form_of
    done = 0
    for att in [n for n in g.nodes if n.target is torch.ops.spdsl.attention.default]:
        a = list(att.args) + [None] * (8 - len(att.args))
        m, q = _val(a[3]), _val(a[0])
        if m is None or a[4] or not form_of(att).written_out or q is None or q.dim() != 4 \
                or m.dim() > 4 or m.requires_grad:
            continue
        key = register_mask_program(_identity(), "dense", leaf_dtypes=(m.dtype,),
                                    softcap=att.meta.get(SOFTCAP))
        with g.inserting_before(att):
            four = g.call_function(aten.reshape.default, (a[3], _four(a[3])))
            four.meta.update({k: v for k, v in att.meta.items() if k != "val"})
            four.meta["val"] = m.reshape(_four(a[3]))
            new = g.call_function(torch.ops.spdsl.attention_fn.default,
                                  (a[0], a[1], a[2], [four], key, 0.0, bool(a[5]), a[6],
                                   bool(a[7])))
        new.meta.update(att.meta)
        new.meta[MASK] = f"dense tensor {list(m.shape)} {str(m.dtype).removeprefix('torch.')} " \
                         f"({m.numel() * m.element_size():,} B on every rank), no [S, S] scores" \
                         + _capped(att)
        att.replace_all_uses_with(new)
        g.erase_node(att)
        done += 1
    return done


def _capped(att: torch.fx.Node) -> str:
    cap = att.meta.get(SOFTCAP)
    return "" if cap is None else f", scores capped at {cap:g} (c * tanh(s / c))"


def _uncapped(g: torch.fx.Graph) -> None:
    """Capped scores are the mask kernel's alone: a capped attention left as ``spdsl.attention``
    (SDPA would drop the cap) is an error here, not a wrong result later."""
    for att in g.nodes:
        if att.target is torch.ops.spdsl.attention.default and SOFTCAP in att.meta:
            raise ShardingError(
                rule="capped attention scores", where=where(att),
                detail="attention written out with a tanh cap on its scores and a mask that "
                       "is not a plain value (it requires grad, or has more than 4 dims): "
                       "only the mask kernel computes the cap, and it takes no such mask",
                fix="detach the mask (masks carry no gradient), or build it in 4 dims")


def _identity() -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    g.output(g.placeholder("mask"))
    with use_lazy_graph_module(False):
        program = torch.fx.GraphModule(torch.nn.Module(), g)
    program.recompile()
    return program


def _positions(g: torch.fx.Graph, q: torch.Tensor, k: torch.Tensor) -> list:
    """``[1, 1, S_q, 1]`` and ``[1, 1, 1, S_k]`` positions, made in the graph (O(S))."""
    out = []
    for n, shape in ((q.shape[2], (1, 1, q.shape[2], 1)), (k.shape[2], (1, 1, 1, k.shape[2]))):
        a = g.call_function(aten.arange.default, (n,), {"device": q.device})
        a.meta["val"] = q.new_empty((n,), dtype=torch.long)
        r = g.call_function(aten.reshape.default, (a, shape))
        r.meta["val"] = q.new_empty(shape, dtype=torch.long)
        out.append(r)
    return out


def _four(x: torch.fx.Node) -> tuple[int, ...]:
    v = _val(x)
    return (1,) * (4 - v.dim()) + tuple(v.shape)


def _read_by_attention_only(pairs: list, mask: torch.fx.Node) -> bool:
    inside = set(pairs)
    for n in pairs:
        for u in n.users:
            if u in inside:
                continue
            if u.target is torch.ops.spdsl.attention.default and n is mask and \
                    u.args[3] is mask and not (len(u.args) > 4 and u.args[4]):
                continue
            return False
    return True
