"""An all-to-all in flight: issued at one point, waited at a later one
(``all_to_all_many_start``).

Two autograd Functions around the functional op and its wait, so that whatever runs between the
issue and the wait (another head group's attention) overlaps the transfer; on gloo the transfer
runs on the backend's threads. Backward mirrors forward: the wait's backward issues the reverse
all-to-all of the gradient, the issue's backward waits for it, and the autograd engine (highest
sequence number first) runs the backward of what ran in between in between.
"""

from __future__ import annotations

import torch

import spdsl.watchdog as watchdog
from spdsl._torch import c10d_functional
from spdsl.collectives.moves import _packed, _unpack
from spdsl.collectives.order import _after, _before, _ordered
from spdsl.collectives.raw import _issued, _pairs


def _a2a_issue(buf: torch.Tensor, parts: int, group: str) -> torch.Tensor:
    buf = buf.contiguous()
    sizes = [buf.shape[0] // parts] * parts
    _issued("all_to_all", buf.numel() * buf.element_size(), group)
    return c10d_functional.all_to_all_single(buf, sizes, sizes, group)


def _a2a_wait(got: torch.Tensor, group: str) -> torch.Tensor:
    # numbered where it was issued; 0 here: the wait of an exchange in flight
    return watchdog.wait(got, 0, "all_to_all", got.numel() * got.element_size(), group)


class _AllToAllIssue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buf: torch.Tensor, parts: int, group: str):
        ctx.group = group
        return _a2a_issue(buf, parts, group)         # not filled until waited

    @staticmethod
    def backward(ctx, grad):
        return _a2a_wait(grad, ctx.group), None, None


class _AllToAllWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tok, got: torch.Tensor, parts: int, group: str):
        ctx.args = (parts, group)
        return _after(ctx, tok, _a2a_wait(got, group))

    @staticmethod
    def backward(ctx, grad, _):
        return _before(ctx, grad), _a2a_issue(grad, *ctx.args), None, None


class PendingAllToAll:
    """An ``all_to_all_many`` issued by :func:`all_to_all_many_start`; :meth:`wait` gives its
    results. Wait once, on every rank in the same order as the issues."""

    def __init__(self, got: torch.Tensor, xs: list[torch.Tensor], srcs, dsts, sizes: list[int],
                 parts: int, group: str) -> None:
        # shapes and dtypes only: holding the tensors would keep them alive until the wait
        self._got, self._shapes = got, [list(_pairs(x).shape) for x in xs]
        self._complex = [x.is_complex() for x in xs]
        self._srcs, self._dsts, self._sizes = list(srcs), list(dsts), sizes
        self._parts, self._group = parts, group

    def wait(self) -> list[torch.Tensor]:
        parts = self._parts
        got = _ordered(_AllToAllWait, self._got, parts, self._group).reshape(parts, -1)
        pieces = torch.split(got, self._sizes, dim=1) if len(self._sizes) > 1 else [got]
        out = [_unpack(p, shape, s, d, parts)
               for p, shape, s, d in zip(pieces, self._shapes, self._srcs, self._dsts)]
        return [torch.view_as_complex(y.contiguous()) if c else y
                for y, c in zip(out, self._complex)]


def all_to_all_many_start(xs: list[torch.Tensor], srcs, dsts, parts: int,
                          group: str) -> PendingAllToAll:
    """``all_to_all_many`` issued now and finished by ``.wait()``: the same buffer, the same
    results (bit for bit), but the work between the two calls runs while the exchange is in
    flight, and in backward the gradients' reverse exchange is in flight during the backward
    of that work. Under ``torch.compile`` the issue and the wait are the graph's
    ``all_to_all_single`` and ``wait_tensor`` nodes, in that order.

    Example::

        a = all_to_all_many_start([q0, k0, v0], [(2, 1)] * 3, [(1, 1)] * 3, 4, group)
        b = all_to_all_many_start([q1], [(2, 1)], [(1, 1)], 4, group)
        q0h, k0h, v0h = a.wait()          # b is in flight while group 0 attends
    """
    buf, sizes = _packed([_pairs(x) for x in xs], dsts, parts)
    got = _AllToAllIssue.apply(buf, parts, group)
    return PendingAllToAll(got, xs, srcs, dsts, sizes, parts, group)

