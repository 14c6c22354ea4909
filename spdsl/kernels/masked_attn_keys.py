"""Masked attention on ATen's fused CPU flash attention, for the masks it can take whole: a
causal triangle (the ``causal`` flag, or ``key_pos <= query_pos`` in the program) and a
boolean function of key-side values only (a padding flag ``[B, 1, 1, S]``, constants).

Hugging Face's SDPA mask for a padded batch is such a program: ``(kv_idx <= q_idx) & pad``.
The block kernel (``spdsl.kernels.masked_attn``) runs it a block of queries and keys at a
time in PyTorch ops, several times slower than the fused kernel; here the key-side part
becomes one additive ``[B, H | 1, 1, S_k]`` row (0 kept, -inf not), which the fused kernel
broadcasts over the queries (its ``attn_mask`` strides), and the triangle its ``is_causal``:
no ``[S, S]`` value, the kernel's own skipping of the upper blocks, 4-5x the block kernel's
speed (``bench/RESULTS.md``). Rows that keep no key (left padding) give zeros and zero
gradients, as the block kernel's boolean masks do.

``SPDSL_MASK_FUSED=0`` (or ``FUSED = False`` here) sends every mask to the block kernel.

Packed sequences (a term ``query_doc == key_doc`` of per-token ids, Hugging Face's mask for
``position_ids`` that restart) run one kernel call per document over its own tokens, when the
ids form runs (each id one stretch of the row): the scores between documents are never
computed, ``sum L_i^2`` work instead of ``S^2``.

Hugging Face's additive (eager) masks, ``where(keep, 0, finfo.min)``, are ``keep`` on every row
that keeps a key. A row that keeps none (left padding) has every score plus ``finfo.min``
equal to ``finfo.min`` (when the scores are under a quarter of the floats' spacing there,
checked from the largest norms of q and k), so it averages every value, causal ones
included: the kernel leaves those rows zero and they are added in closed form, forward (the
mean of the values) and backward (sums through ``[D, D]`` products); where the scores could
move the masked value (fp16's min), such a batch runs on the block kernel.

Sliding windows (``key_pos > query_pos - W`` beside the triangle, Hugging Face's
``sliding_window`` masks, or ``query_pos - key_pos < W``) run as blocks of ``W - 1`` query rows,
each two causal kernel calls: the block against its own keys (the triangle), and against the
``W - 1`` keys before it, where the window keeps key ``t`` for row ``r`` when ``t >= r``: the
triangle again once both are read backwards (``flip``). The two partial softmaxes merge by
their log-sum-exp, and backward runs the kernel's backward on each with the merged output and
log-sum-exp: ``S * W`` work and scratch of one block, no mask tensor. Windows under
:data:`MIN_WINDOW` keys (many tiny calls) stay on the block kernel.

A window over packed documents runs the window's blocks inside each document longer than it
(the window counts from the row's index, the same inside a document), the others whole.

Not taken here, to the block kernel: other additive (float) programs, masks
that read other query-side values than positions, documents and a window's start (ALiBi),
positions that are not ``0..S-1`` on every batch row, GPU tensors (FlexAttention), a value
head size other than the query's.

Here the recognition: :func:`split` reads the mask program into a :class:`KeyMask`, or None
for the block kernel. ``masked_attn_keys_cpu`` runs a :class:`KeyMask` forward and backward on
the fused kernel, ``masked_attn_keys_workspace`` gives its scratch to the memory planner.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

import spdsl.env as env
from spdsl.kernels.masked_attn import mask_program, softcap_of, typed_leaves

aten = torch.ops.aten
FUSED = env.on("SPDSL_MASK_FUSED")
_AND = {aten.bitwise_and.Tensor, aten.logical_and.default, operator.and_}
# (key position's argument, query position's argument): keep k <= q, the causal triangle
_CAUSAL = {aten.le.Tensor: (0, 1), aten.ge.Tensor: (1, 0), operator.le: (0, 1),
           operator.ge: (1, 0)}


_EQ = {aten.eq.Tensor, operator.eq}
# window's start: (key argument's index, keys from the start on (>=) or after it (>))
_START = {aten.gt.Tensor: (0, False), operator.gt: (0, False), aten.ge.Tensor: (0, True),
          operator.ge: (0, True), aten.lt.Tensor: (1, False), operator.lt: (1, False),
          aten.le.Tensor: (1, True), operator.le: (1, True)}
# query_pos - key_pos below (<) or at most (<=) a constant
_WIDTH = {aten.lt.Scalar: False, aten.lt.Tensor: False, operator.lt: False,
          aten.le.Scalar: True, aten.le.Tensor: True, operator.le: True}
_SUB = {aten.sub.Tensor, operator.sub}
MIN_WINDOW = 8


@dataclass(frozen=True)
class KeyMask:
    """``causal``: the triangle; ``bias``: the additive key row ``[B|1, H|1, 1, S_k]`` in the
    query's dtype, or None (no key-side mask); ``documents``: the mask keeps each token to
    its own document, runs of equal ids (packed sequences): per batch row (one row: every
    row alike) the documents' starts and the row's end, or ``()`` where only the program and
    the shapes decided it (planning: one document as long as the row, the most scratch);
    ``additive``: the program was Hugging Face's eager ``where(keep, 0, min)``; ``window``:
    with the triangle, row ``i`` keeps keys ``i - window + 1 .. i`` only (0 where the
    planner decided without the values: its size unknown); ``averaged``: an additive mask's
    query rows that keep no key ``[B | 1, H | 1, S_q, 1]``, which average every value (their
    scores all the masked value), or None."""

    causal: bool
    bias: torch.Tensor | None
    documents: tuple | None = None
    additive: bool = False
    window: int | None = None
    averaged: torch.Tensor | None = None


# an additive program's "masked" value: at or below it, exp(value + score - row max) is 0 in
# fp32 for any score gap under 65,000, exactly what leaving the key out gives (fp16's min)
_MASKED = float(torch.finfo(torch.float16).min)


def split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list, program_key: str,
          causal: bool, values: bool = True, scale: float | None = None) -> KeyMask | None:
    """The mask as a causal flag and a key row, or None where the fused kernel cannot take
    it (see the module docstring). ``values=False``: decide by the program and the shapes
    only, not by the positions' values (the memory planner, on fake tensors: positions that
    turn out not to be ``0..S-1`` run the block kernel instead). ``scale``: the attention's,
    for an additive mask's rows that keep no key (see :func:`_flat`)."""
    if not FUSED or q.device.type not in ("cpu", "meta") or v.shape[-1] != q.shape[-1] or \
            softcap_of(program_key) is not None:        # capped scores: the block kernel's
        return None
    s_q, s_k = q.shape[2], k.shape[2]
    if not program_key:
        return KeyMask(causal, None) if not causal or s_q == s_k else None
    fn = mask_program(program_key)
    graph = getattr(fn, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return None
    leaves = typed_leaves(program_key, leaves)
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    if len(phs) != len(leaves):
        return None
    value = dict(zip(phs, leaves))
    query_side = {p for p, t in value.items() if t.dim() == 4 and t.shape[2] > 1}
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    if not isinstance(out, torch.fx.Node):
        return None
    additive = _additive(out, value, values)
    if additive is not None:
        masked, out = value[out.args[2]], additive
    hard_causal = causal                    # the flag: keys after the query are left out
    keys: list[torch.fx.Node] = []
    docs = window = None
    for term in _conjuncts(out):
        if not _ancestors(term) & query_side:
            keys.append(term)
        elif _is_causal(term, value, query_side, s_q, s_k, values):
            causal = True
        elif docs is None and s_q == s_k and _same_document(term, value, query_side, s_q):
            docs = _same_document(term, value, query_side, s_q)
        elif window is None and (w := _window(term, value, query_side, s_q, s_k,
                                              values)) is not None:
            window = w
        else:
            return None
    if causal and s_q != s_k:
        return None
    if window is not None:
        if not causal:
            return None
        if (values or window) and window >= s_q:    # the width known (a value, or in the
            window = None                           # program): every row's reaches key 0
        elif (values or window) and window < MIN_WINDOW:
            return None
    if docs is not None:
        docs = _runs(*docs, q.shape[0]) if values else ()
        if docs is None:
            return None
    keep = None
    for term in keys:
        t = _evaluate(term, value)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bool or \
                (t.dim() == 4 and t.shape[2] != 1) or t.dim() > 4:
            return None
        keep = t if keep is None else keep & t
    if keep is not None and values and bool(keep.all()):
        keep = None                     # every key kept (a constant True term): no row at all
    if keep is None:
        return KeyMask(causal, None, docs, additive is not None, window)
    keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
    if keep.shape[3] not in (1, s_k) or keep.shape[0] not in (1, q.shape[0]) or \
            keep.shape[1] not in (1, q.shape[1]):
        return None                                 # not a row the kernel can broadcast
    averaged = None
    if additive is not None and values:
        averaged = _rows_keeping_nothing(keep, causal, docs, s_k, window)
        # a row keeping no key averages every value the flag leaves in: all (the closed
        # form's), or with the flag the keys up to the row (each row its own: the blocks')
        if averaged is not None and (hard_causal or not _flat(q, k, float(masked), scale)):
            return None
    bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill_(
        keep.logical_not(), float("-inf"))
    return KeyMask(causal, bias.expand(*bias.shape[:3], s_k), docs, additive is not None,
                   window, averaged)


def _additive(out: torch.fx.Node, value: dict, values: bool) -> torch.fx.Node | None:
    """``where(keep, 0, masked)`` (Hugging Face's eager mask) with constant leaves, 0 and a
    value at or below :data:`_MASKED`: the boolean ``keep``, else None. The same as ``keep``
    on every row that keeps a key (see :func:`_rows_keeping_nothing` for the others)."""
    if out.op != "call_function" or out.target is not aten.where.self or len(out.args) != 3:
        return None
    cond, zero, masked = out.args
    if not all(isinstance(a, torch.fx.Node) and a.op == "placeholder" for a in (zero, masked)):
        return None
    z, m = value[zero], value[masked]
    if z.numel() != 1 or m.numel() != 1 or not z.is_floating_point():
        return None
    if values and not (float(z) == 0.0 and float(m) <= _MASKED):
        return None
    return cond if isinstance(cond, torch.fx.Node) else None


def _rows_keeping_nothing(keep, causal: bool, docs, s: int, window: int | None = None):
    """Query rows that keep no key, ``[B | 1, H | 1, S, 1]``, or None where each keeps one
    (``keep``: the key row ``[B | 1, H | 1, 1, S | 1]``). Row ``i`` sees keys from its
    document's start (0 without documents; with a window, ``i - window + 1``) up to ``i``
    (causal) or its document's end."""
    rows = keep.expand(*keep.shape[:3], s)[:, :, 0, :]          # [B | 1, H | 1, S_k]
    counts = torch.nn.functional.pad(rows.to(torch.int64).cumsum(-1), (1, 0))
    i = torch.arange(s, device=rows.device)
    bounds = docs or ((0, s),)
    lo = torch.stack([torch.repeat_interleave(torch.tensor(r[:-1], device=rows.device),
                                              torch.tensor(r).diff().to(rows.device))
                      for r in bounds])                                  # [1 | B, S]
    hi = torch.stack([torch.repeat_interleave(torch.tensor(r[1:], device=rows.device),
                                              torch.tensor(r).diff().to(rows.device))
                      for r in bounds])
    if causal:
        hi = (i + 1).expand_as(hi)
    if window:
        lo = torch.maximum(lo, i - window + 1)
    b, h = max(counts.shape[0], lo.shape[0]), counts.shape[1]
    counts = counts.expand(b, h, s + 1)
    kept = counts.gather(-1, hi[:, None].expand(b, h, s)) - \
        counts.gather(-1, lo[:, None].expand(b, h, s))
    empty = kept == 0
    return empty.unsqueeze(-1) if bool(empty.any()) else None


def _flat(q: torch.Tensor, k: torch.Tensor, masked: float, scale: float | None) -> bool:
    """Whether every score plus the masked value is the masked value in q's dtype: each
    ``|q . k| * scale`` under a quarter of the spacing of floats there (bounded by the largest
    norms), so a row that keeps no key has all its scores equal and averages every value."""
    m = torch.tensor(masked, dtype=q.dtype)
    spacing = float((torch.nextafter(m, torch.zeros_like(m)) - m).abs())
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    wide = torch.promote_types(q.dtype, torch.float32)
    largest = float(torch.linalg.vector_norm(q.detach(), dim=-1, dtype=wide).max()) * \
        float(torch.linalg.vector_norm(k.detach(), dim=-1, dtype=wide).max())
    return largest * abs(scale) < spacing / 4


def _same_document(term: torch.fx.Node, value: dict, query_side: set, s: int):
    """``query_id == key_id`` of two per-token leaves ``[B|1, 1, S, 1]`` and ``[B|1, 1, 1, S]``:
    (the query's ids, the key's), else None."""
    if term.op != "call_function" or term.target not in _EQ or len(term.args) != 2 or \
            not all(isinstance(a, torch.fx.Node) and a.op == "placeholder" for a in term.args):
        return None
    a, b = term.args
    qp, kp = (a, b) if a in query_side else (b, a)
    if qp not in query_side or kp in query_side:
        return None
    qt, kt = value[qp], value[kp]
    if qt.dim() != 4 or kt.dim() != 4 or qt.shape[1:] != (1, s, 1) or \
            kt.shape[1:] != (1, 1, s) or qt.shape[0] != kt.shape[0]:
        return None
    return qt, kt


def _runs(qt: torch.Tensor, kt: torch.Tensor, batch: int):
    """Each batch row's documents as runs of equal ids: per row (one: every row alike) the
    runs' starts and the row's end; None where the query's and the key's ids differ or an id
    comes back after another (its tokens would see each other across the gap)."""
    ids = kt[:, 0, 0, :]
    if not torch.equal(qt[:, 0, :, 0], ids) or ids.shape[0] not in (1, batch):
        return None
    rows = []
    for row in ids:
        starts = (torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()
        if len(starts) + 1 != row.unique().numel():
            return None
        rows.append((0, *starts, row.numel()))
    return tuple(rows)


def _conjuncts(n: torch.fx.Node) -> list[torch.fx.Node]:
    if n.op == "call_function" and n.target in _AND and len(n.args) == 2 and \
            all(isinstance(a, torch.fx.Node) for a in n.args):
        return _conjuncts(n.args[0]) + _conjuncts(n.args[1])
    return [n]


def _ancestors(n: torch.fx.Node) -> set[torch.fx.Node]:
    seen, todo = set(), [n]
    while todo:
        x = todo.pop()
        if x not in seen:
            seen.add(x)
            todo += x.all_input_nodes
    return seen


def _is_causal(term: torch.fx.Node, value: dict, query_side: set, s_q: int, s_k: int,
               values: bool) -> bool:
    """``key_pos <= query_pos`` with both the positions ``0..S-1`` on every row."""
    if term.op != "call_function" or term.target not in _CAUSAL or len(term.args) != 2:
        return False
    ki, qi = _CAUSAL[term.target]
    kp, qp = term.args[ki], term.args[qi]
    if not (isinstance(kp, torch.fx.Node) and isinstance(qp, torch.fx.Node) and
            kp.op == "placeholder" and qp.op == "placeholder" and qp in query_side and
            kp not in query_side):
        return False
    kt, qt = value[kp], value[qp]
    if kt.dim() != 4 or qt.dim() != 4 or kt.shape[1:3] != (1, 1) or qt.shape[1] != 1 or \
            qt.shape[3] != 1 or kt.shape[3] != s_k or qt.shape[2] != s_q:
        return False
    if not values:
        return True
    return bool((kt[:, 0, 0, :] == torch.arange(s_k, device=kt.device)).all()) and \
        bool((qt[:, 0, :, 0] == torch.arange(s_q, device=qt.device)).all())


def _window(term: torch.fx.Node, value: dict, query_side: set, s_q: int, s_k: int,
            values: bool) -> int | None:
    """The window's width ``W`` (row ``i`` keeps keys after ``i - W``) of a term
    ``key_pos > start`` (``>=``, or the other way round) with ``start`` a query-side leaf
    ``query_pos - W`` (Hugging Face's sliding-window overlay), or ``query_pos - key_pos < W``
    (``<=``) with a constant ``W``; positions ``0..S-1``. 0 without the values (the planner);
    None for any other term."""
    if term.op != "call_function" or len(term.args) != 2:
        return None
    if term.target in _START and all(isinstance(a, torch.fx.Node) and a.op == "placeholder"
                                     for a in term.args):
        ki, inclusive = _START[term.target]
        kp, start = term.args[ki], term.args[1 - ki]
        if kp in query_side or start not in query_side:
            return None
        kt, st = value[kp], value[start]
        if not _key_positions(kt, s_k) or st.dim() != 4 or st.shape[1:] != (1, s_q, 1):
            return None
        if not values:
            return 0
        width = torch.arange(s_q, device=st.device) - st[:, 0, :, 0] + int(inclusive)
        if not _positions(kt[:, 0, 0, :], s_k) or not bool((width == width[0, 0]).all()):
            return None
        return int(width[0, 0])
    if term.target not in _WIDTH:
        return None
    diff, bound = term.args
    if not (isinstance(diff, torch.fx.Node) and diff.op == "call_function" and
            diff.target in _SUB and len(diff.args) == 2 and
            all(isinstance(a, torch.fx.Node) and a.op == "placeholder" for a in diff.args)):
        return None
    qp, kp = diff.args
    if qp not in query_side or kp in query_side:
        return None
    if isinstance(bound, torch.fx.Node):
        if bound.op != "placeholder" or value[bound].numel() != 1:
            return None
        bound = value[bound]
    kt, qt = value[kp], value[qp]
    if not _key_positions(kt, s_k) or qt.dim() != 4 or qt.shape[1:] != (1, s_q, 1):
        return None
    if values and not (_positions(kt[:, 0, 0, :], s_k) and _positions(qt[:, 0, :, 0], s_q)):
        return None
    if isinstance(bound, torch.Tensor) and not values:
        return 0                                    # a leaf: its value unknown to the planner
    bound = float(bound)
    if bound != int(bound):
        return None
    return int(bound) + int(_WIDTH[term.target])


def _key_positions(kt: torch.Tensor, s_k: int) -> bool:
    return kt.dim() == 4 and kt.shape[1:3] == (1, 1) and kt.shape[3] == s_k


def _positions(t: torch.Tensor, s: int) -> bool:
    """Every row ``0..s-1``."""
    return bool((t == torch.arange(s, device=t.device)).all())


def _evaluate(term: torch.fx.Node, value: dict):
    """The key-side term's value: its ancestors run on the leaves (all key-side, small)."""
    order = {n: i for i, n in enumerate(term.graph.nodes)}
    env = dict(value)
    for n in sorted(_ancestors(term), key=order.__getitem__):
        if n.op == "call_function":
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
            env[n] = n.target(*args, **kwargs)
        elif n.op != "placeholder":
            return None
    return env[term]
