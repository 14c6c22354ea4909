"""The functional collectives under the watchdog (numbered where issued, waited with a bound),
complex tensors sent as their real pairs: what every autograd collective calls in forward and
backward."""

from __future__ import annotations

import torch

import spdsl.watchdog as watchdog
from spdsl._torch import all_gather_single, reduce_scatter_single
from spdsl._torch import functional_collectives as fc


def _pairs(x: torch.Tensor) -> torch.Tensor:
    """Complex tensors (rotary tables as ``torch.polar``, DeepSeek-V2's rotated q/k) travel as
    their real pairs: gloo and NCCL have no complex types, and the pairs (a trailing dim of 2)
    split along the same leading dims, so they pack beside real tensors too."""
    return torch.view_as_real(x) if x.is_complex() else x


def _unpairs(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.view_as_complex(y.contiguous()) if like.is_complex() else y


def _issued(kind: str, nbytes: int, group: str, even: bool = True) -> int:
    """The collective about to be issued numbered (``watchdog.issued``) and, under the order
    check (``debug=True``), first compared across the group (``watchdog.check_order``): its
    number, kind and, when ``even`` (every rank of the group sends as many bytes as this one),
    bytes, all-gathered. The gather is watched too: a rank that issues nothing more (it skipped
    a collective) never joins it."""
    number = watchdog.issued(kind, nbytes, group)
    if number and watchdog.checks_order():
        mine = watchdog.order_entry(number, kind, nbytes if even else -1)
        every = watchdog.wait(all_gather_single(mine, 0, group), number,
                              f"{kind}'s order check", mine.numel() * mine.element_size(), group)
        watchdog.check_order(mine, every)
    return number


def _run(kind: str, x: torch.Tensor, group: str, issue, even: bool = True) -> torch.Tensor:
    """``issue(x)`` (a functional collective) numbered and waited under the watchdog;
    ``even``: every rank of the group sends as many bytes as this one."""
    nbytes = x.numel() * x.element_size()
    number = _issued(kind, nbytes, group, even)
    return watchdog.wait(issue(x), number, kind, nbytes, group)


def _a2a_raw(buf: torch.Tensor, group: str, out_splits=None, in_splits=None) -> torch.Tensor:
    got = _run("all_to_all", _pairs(buf).contiguous(), group,
               lambda b: fc.all_to_all_single(b, out_splits, in_splits, group),
               even=out_splits is None and in_splits is None)
    return _unpairs(got, buf)


def _all_reduce_raw(x: torch.Tensor, group: str) -> torch.Tensor:
    return _unpairs(_run("all_reduce", _pairs(x).contiguous(), group,
                         lambda b: fc.all_reduce(b, "sum", group)), x)


def _all_gather_raw(x: torch.Tensor, group: str) -> torch.Tensor:
    """[n, ...] on each rank -> [P*n, ...], rank order."""
    return _unpairs(_run("all_gather", _pairs(x).contiguous(), group,
                         lambda b: all_gather_single(b, 0, group)), x)


def _reduce_scatter_raw(buf: torch.Tensor, group: str) -> torch.Tensor:
    """[P*n] summed over the ranks, this rank's n."""
    return _run("reduce_scatter", buf, group, lambda b: reduce_scatter_single(b, "sum", 0, group))


def made_whole(x: torch.Tensor, group: str, dim: int | None = None) -> torch.Tensor:
    """A piece made whole as ``DTensor.full_tensor`` makes it: a partial sum all-reduced
    (``dim`` None), a split value all-gathered along ``dim``; no autograd, no watchdog. What the
    memory planner replays of a read of a segmented forward (``spdsl.annotate.segments_memory``,
    on fake tensors and a planning group)."""
    if dim is None:
        return fc.wait_tensor(fc.all_reduce(x, "sum", group))
    return fc.wait_tensor(all_gather_single(x, dim, group))
