"""Tiled logits + loss: never materialise the ``[tokens, vocab]`` logits.

The pattern in a local graph: ``mm(h, W^T)`` (the LM head), then only row selections
(reshapes, the label-shift slice or its halo window, a float cast), then ``log_softmax`` and
the NLL (``nll_loss_forward``, or spdsl's global-mean ``nll_mean`` when the sequence is split).
Row selections commute with a per-row matmul, so they are applied to ``h`` instead (``D``
columns, not ``V``), and the head + loss run through the chunked fused linear cross-entropy
(``spdsl.kernels.fused_linear_cross_entropy``: Triton on GPU, chunked + checkpointed
reference elsewhere). The sum and valid count are the same numbers the NLL reduces, so the
mean — and, split, the all-reduced global mean — is exact.
"""

from __future__ import annotations

import torch

import spdsl.collectives as C
from spdsl.kernels.fused_linear_ce import fused_linear_cross_entropy
from spdsl.lower import ops

aten = torch.ops.aten
_VIEWS = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}
_ROW_OPS = {aten.reshape.default, aten.view.default, aten._unsafe_view.default,
            aten.slice.Tensor, aten._to_copy.default, aten.clone.default, C.window}


def tiled_nll(h: torch.Tensor, wt: torch.Tensor, target: torch.Tensor, reduction: int,
              ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``nll_loss_forward(log_softmax(h @ wt), target)`` without the logits: (loss, weight)."""
    total, count = fused_linear_cross_entropy(h, wt.t(), target, ignore_index=ignore_index)
    count = count.to(total.dtype)
    return (total / count if reduction == 1 else total), count


def tiled_nll_mean(h: torch.Tensor, wt: torch.Tensor, target: torch.Tensor, ignore_index: int,
                   group: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.nll_mean`` of the chunked head: all-reduce (local sum, local count), divide."""
    total, count = fused_linear_cross_entropy(h, wt.t(), target, ignore_index=ignore_index)
    both = C.all_reduce(torch.stack([total, count.to(total.dtype)]), group)
    return both[0] / both[1], both[1]


def find_loss(gm: torch.fx.GraphModule) -> dict | None:
    """The head + loss pattern, or None: ``{"mm", "chain", "logsm", "nll"}``."""
    for ls in gm.graph.nodes:
        if ls.target is not aten._log_softmax.default or ls.args[1] not in (-1, 1):
            continue
        users = [u for u in ls.users if u.target is not aten.detach.default]
        if len(users) != 1 or users[0].target not in (aten.nll_loss_forward.default,
                                                      ops.nll_mean):
            continue
        nll = users[0]
        if nll.args[2] is not None or (nll.target is ops.nll_mean and nll.args[5]):
            continue        # class weights or 2-d NLL: leave it alone
        if nll.target is aten.nll_loss_forward.default and nll.args[3] not in (1, 2):
            continue        # reduction="none"
        chain, cur = [], ls.args[0]
        while cur.target in _ROW_OPS and len(cur.users) == 1:
            chain.append(cur)
            cur = cur.args[0]
        if cur.target is not aten.mm.default or len(cur.users) != 1:
            continue
        vocab = cur.meta["val"].shape[-1]
        if any(not _row_op(n, vocab) for n in chain):
            continue
        return {"mm": cur, "chain": chain[::-1], "logsm": ls, "nll": nll}
    return None


def _row_op(n: torch.fx.Node, vocab: int) -> bool:
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.shape[-1] != vocab:
        return False
    if n.target in (aten.slice.Tensor, C.window):
        return n.args[1] % val.dim() != val.dim() - 1      # rows only, never the vocab dim
    return True


def tile_loss(gm: torch.fx.GraphModule, found: dict) -> None:
    """Rewrite the pattern ``found`` (from :func:`find_loss`) in place."""
    mm, nll = found["mm"], found["nll"]
    h, wt = mm.args
    hidden = h.meta["val"].shape[-1]
    g = gm.graph
    with g.inserting_before(nll):
        cur = h
        for n in found["chain"]:
            if n.target in (aten._to_copy.default, aten.clone.default):
                continue    # the fused loss upcasts each logits chunk itself
            args = list(n.args)
            args[0] = cur
            if n.target in _VIEWS:
                args[1] = list(args[1][:-1]) + [hidden]
            # the contiguity clone is gone: a view of the chunk becomes a reshape
            target = aten.reshape.default if n.target in _VIEWS else n.target
            cur = g.call_function(target, tuple(args), dict(n.kwargs))
            cur.meta["spdsl_module"] = n.meta.get("spdsl_module", "")
        if nll.target is ops.nll_mean:
            new = g.call_function(tiled_nll_mean, (cur, wt, nll.args[1], nll.args[3],
                                                   nll.args[4]))
        else:
            new = g.call_function(tiled_nll, (cur, wt, nll.args[1], nll.args[3], nll.args[4]))
        new.meta["spdsl_module"] = nll.meta.get("spdsl_module", "")
    nll.replace_all_uses_with(new)
    g.erase_node(nll)
    for n in [u for u in found["logsm"].users]:
        g.erase_node(n)     # the unused detach autograd left beside log_softmax
    for n in [found["logsm"], *found["chain"][::-1], mm]:
        g.erase_node(n)
