"""One order of collectives in backward, on every rank.

The autograd engine runs whatever backward is ready, highest sequence number first: two ranks
whose graphs differ beside a collective (a piece of the sequence that reads nothing of another
rank's output, a mask only one rank's piece needs) can reach their backward collectives in
different orders and wait for each other forever. So each collective of a step's forward takes
the order token of the one before it and gives its own: an empty tensor whose gradient flows
back along the chain, so that the backward of collective k runs only once the backward of
collective k + 1 has run, on every rank (reverse forward order, whatever the rest of the graph
is; a collective whose output a rank does not read still runs, on a zero gradient). The step's
output takes the last token (``tie_order``), so the last collective's backward runs on every
rank as well. Under ``torch.compile`` the compiled backward's order is the graph's.
"""

from __future__ import annotations

import contextlib

import torch

import spdsl.watchdog as watchdog


class _Order:
    active = False          # inside a step's forward (``backward_order``)
    token: torch.Tensor | None = None


@contextlib.contextmanager
def backward_order():
    """Chain the collectives issued inside (one step's forward) into one backward order.
    Nested uses (a segment of a segmented call) continue the outer chain."""
    if _Order.active or not torch.is_grad_enabled():
        yield
        return
    _Order.active, _Order.token = True, None
    try:
        yield
    finally:
        _Order.active, _Order.token = False, None


@contextlib.contextmanager
def unordered():
    """Collectives issued inside join no chain (the memory planner's run of a program on
    tensors without data, with a backward of its own, while a step's forward is chaining:
    a segment planned between two segments that ran must not tie its backward to theirs)."""
    saved = _Order.active, _Order.token
    _Order.active, _Order.token = False, None
    try:
        yield
    finally:
        _Order.active, _Order.token = saved


def _ordered(fn, *args):
    """``fn.apply(token, *args)``, its outputs without the token; the token it gives becomes
    the chain's end when any tensor argument needs a gradient."""
    chained = _Order.active and not torch.compiler.is_compiling() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    *outs, token = fn.apply(_Order.token if chained else None, *args)
    if chained:
        _Order.token = token
        watchdog.tag(token)             # its backward's collective names this op too
    return outs[0] if len(outs) == 1 else tuple(outs)


class _Tie(torch.autograd.Function):
    """A step's output, tied to the order token of its last collective."""

    @staticmethod
    def forward(ctx, tok, x: torch.Tensor):
        ctx.tok = tok.device
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros(0, device=ctx.tok), grad


def tie_order(outs):
    """``outs`` (a step's outputs, inside ``backward_order``) with the first that needs a
    gradient tied to the chain's last token, so that the backward of the step's last
    collective runs on every rank too: where a rank reads nothing of its output, nothing
    else would reach it there, while the other ranks wait in it."""
    tok = _Order.token
    if tok is None:
        return outs
    outs = list(outs)
    for i, o in enumerate(outs):
        if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point():
            outs[i] = _Tie.apply(tok, o)
            break
    return outs


def _after(ctx, tok, *outs):
    """A collective's forward outputs and its order token."""
    ctx.tok = None if tok is None else tok.device
    return (*outs, torch.empty(0, device=outs[0].device))


def _before(ctx, _grad=None):
    """The gradient of the order token a collective took (None if it took none)."""
    return None if ctx.tok is None else torch.zeros(0, device=ctx.tok)
