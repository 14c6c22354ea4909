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
from spdsl._torch import OpOverload, detect_fake_mode
from spdsl.propagate.forms import FORM
from spdsl.propagate.heads import UNREPEATED

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_PASS = _VIEWS | {aten.clone.default, aten.alias.default, aten.contiguous.default,
                  aten._to_copy.default, aten.expand.default}
# on an spdsl.attention node: its scores are capped as c * tanh(s / c) before the mask; only
# the mask kernel computes that (spdsl.propagate.masks turns every such node into one)
SOFTCAP = "spdsl_softcap"
# scores scaled in place (``scores /= math.sqrt(d)``, Falcon) are the same chain
_MUL = (aten.mul.Tensor, aten.mul.Scalar, aten.mul_.Tensor, aten.mul_.Scalar)
_DIV = (aten.div.Tensor, aten.div.Scalar, aten.div_.Tensor, aten.div_.Scalar)


def _live(g: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes the output depends on (attention weights a module returns and its caller drops,
    ``nn.MultiheadAttention``'s averaged weights, are not)."""
    live: set[torch.fx.Node] = set()
    for n in reversed(g.nodes):
        if n.op != "call_function" or any(u in live for u in n.users) or _effect(n) or \
                _writes_read(n, live):
            live.add(n)
    return live


def _writes_read(n: torch.fx.Node, live: set) -> bool:
    """An in-place write into a temporary that a live node reads, through any of its views:
    DeepSeek-V2 builds its keys as ``new_empty`` filled by ``copy_`` into two slices, and
    attention reads the ``new_empty``, not the copies."""
    t = n.target
    if not isinstance(t, OpOverload) or not t._schema.is_mutable or not n.args or \
            not isinstance(n.args[0], torch.fx.Node):
        return False
    return any(u in live for a in view_family(n.args[0]) for u in a.users)


def view_family(n: torch.fx.Node) -> set[torch.fx.Node]:
    """The tensor ``n`` is a view of, and every view taken of it: what a write into one of
    them changes."""
    base = n
    while base.op == "call_function" and isinstance(base.target, OpOverload) and \
            base.target.is_view and base.args and isinstance(base.args[0], torch.fx.Node):
        base = base.args[0]
    family, todo = set(), [base]
    while todo:
        a = todo.pop()
        if a in family:
            continue
        family.add(a)
        todo += [u for u in a.users if u.op == "call_function" and
                 isinstance(u.target, OpOverload) and u.target.is_view]
    return family


def _effect(n: torch.fx.Node) -> bool:
    """Seeded random ops (the stream must advance as in the user's program) and in-place
    updates of graph inputs (running statistics) are kept even when nothing reads them; an
    in-place op on a temporary (Falcon's ``scores /= math.sqrt(d)``) is not."""
    t = n.target
    if not isinstance(t, OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in t.tags:
        return True
    if not t._schema.is_mutable:
        return False
    base = n.args[0] if n.args else None
    while isinstance(base, torch.fx.Node) and base.op == "call_function" and \
            isinstance(base.target, OpOverload) and base.target.is_view:
        base = base.args[0]
    return not isinstance(base, torch.fx.Node) or base.op != "call_function"


def _sweep(g: torch.fx.Graph) -> None:
    """Erase what no longer reaches the output: the written-out attention's leftovers (its
    weights, which a module may return and its caller drop)."""
    live = _live(g)
    for n in reversed(list(g.nodes)):
        if n not in live and not n.users:
            g.erase_node(n)


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


def _shape(n) -> tuple:
    return tuple(n.meta["val"].shape)


def _back(n: torch.fx.Node) -> list[torch.fx.Node]:
    """``n`` and the nodes it is a view/copy of, nearest first (stopping at other ops)."""
    out = [n]
    while n.target in _PASS and isinstance(n.args[0], torch.fx.Node):
        n = n.args[0]
        if n.meta["val"].numel() != out[0].meta["val"].numel() and \
                n.target is not aten.expand.default and out[-1].target is not aten.expand.default:
            break
        out.append(n)
    return out


def _root4(n: torch.fx.Node, N: int, S: int, D: int, transposed: bool,
           flat_kt: bool = False) -> torch.fx.Node | None:
    """A ``[B, H, S, D]`` node (``B*H`` dividing N: kv heads broadcast by ``matmul`` count)
    that the bmm operand ``n`` is a view of; for k the operand is ``k^T`` and the root is the
    input of that transpose (``flat_kt``: also of a transpose of ``[B*H, S, D]`` k, BLOOM's
    ``k.reshape(B * H, S, D).transpose(-1, -2)``)."""
    def fits(sh) -> bool:
        return len(sh) == 4 and sh[2:] == (S, D) and N % (sh[0] * sh[1]) == 0

    found = None
    for m in _back(n):      # the farthest back: before a broadcast of kv heads
        if transposed:
            if m.target is aten.transpose.int and len(_shape(m)) == 4 and \
                    {a % 4 for a in m.args[1:3]} == {2, 3} and fits(_shape(m.args[0])):
                return m.args[0]
            if flat_kt and m.target is aten.transpose.int and len(_shape(m)) == 3 and \
                    {a % 3 for a in m.args[1:3]} == {1, 2}:
                return _root4(m.args[0], N, S, D, False)
            continue
        if fits(_shape(m)):
            found = m
    return found


def _unrepeat(k: torch.fx.Node) -> torch.fx.Node:
    """The kv tensor before Hugging Face's ``repeat_kv`` (or a single kv head expanded or
    repeated to every query head), or ``k`` itself."""
    chain = _back(k)
    for i, m in enumerate(chain):
        if m.target in (aten.expand.default, aten.repeat.default) and len(_shape(m)) == 4:
            # one kv head broadcast or tiled to every query head ([B, 1, S, D] -> [B, H, S, D]):
            # for a single head, tiled and interleaved repeats read the same head
            src = m.args[0]
            if _shape(src)[1] == 1 and [x for j, x in enumerate(_shape(src)) if j != 1] == \
                    [x for j, x in enumerate(_shape(m)) if j != 1]:
                return src
            break
        if m.target is aten.expand.default and len(_shape(m)) == 5:
            src = m.args[0]
            while src.target is aten.slice.Tensor and src.args[2] in (0, None) and \
                    (len(src.args) < 4 or src.args[3] >= _shape(src.args[0])[src.args[1]]):
                src = src.args[0]
            if src.target is aten.unsqueeze.default and src.args[1] % 5 == 2:
                kv = src.args[0]
                while kv.target is aten.slice.Tensor and kv.args[2] in (0, None) and \
                        (len(kv.args) < 4 or kv.args[3] >= _shape(kv.args[0])[kv.args[1]]):
                    kv = kv.args[0]
                b, h, s, d = _shape(k)
                kb, kh, ks, kd = _shape(kv)
                if (kb, ks, kd) == (b, s, d) and h % kh == 0:
                    return kv
            break
    return k


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
            if u.target in _PASS and u.args[0] is n:
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
                self.mask, self.mask_dims, self.scores = other, len(_shape(n)), _shape(n)
            elif u.target is aten._softmax.default and soft is None:
                if u.args[1] % len(_shape(n)) != len(_shape(n)) - 1 or \
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


def unrepeat_kv(gm: torch.fx.GraphModule) -> int:
    """Attention (SDPA) whose k and v went through Hugging Face's ``repeat_kv`` reads the kv
    heads before the repeat instead (``enable_gqa``: the same head mapping, query head ``h``
    reads kv head ``h // (H_q / H_kv)``), so that the all-to-all moves them unrepeated -- at a
    Llama-3.1-8B shape 320 MiB per layer per rank instead of 512 at 131,072 tokens on 8 ranks.
    Returns how many were rewritten."""
    done = 0
    for n in [n for n in gm.graph.nodes if n.target is torch.ops.spdsl.attention.default]:
        q, k, v = n.args[:3]
        a = list(n.args) + [None] * (8 - len(n.args))
        if a[7] or not all(isinstance(x, torch.fx.Node) for x in (q, k, v)):
            continue
        k0, v0 = _unrepeat(k), _unrepeat(v)
        h = _shape(q)[1]
        if k0 is k or v0 is v or _shape(k0)[1] != _shape(v0)[1] or h % _shape(k0)[1]:
            continue
        a[1], a[2], a[7] = k0, v0, True
        n.args = tuple(a)
        n.meta[UNREPEATED] = True
        done += 1
    if done:
        _sweep(gm.graph)
        gm.recompile()
    return done


COMPUTE_DTYPE = "spdsl_compute_dtype"   # on an attention node: cast q, k, v after the exchange
OUT_DTYPE = "spdsl_out_dtype"           # ... and the output before the exchange back


def _upcast_of(x) -> torch.fx.Node | None:
    """The narrower floating value ``x`` is a plain upcast of (``x = y.float()``), or None."""
    if not isinstance(x, torch.fx.Node) or x.target is not aten._to_copy.default or \
            set(x.kwargs) - {"dtype"} or not isinstance(x.args[0], torch.fx.Node):
        return None
    y, val = x.args[0], x.meta["val"]
    src = y.meta.get("val")
    if not isinstance(src, torch.Tensor) or not src.is_floating_point() or \
            not val.is_floating_point() or src.element_size() >= val.element_size():
        return None
    return y


def uncast_attention(gm: torch.fx.GraphModule) -> int:
    """Attention whose q, k and v were all upcast right before it (``q.float()`` of bf16
    values, a common way to attend in float32) reads them before the cast, and each rank casts
    after the all-to-all: the exchange moves the narrow dtype. An output whose only use is a
    downcast is cast before the exchange back. Each rank computes in the same dtypes as the
    user's program. Returns how many attention nodes changed."""
    done = 0
    for n in [n for n in gm.graph.nodes if n.target is torch.ops.spdsl.attention.default]:
        changed = False
        src = [_upcast_of(x) for x in n.args[:3]]
        if all(y is not None for y in src) and \
                len({y.meta["val"].dtype for y in src}) == 1 and \
                len({x.meta["val"].dtype for x in n.args[:3]}) == 1:
            n.meta[COMPUTE_DTYPE] = n.args[0].meta["val"].dtype
            n.args = tuple(src) + tuple(n.args[3:])
            changed = True
        users = list(n.users)
        if len(users) == 1 and users[0].target is aten._to_copy.default and \
                users[0].args[0] is n and not set(users[0].kwargs) - {"dtype"} and \
                users[0].meta["val"].is_floating_point() and \
                users[0].meta["val"].element_size() < n.meta["val"].element_size():
            down = users[0]
            n.meta[OUT_DTYPE] = down.meta["val"].dtype
            n.meta["val"] = down.meta["val"]
            down.replace_all_uses_with(n)
            gm.graph.erase_node(down)
            changed = True
        done += changed
    if done:
        _sweep(gm.graph)
        gm.recompile()
    return done


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
    done, live, shared = 0, _live(g), {}
    targets = (aten.baddbmm.default,) if biased else (aten.bmm.default, aten.baddbmm.default)
    for b1 in [n for n in g.nodes if n.target in targets]:
        if not b1.users:
            continue
        m = _Match(gm, b1, live, biased)
        if not m.run() or not _rewrite(gm, m, shared):
            continue
        done += 1
    if done:
        _sweep(g)
        gm.recompile()
    return done


def _rewrite(gm: torch.fx.GraphModule, m: _Match, shared: dict) -> bool:
    b1, b2 = m.bmm1, m.bmm2
    qa, ka = (b1.args[1], b1.args[2]) if b1.target is aten.baddbmm.default else b1.args[:2]
    N, S, D = _shape(qa)
    Skv = _shape(ka)[2]
    if _shape(ka) != (N, D, Skv) or _shape(b2.args[1])[:2] != (N, Skv):
        return False
    Dv = _shape(b2.args[1])[2]
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
        _shape(q4)[0] == _shape(k4)[0] == _shape(v4)[0] and _shape(q4)[0] * _shape(q4)[1] == N
    with g.inserting_before(b2):
        if four:
            B, H = _shape(q4)[:2]
            k4, v4 = _unrepeat(k4), _unrepeat(v4)
            if _shape(k4)[1] != _shape(v4)[1] or H % _shape(k4)[1]:
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
            ms = _shape(mask)
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
        gqa = _shape(k4)[1] != H
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
    bs = (1,) * (3 - len(_shape(m.bias))) + _shape(m.bias)
    if bs[0] == N and N > 1:
        bias = call(aten.reshape.default, m.bias, [B, H, bs[1], bs[2]])
    elif bs[0] == 1:
        bias = call(aten.reshape.default, m.bias, [1, 1, bs[1], bs[2]])
    else:
        return False
    if m.beta != 1:
        bias = call(aten.mul.Tensor, bias, m.beta)
    return bias if mask is None else call(aten.add.Tensor, bias, mask)


def capture_flash_kernel(gm: torch.fx.GraphModule) -> int:
    """``spdsl.kernels.flash_attn`` called in the model (``spdsl.flash_attn`` returning
    ``(out, lse)``) becomes one ``spdsl.attention`` node whose lowering runs the same kernel
    on each rank's heads. Calls with ``segment_ids`` or whose ``lse`` is read stay as they
    are. Returns how many were captured."""
    g = gm.graph
    done = 0
    for n in [n for n in g.nodes if n.target is torch.ops.spdsl.flash_attn.default]:
        q, k, v, seg, causal, scale = (list(n.args) + [None] * 6)[:6]
        users = list(n.users)
        if seg is not None or any(u.target is not operator.getitem or u.args[1] != 0 and
                                  not _unread(u) for u in users):
            continue
        for u in [u for u in users if u.args[1] != 0]:     # the lse nothing reads
            _erase_unread(g, u)
        users = [u for u in users if u.args[1] == 0]
        with g.inserting_before(n):
            att = g.call_function(torch.ops.spdsl.attention.default,
                                  (q, k, v, None, 0.0, bool(causal), scale,
                                   _shape(k)[1] != _shape(q)[1]))
        att.meta.update(val=users[0].meta["val"] if users else None, **{
            key: n.meta[key] for key in ("stack_trace", "spdsl_module") if key in n.meta})
        att.meta[FORM] = "flash_kernel"
        for u in users:
            u.replace_all_uses_with(att)
            g.erase_node(u)
        g.erase_node(n)
        done += 1
    if done:
        gm.recompile()
    return done


def _unread(n: torch.fx.Node) -> bool:
    """Nothing reads ``n`` but detaches nothing reads (what autograd's saving leaves)."""
    return all(u.target is aten.detach.default and _unread(u) for u in n.users)


def _erase_unread(g: torch.fx.Graph, n: torch.fx.Node) -> None:
    for u in list(n.users):
        _erase_unread(g, u)
    g.erase_node(n)
