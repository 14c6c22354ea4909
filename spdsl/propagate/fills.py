"""A fresh buffer filled slice by slice becomes the ``cat`` of what was copied in.

DeepSeek-V2 builds its keys as::

    key_states = k_pass.new_empty(B, H, S, d_nope + d_rope)
    key_states[..., :d_nope].copy_(k_pass)
    key_states[..., d_nope:].copy_(k_rot)          # k_rot: one head, broadcast to every head

Traced, the keys are the ``new_empty`` node and the writes are side effects on two of its
slices. Propagation gives a fresh buffer no split of its own (it has no input to follow), so the
sequence-split pieces were gathered into it on every rank: three all-gathers a layer forward
and one backward, 1.7x the Ulysses floor at the tiny test shape, and a whole-sequence key
tensor per rank. As ``cat([k_pass, k_rot.expand(...)], -1)`` the keys are a value like any
other: split along the sequence as their pieces are, and moved by the attention's one
all-to-all.

Rewritten only when the slices along one dim tile the buffer exactly (step 1, in order, no
overlap), each slice is written once by ``copy_`` and read by nothing else, and every other
reader of the buffer comes after the last write; anything else is left as traced (exact, as
before). ``copy_`` broadcasts and casts its source: the ``cat`` operands are expanded and cast
to the slice.
"""

from __future__ import annotations

import torch

from spdsl._torch import detect_fake_mode

aten = torch.ops.aten
_FRESH = (aten.new_empty.default, aten.empty.memory_format, aten.empty_like.default)


def fills_as_cat(gm: torch.fx.GraphModule) -> int:
    """Rewrite every buffer filled by slice copies (see the module docstring); the number
    rewritten."""
    done = 0
    for buf in [n for n in gm.graph.nodes if n.target in _FRESH]:
        done += _rewrite(gm, buf)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _rewrite(gm: torch.fx.GraphModule, buf: torch.fx.Node) -> int:
    val = buf.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    writes, dead, readers = [], [], []
    for u in buf.users:
        if u.target is aten.slice.Tensor and u.args[0] is buf:
            if not u.users:
                dead.append(u)
                continue
            (c,) = list(u.users) if len(u.users) == 1 else (None,)
            if c is None or c.target is not aten.copy_.default or c.args[0] is not u or \
                    len(c.args) != 2 or c.users:
                return 0
            writes.append((u, c))
        else:
            readers.append(u)
    if not writes or not readers:
        return 0
    dim = writes[0][0].args[1] % val.dim()
    spans = []
    for s, c in writes:
        a = list(s.args) + [None] * (5 - len(s.args))
        if a[1] % val.dim() != dim or (a[4] not in (None, 1)):
            return 0
        lo = 0 if a[2] is None else a[2]
        hi = val.shape[dim] if a[3] is None else min(a[3], val.shape[dim])
        spans.append((lo, hi, s, c))
    spans.sort(key=lambda t: t[0])
    at = 0
    for lo, hi, _s, _c in spans:
        if lo != at or hi <= lo:
            return 0
        at = hi
    last = max(order[c] for _lo, _hi, _s, c in spans)
    if at != val.shape[dim] or any(order[r] < last for r in readers):
        return 0
    g = gm.graph
    fake = detect_fake_mode([val])

    def call(target, *args, **kwargs) -> torch.fx.Node:
        node = g.call_function(target, args, kwargs)
        vals = torch.fx.node.map_arg(args, lambda x: x.meta["val"])
        with fake:
            node.meta["val"] = target(*vals, **kwargs)
        node.meta.update({k: buf.meta[k] for k in ("stack_trace", "spdsl_module")
                          if k in buf.meta})
        return node

    first = min(readers, key=order.get)
    with g.inserting_before(first):
        parts = []
        for _lo, _hi, s, c in spans:
            src, shape = c.args[1], list(s.meta["val"].shape)
            if list(src.meta["val"].shape) != shape:
                src = call(aten.expand.default, src, shape)
            if src.meta["val"].dtype != val.dtype:
                src = call(aten._to_copy.default, src, dtype=val.dtype)
            parts.append(src)
        cat = call(aten.cat.default, parts, dim)
    for r in readers:
        r.replace_input_with(buf, cat)
    for _lo, _hi, s, c in spans:
        g.erase_node(c)
        g.erase_node(s)
    for s in dead:
        g.erase_node(s)
    g.erase_node(buf)
    return 1
