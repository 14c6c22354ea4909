"""Attention written out in ops, recognised as attention: ``softmax(q @ k^T * scale + mask) @ v``
becomes one ``spdsl.attention`` node, so the Ulysses rule applies to it as to SDPA.

Hugging Face's ``attn_implementation="eager"``, ``nn.MultiheadAttention`` with
``need_weights=True`` and hand-written attention trace to a ``bmm`` of q and k^T, a scale, an
additive mask, a softmax over the last dim and a ``bmm`` with v. Left as ops, propagation sees
two matrix products: the cheapest placement of each alone gathers k and v (``P`` times the
Ulysses bytes for k and v) or moves every tensor separately. As one attention node the
lowering runs one all-to-all for q, k, v (sequence -> heads), SDPA over the whole sequence for
``H/P`` heads, and one all-to-all back: the analytic floor of the plan.

Matched, between the two products: views, casts, ``clone``, multiplications or divisions by
constants (folded into ``scale``), a cap ``c * tanh(s / c)`` of the scaled scores (Gemma 2's
``attn_logit_softcapping``: the mask kernel computes it, so such a node always becomes a mask
kernel call, ``SOFTCAP``), one added mask (after every scale), the softmax (float32 or the
input dtype), and dropout with ``p == 0``. q, k and v are followed back through views to
``[B, H, S, D]`` where they exist (else the ``[B*H, S, D]`` operands are viewed as
``[1, B*H, S, D]``), and k and v back through Hugging Face's ``repeat_kv``
(``x[:, :, None].expand(...).reshape(...)``) so that grouped kv heads cross the all-to-all
unrepeated. Not matched (left as ops, still exact): dropout with ``p > 0``, masks applied by
``where``/``masked_fill``, attention weights used elsewhere (``output_attentions=True``).

Scores begun by ``baddbmm(bias, q, k^T, beta=b, alpha=a)`` other than ``b == a == 1`` with no
mask after (BLOOM's ALiBi: a bias per head and key on ``[B*H, S, D]`` operands, then the
mask; GPT-2's ``reorder_and_upcast_attn``, ``beta=0``) are the ``baddbmm`` form, found by a
second pass (:func:`fuse_biased_attention`).

Numerics: each rank computes its heads with the same ops (``spdsl.lower.ops.local_attention``
with ``written_out``), not SDPA, so rows whose every key is masked (left padding) get the
uniform average the user's ops give them. ``SPDSL_FUSE_EAGER_ATTENTION=0`` turns it off.
"""

from __future__ import annotations

import math
import operator

import torch

import spdsl.env as env
from spdsl._torch import detect_fake_mode
from spdsl.propagate.attention_nodes import (
    PASS,
    back,
    shape,
    unrepeat,
)
from spdsl.propagate.forms import FORM
from spdsl.propagate.heads import UNREPEATED
from spdsl.propagate.liveness import live_nodes, sweep

aten = torch.ops.aten
# on an spdsl.attention node: its scores are capped as c * tanh(s / c) before the mask; only
# the mask kernel computes that (spdsl.propagate.masks turns every such node into one)
SOFTCAP = "spdsl_softcap"
# scores scaled in place (``scores /= math.sqrt(d)``, Falcon) are the same chain
_MUL = (aten.mul.Tensor, aten.mul.Scalar, aten.mul_.Tensor, aten.mul_.Scalar)
_DIV = (aten.div.Tensor, aten.div.Scalar, aten.div_.Tensor, aten.div_.Scalar)


def _only_user(n: torch.fx.Node, live: set) -> torch.fx.Node | None:
    users = [u for u in n.users if u in live]
    return users[0] if len(users) == 1 else None


def _constant(gm: torch.fx.GraphModule, a) -> float | None:
    """The value of a scalar operand: a Python number, a 0-d constant tensor or ``full([])``."""
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return float(a)
    if not isinstance(a, torch.fx.Node):
        return None
    if a.op == "get_attr":
        t = getattr(gm, a.target, None)
        return float(t) if isinstance(t, torch.Tensor) and t.numel() == 1 else None
    if a.target in (aten.lift_fresh_copy.default, aten._to_copy.default, aten.clone.default):
        return _constant(gm, a.args[0])
    if a.target is aten.full.default and list(a.args[0]) in ([], [1]):
        return float(a.args[1])
    if a.target is aten.scalar_tensor.default:
        return float(a.args[0])
    return None



def _root4(n: torch.fx.Node, N: int, S: int, D: int, transposed: bool,
           flat_kt: bool = False) -> torch.fx.Node | None:
    """A ``[B, H, S, D]`` node (``B*H`` dividing N: kv heads broadcast by ``matmul`` count)
    that the bmm operand ``n`` is a view of; for k the operand is ``k^T`` and the root is the
    input of that transpose (``flat_kt``: also of a transpose of ``[B*H, S, D]`` k, BLOOM's
    ``k.reshape(B * H, S, D).transpose(-1, -2)``)."""
    def fits(sh) -> bool:
        return len(sh) == 4 and sh[2:] == (S, D) and N % (sh[0] * sh[1]) == 0

    found = None
    for m in back(n):      # the farthest back: before a broadcast of kv heads
        if transposed:
            if m.target is aten.transpose.int and len(shape(m)) == 4 and \
                    {a % 4 for a in m.args[1:3]} == {2, 3} and fits(shape(m.args[0])):
                return m.args[0]
            if flat_kt and m.target is aten.transpose.int and len(shape(m)) == 3 and \
                    {a % 3 for a in m.args[1:3]} == {1, 2}:
                return _root4(m.args[0], N, S, D, False)
            continue
        if fits(shape(m)):
            found = m
    return found




class _Match:
    """``biased``: the scores begin as ``baddbmm(bias, q, k^T, beta=, alpha=)`` (the ``baddbmm``
    form): ``alpha`` is the scale, ``beta * bias`` a term of its own, and one additive mask
    may follow; else a ``baddbmm`` is matched only with ``beta == alpha == 1``, its input the
    mask (the ``written_out`` form)."""

    def __init__(self, gm: torch.fx.GraphModule, bmm1: torch.fx.Node, live: set,
                 biased: bool = False) -> None:
        self.gm, self.bmm1, self.live, self.biased = gm, bmm1, live, biased
        self.scale, self.mask, self.bmm2 = 1.0, None, None
        self.mask_dims, self.scores = 0, ()
        self.bias, self.beta = None, 1.0
        self.softcap, self.tanh = None, False    # scores capped as c * tanh(s / c) (Gemma 2)

    def run(self) -> bool:
        b1 = self.bmm1
        if self.biased:
            if b1.target is not aten.baddbmm.default or not self._bias():
                return False
        elif b1.target is aten.baddbmm.default:
            if b1.kwargs.get("beta", 1) != 1 or b1.kwargs.get("alpha", 1) != 1:
                return False
            self.mask, self.mask_dims = b1.args[0], 3
        n, soft = b1, None
        while True:
            u = _only_user(n, self.live)
            if u is None:
                return False
            if u.target is aten.bmm.default and soft is not None and u.args[0] is n:
                self.bmm2 = u
                return True
            if u.target in PASS and u.args[0] is n:
                pass
            elif u.target in _MUL + _DIV and soft is None and self.mask is None and \
                    self.bias is None:
                other = u.args[1] if u.args[0] is n else u.args[0]
                c = _constant(self.gm, other)
                if c is None or (u.target in _DIV and u.args[0] is not n):
                    return False
                c = c if u.target in _MUL else 1.0 / c
                if self.tanh and self.softcap is None:
                    if c <= 0:
                        return False
                    # c' * tanh(a * qk) is the kernel's c' * tanh(s / c') at s = a * c' * qk
                    self.softcap, self.scale = c, self.scale * c
                elif self.tanh:
                    return False
                else:
                    self.scale *= c
            elif u.target is aten.tanh.default and soft is None and self.mask is None and \
                    self.bias is None and not self.tanh and \
                    env.on("SPDSL_MASK_FUNCTIONS"):
                self.tanh = True
            elif u.target in (aten.add.Tensor, aten.add_.Tensor) and soft is None and self.mask is None and \
                    len(u.args) == 2 and not u.kwargs:
                other = u.args[1] if u.args[0] is n else u.args[0]
                if not isinstance(other, torch.fx.Node) or other is n:
                    return False
                self.mask, self.mask_dims, self.scores = other, len(shape(n)), shape(n)
            elif u.target is aten._softmax.default and soft is None:
                if u.args[1] % len(shape(n)) != len(shape(n)) - 1 or \
                        (self.tanh and self.softcap is None):
                    return False
                soft = u
            elif u.target is aten.native_dropout.default and soft is not None and \
                    u.args[1] == 0.0:
                items = [g for g in u.users if g.target is operator.getitem]
                first = [g for g in items if g.args[1] == 0]
                if len(first) != 1 or any(g.args[1] == 1 and g.users for g in items):
                    return False
                u = first[0]
            else:
                return False
            n = u

    def _bias(self) -> bool:
        """The constant ``alpha`` (the scale) and ``beta`` of the ``baddbmm``, and its input
        when ``beta`` counts it (``beta == 0`` ignores the input); a bias a gradient may
        reach (a learned one) stays ops: a mask carries none."""
        b1 = self.bmm1
        alpha, beta = b1.kwargs.get("alpha", 1), b1.kwargs.get("beta", 1)
        if not all(isinstance(c, (int, float)) and not isinstance(c, bool)
                   for c in (alpha, beta)):
            return False
        self.scale, self.beta = float(alpha), float(beta)
        bias = b1.args[0]
        if not beta:
            return True
        val = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dim() > 3 or carries_grad(bias):
            return False
        self.bias = bias
        return True


def carries_grad(n: torch.fx.Node) -> bool:
    """Whether a gradient may reach ``n``'s value: a floating path back to a graph input (a
    parameter, a buffer or an argument: the traced inputs do not say which require one), not
    through ``detach``. ALiBi's bias is made of factories and integer positions: none."""
    seen, todo = set(), [n]
    while todo:
        a = todo.pop()
        if a in seen:
            continue
        seen.add(a)
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point() and \
                not val.is_complex():
            continue
        if a.op == "placeholder":
            return True
        if a.target is not aten.detach.default:
            todo += a.all_input_nodes
    return False



def fuse_eager_attention(gm: torch.fx.GraphModule) -> int:
    """Replace every matched written-out attention of ``gm`` by one ``spdsl.attention`` node;
    returns how many were replaced."""
    return _fuse(gm, biased=False)


def fuse_biased_attention(gm: torch.fx.GraphModule) -> int:
    """The ``baddbmm`` form: attention whose scores begin as ``baddbmm(bias, q, k^T, beta=,
    alpha=)`` with a bias per head and key (BLOOM's ALiBi, ``[B*H, 1, S]``), then an additive
    mask, a softmax and a ``bmm`` with v, becomes one ``spdsl.attention`` node whose mask is
    ``beta * bias`` (viewed ``[B, H, 1, S]``) plus that mask: a function of per-token and
    per-head values (``spdsl.propagate.masks``), each rank's heads cut from it after the
    all-to-all. Layers reading the same bias and mask share one. Returns how many were
    replaced."""
    return _fuse(gm, biased=True)


def _fuse(gm: torch.fx.GraphModule, biased: bool) -> int:
    if not env.on("SPDSL_FUSE_EAGER_ATTENTION"):
        return 0
    g = gm.graph
    done, live, shared = 0, live_nodes(g), {}
    targets = (aten.baddbmm.default,) if biased else (aten.bmm.default, aten.baddbmm.default)
    for b1 in [n for n in g.nodes if n.target in targets]:
        if not b1.users:
            continue
        m = _Match(gm, b1, live, biased)
        if not m.run() or not _rewrite(gm, m, shared):
            continue
        done += 1
    if done:
        sweep(g)
        gm.recompile()
    return done


def _rewrite(gm: torch.fx.GraphModule, m: _Match, shared: dict) -> bool:
    b1, b2 = m.bmm1, m.bmm2
    qa, ka = (b1.args[1], b1.args[2]) if b1.target is aten.baddbmm.default else b1.args[:2]
    N, S, D = shape(qa)
    Skv = shape(ka)[2]
    if shape(ka) != (N, D, Skv) or shape(b2.args[1])[:2] != (N, Skv):
        return False
    Dv = shape(b2.args[1])[2]
    q4 = _root4(qa, N, S, D, False)
    k4 = _root4(ka, N, Skv, D, True, flat_kt=m.biased)
    v4 = _root4(b2.args[1], N, Skv, Dv, False)
    g = gm.graph
    fake = detect_fake_mode([b1.meta["val"]])
    new: list[torch.fx.Node] = []
    model_level: set[torch.fx.Node] = set()

    def call(target, *args) -> torch.fx.Node:
        node = g.call_function(target, args)
        vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
        with fake:
            node.meta["val"] = target(*vals)
        new.append(node)
        return node

    four = q4 is not None and k4 is not None and v4 is not None and \
        shape(q4)[0] == shape(k4)[0] == shape(v4)[0] and shape(q4)[0] * shape(q4)[1] == N
    with g.inserting_before(b2):
        if four:
            B, H = shape(q4)[:2]
            k4, v4 = unrepeat(k4), unrepeat(v4)
            if shape(k4)[1] != shape(v4)[1] or H % shape(k4)[1]:
                return False
        else:
            B, H = 1, N
            q4 = call(aten.reshape.default, qa, [1, N, S, D])
            k4 = call(aten.reshape.default, call(aten.transpose.int, ka, 1, 2), [1, N, Skv, D])
            v4 = call(aten.reshape.default, b2.args[1], [1, N, Skv, Dv])
        mask = m.mask
        if m.biased:
            if mask is not None and (carries_grad(mask) or
                                     four and m.mask_dims == 4 and m.scores[:2] != (B, H)):
                return False
            key = (m.bias, m.beta, mask, B, H)
        if m.biased and key in shared:
            mask = shared[key]
        elif mask is not None:
            ms = shape(mask)
            if len(ms) > 4:
                return False
            if m.mask_dims == 4 and not four and len(ms) >= 3 and math.prod(ms[:-2]) > 1:
                # added to [B', H', S, S] scores, attended as [1, B'*H', S, S]
                mask = call(aten.expand.default, mask, list(m.scores))
                mask = call(aten.reshape.default, mask, [1, N, S, Skv])
            elif len(ms) == 3 and m.mask_dims == 3 and ms[0] == N and N > 1:
                mask = call(aten.reshape.default, mask, [B, H, ms[1], ms[2]])
            elif len(ms) == 3 and m.mask_dims == 3 and ms[0] != 1:
                return False
        if m.biased and key not in shared:
            first = len(new)
            mask = _biased_mask(m, call, mask, N, B, H)
            if mask is False:
                return False
            shared[key] = mask
            model_level = set(new[first:])     # read by every layer: placed where the bias is
        gqa = shape(k4)[1] != H
        att = call(torch.ops.spdsl.attention.default, q4, k4, v4, mask, 0.0, False,
                   float(m.scale), gqa)
        if gqa:
            att.meta[UNREPEATED] = True
        if m.softcap is not None:
            att.meta[SOFTCAP] = m.softcap
        out = call(aten.reshape.default, att, [N, S, Dv])
    att.meta[FORM] = "baddbmm" if m.biased else "written_out"
    for n in new:
        src = m.bias if n in model_level else b1
        n.meta["stack_trace"] = src.meta.get("stack_trace")
        n.meta["spdsl_module"] = src.meta.get("spdsl_module", "")
    b2.replace_all_uses_with(out)
    return True


def _biased_mask(m: _Match, call, mask, N: int, B: int, H: int):
    """``beta * bias + mask`` as one ``[B, H, ., S]`` value (the bias's rows per head are
    ``[B*H, ., S]``, batch-major as the ``baddbmm`` reads them), or False where the bias does
    not broadcast that way. Made of the bias's and mask's own values: elementwise, so a
    function of per-token values where they are."""
    if m.bias is None:
        return mask
    bs = (1,) * (3 - len(shape(m.bias))) + shape(m.bias)
    if bs[0] == N and N > 1:
        bias = call(aten.reshape.default, m.bias, [B, H, bs[1], bs[2]])
    elif bs[0] == 1:
        bias = call(aten.reshape.default, m.bias, [1, 1, bs[1], bs[2]])
    else:
        return False
    if m.beta != 1:
        bias = call(aten.mul.Tensor, bias, m.beta)
    return bias if mask is None else call(aten.add.Tensor, bias, mask)
