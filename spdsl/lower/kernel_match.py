"""Pattern matchers for :mod:`spdsl.lower.kernels`: aten subgraphs -> one kernel call each.

Each matcher starts from one anchor node, walks its operands, and either returns ``None``
(leaving the graph alone) or rewrites the match and returns a :class:`Match`. They accept the
forms tracing produces from common model code: operands of ``mul``/``add`` in either order,
``chunk``/``split`` or slicing for the two halves of RoPE, ``pow(x, 2)`` or ``x * x``, and the
fp32 upcast / ``type_as`` downcast pair around a norm in low precision. Matches need
``meta["val"]`` on every node (one fake forward, done by the pass).

Example::

    m = MATCHERS["rms_norm"](gm.graph, rsqrt_node)
    m.kernel, m.node.target     # 'rms_norm', spdsl.kernels.rms_norm
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

import spdsl.kernels as K
from spdsl._torch import OpOverload
from spdsl.lower import ops
from spdsl.lower.loss import find_loss, tile_loss, tiled_nll, tiled_nll_mean
from spdsl.propagate.forms import FORM, FORMS

aten = torch.ops.aten
Node = torch.fx.Node


@dataclass
class Match:
    kernel: str
    node: Node              # the node now calling the kernel
    replaces: list[str]     # the ops it stands for, in graph order


def _val(n) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _is(n, *targets) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and n.target in targets


def _pair(n: Node, pred) -> tuple | None:
    """``(a, b)`` of a binary node with ``pred(a, b)`` true, trying both operand orders."""
    if len(n.args) != 2 or n.kwargs:
        return None
    a, b = n.args
    return (a, b) if pred(a, b) else (b, a) if pred(b, a) else None


def _only_user(n: Node) -> Node | None:
    """The one real user of ``n`` (autograd's unused ``detach`` twins do not count)."""
    users = [u for u in n.users if not (_is(u, aten.detach.default) and not u.users)]
    return users[0] if len(users) == 1 else None


def _cast_to(n: Node, dtype: torch.dtype) -> bool:
    """``n`` only changes the dtype of its input to ``dtype`` (``.float()``, ``.type_as``)."""
    if not _is(n, aten._to_copy.default) or n.kwargs.get("dtype") != dtype:
        return False
    src = _val(n.args[0])
    return src is not None and set(n.kwargs) <= {"dtype", "layout", "device"} and \
        n.kwargs.get("layout", torch.strided) == torch.strided and \
        torch.device(n.kwargs.get("device", src.device)) == src.device


def _replace(g: torch.fx.Graph, old: Node, fn, args: tuple, kernel: str,
             nodes: list[Node]) -> Match:
    """Put ``fn(*args)`` in place of ``old``; erase the matched nodes nobody else uses."""
    with g.inserting_before(old):
        new = g.call_function(fn, args)
    for key in ("spdsl_module", "stack_trace", "spdsl_origin", "val"):
        if key in old.meta:
            new.meta[key] = old.meta[key]
    old.replace_all_uses_with(new)
    chosen = set(nodes)
    ordered = [n for n in g.nodes if n in chosen]
    names = [_opname(n) for n in ordered]
    _erase_dead(g, ordered)
    return Match(kernel, new, names)


def _opname(n: Node) -> str:
    t = n.target
    if isinstance(t, OpOverload):
        return f"{t.namespace}.{t._opname}"
    return getattr(t, "__name__", str(t))


def _erase_dead(g: torch.fx.Graph, nodes: list[Node]) -> None:
    for n in reversed(nodes):
        for u in list(n.users):
            if _is(u, aten.detach.default) and not u.users:
                g.erase_node(u)
        if not n.users:
            g.erase_node(n)


# -- attention ---------------------------------------------------------------------------------
def match_attention(g: torch.fx.Graph, n: Node) -> Match | None:
    """The local attention of ``ulysses_attention``/``local_attention``, where its form
    (``spdsl.propagate.forms``) names a kernel and allows this call (``kernel_ok``)."""
    if not _is(n, ops.ulysses_attention, ops.local_attention) or n.kwargs.get("kernel"):
        return None
    form = FORMS[n.meta.get(FORM, "sdpa")]
    if form.kernel is None or form.runs_kernel:
        return None
    a = list(n.args) + [None] * (5 - len(n.args))
    mask = n.kwargs.get("mask", n.kwargs.get("attn_mask", a[3]))
    dropout = n.kwargs.get("dropout_p", a[4]) or 0.0
    if form.kernel_ok is not None and not form.kernel_ok(mask, dropout):
        return None
    if form.kernel != "flash_attn":
        raise NotImplementedError(f"attention form {form.name!r} names kernel "
                                  f"{form.kernel!r}; the kernel pass runs flash_attn only")
    n.kwargs = {**n.kwargs, "kernel": True}
    return Match(form.kernel, n, [form.name])


# -- RMSNorm -----------------------------------------------------------------------------------
def match_rms_norm(g: torch.fx.Graph, r: Node) -> Match | None:
    """``x * rsqrt(mean(x^2, -1, keepdim) + eps) [-> type_as] * w`` from its ``rsqrt``."""
    if not _is(r, aten.rsqrt.default):
        return None
    add = r.args[0]
    if not _is(add, aten.add.Tensor, aten.add.Scalar) or _only_user(add) is not r:
        return None
    p = _pair(add, lambda m, e: isinstance(e, (int, float)) and _is(m, aten.mean.dim))
    if p is None:
        return None
    mean, eps = p
    xf = _square_of(mean.args[0])
    vx = _val(xf)
    if xf is None or vx is None or _only_user(mean) is not add or len(mean.args) < 3 or \
            not mean.args[2] or [d % vx.dim() for d in mean.args[1]] != [vx.dim() - 1] or \
            mean.kwargs:
        return None
    normed = _only_user(r)
    if normed is None or _pair(normed, lambda a, b: a is xf and b is r) is None or \
            not _is(normed, aten.mul.Tensor):
        return None
    x, y, nodes = xf, _only_user(normed), [mean.args[0], mean, add, r, normed]
    if _cast_to(xf, torch.float32) and y is not None and _cast_to(y, xf.args[0].meta[
            "val"].dtype):       # low precision: x.float() ... .type_as(x)
        x, nodes = xf.args[0], [xf] + nodes + [y]
        y = _only_user(y)
    if y is None or not _is(y, aten.mul.Tensor):
        return None
    p = _pair(y, lambda h, w: h is nodes[-1] and _val(w) is not None and _val(w).dim() == 1)
    if p is None:
        return None
    w = p[1]
    vx, vw, vy = _val(x), _val(w), _val(y)
    if vw.shape != vx.shape[-1:] or vy is None or vy.dtype != vx.dtype or vy.shape != vx.shape:
        return None         # a weight in another dtype promotes the output: not the kernel's
    return _replace(g, y, K.rms_norm, (x, w, float(eps)), "rms_norm", nodes + [y])


def _square_of(n) -> Node | None:
    if _is(n, aten.pow.Tensor_Scalar) and n.args[1] == 2:
        return n.args[0]
    if _is(n, aten.mul.Tensor) and n.args[0] is n.args[1]:
        return n.args[0]
    return None


# -- RoPE --------------------------------------------------------------------------------------
def match_rope(g: torch.fx.Graph, add: Node) -> Match | None:
    """``x * cos + rotate_half(x) * sin [-> type_as(x)]`` on ``[B, H, S, D]``."""
    if not _is(add, aten.add.Tensor) or len(add.args) != 2 or add.kwargs:
        return None
    for m1, m2 in (add.args, add.args[::-1]):
        if not (_is(m1, aten.mul.Tensor) and _is(m2, aten.mul.Tensor)):
            continue
        for x, cos in (m1.args, m1.args[::-1]):
            p = _pair(m2, lambda rot, sin, x=x: _rotated(rot) is x)
            if p is not None and isinstance(x, Node) and isinstance(cos, Node):
                return _rope(g, add, m1, m2, x, cos, p)
    return None


def _rope(g, add, m1, m2, x, cos, p) -> Match | None:
    rot, sin = p
    vx, vc, vs = _val(x), _val(cos), _val(sin)
    if vx is None or vc is None or vs is None or vx.dim() != 4 or vc.shape != vs.shape:
        return None
    b, _, s, d = vx.shape
    lead = tuple(vc.shape[:-2])
    if tuple(vc.shape[-2:]) != (s, d) or lead not in ((), (1,), (1, 1), (b, 1)):
        return None         # tables [S, D], [1, S, D], [1|B, 1, S, D]: what broadcasting meant
    table = None if lead == () else [s, d] if lead[0] == 1 else [b, s, d]
    out, nodes = add, [m1, m2, add, *_rotation_nodes(rot)]
    if _val(add).dtype != vx.dtype:
        user = _only_user(add)
        if user is None or not _cast_to(user, vx.dtype):
            return None
        out, nodes = user, nodes + [user]
    if _val(out).shape != vx.shape:
        return None
    if table is not None:       # the kernel takes [S, D] or [B, S, D]
        with g.inserting_before(out):
            cos = g.call_function(aten.reshape.default, (cos, table))
            sin = g.call_function(aten.reshape.default, (sin, table))
        for t in (cos, sin):
            t.meta.update({k: out.meta[k] for k in ("spdsl_module", "stack_trace")
                           if k in out.meta})
    return _replace(g, out, K.rope, (x, cos, sin), "rope", nodes)


def _halves(n) -> tuple[Node, int] | None:
    """``(x, 0|1)`` when ``n`` is the first or second half of ``x``'s last dim."""
    if _is(n, operator.getitem) and _is(n.args[0], aten.split.Tensor, aten.split_with_sizes.
                                        default):
        sp = n.args[0]
        vx = _val(sp.args[0])
        if vx is None or (sp.args[2] if len(sp.args) > 2 else 0) % vx.dim() != vx.dim() - 1:
            return None
        size = sp.args[1]
        if size not in (vx.shape[-1] // 2, [vx.shape[-1] // 2] * 2) or vx.shape[-1] % 2:
            return None
        return sp.args[0], n.args[1]
    if _is(n, aten.slice.Tensor):
        vx = _val(n.args[0])
        _, dim, lo, hi, step = (list(n.args) + [0, None, None, 1][len(n.args) - 1:])[:5]
        if vx is None or vx.shape[-1] % 2 or dim % vx.dim() != vx.dim() - 1 or step != 1:
            return None
        h = vx.shape[-1] // 2
        if (lo or 0) == 0 and hi == h:
            return n.args[0], 0
        if lo == h and (hi is None or hi >= vx.shape[-1]):
            return n.args[0], 1
    return None


def _rotated(rot) -> Node | None:
    """``x`` when ``rot`` is ``cat([-x2, x1], -1)``."""
    if not _is(rot, aten.cat.default) or len(rot.args[0]) != 2:
        return None
    dim = rot.args[1] if len(rot.args) > 1 else 0
    neg, first = rot.args[0]
    if not _is(neg, aten.neg.default):
        return None
    a, b = _halves(neg.args[0]), _halves(first)
    vr = _val(rot)
    if a is None or b is None or a[0] is not b[0] or (a[1], b[1]) != (1, 0) or vr is None or \
            dim % vr.dim() != vr.dim() - 1:
        return None
    return a[0]


def _rotation_nodes(rot: Node) -> list[Node]:
    neg, first = rot.args[0]
    halves = [neg.args[0], first]
    splits = [h.args[0] for h in halves if _is(h, operator.getitem)]
    return [*dict.fromkeys(splits), *halves, neg, rot]


# -- SwiGLU ------------------------------------------------------------------------------------
def match_swiglu(g: torch.fx.Graph, n: Node) -> Match | None:
    """``silu(a) * b`` with ``a`` and ``b`` of one shape and dtype."""
    if not _is(n, aten.mul.Tensor):
        return None
    p = _pair(n, lambda s, b: _is(s, aten.silu.default) and _only_user(s) is n)
    if p is None:
        return None
    silu, b = p
    a = silu.args[0]
    va, vb = _val(a), _val(b)
    if va is None or vb is None or va.shape != vb.shape or va.dtype != vb.dtype:
        return None
    return _replace(g, n, K.swiglu, (a, b), "swiglu", [silu, n])


# -- logits + loss -----------------------------------------------------------------------------
def swap_losses(gm: torch.fx.GraphModule) -> list[Match]:
    """Every ``mm -> rows -> log_softmax -> NLL`` as the fused linear + cross-entropy, with its
    (sum, count) all-reduced when split (the same rewrite remat's loss tiling makes)."""
    out = []
    while (found := find_loss(gm)) is not None:
        before = set(gm.graph.nodes)
        nll = found["nll"]
        replaced = [_opname(n) for n in (found["mm"], *found["chain"], found["logsm"], nll)]
        meta = {k: nll.meta[k] for k in ("stack_trace", "spdsl_origin") if k in nll.meta}
        tile_loss(gm, found)
        new = [n for n in gm.graph.nodes if n not in before and
               n.target in (tiled_nll, tiled_nll_mean)]
        new[0].meta.update(meta)
        out.append(Match("fused_linear_cross_entropy", new[0], replaced))
    return out


MATCHERS = {"flash_attn": match_attention, "rms_norm": match_rms_norm, "rope": match_rope,
            "swiglu": match_swiglu}
