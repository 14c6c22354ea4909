"""``LiveBytes`` counts memory that exists: a tensor-wrapper subclass (a collective's
``AsyncCollectiveTensor``) reports its full size from a storage that holds nothing, so it is
counted through the tensors it wraps, once."""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.testing._internal.two_tensor import TwoTensor

from spdsl.memory import LiveBytes


def test_wrapper_counts_the_tensor_it_wraps_once():
    tracker = LiveBytes()
    with tracker:
        t = torch.ones(1000)
        # what the checkpoint cache keeps of an all-to-all's output: a detached wrapper
        kept = AsyncCollectiveTensor(t).detach()
        assert type(kept) is AsyncCollectiveTensor
        assert tracker.current == 4000        # the shell's own "storage" is not memory
        del t
        assert tracker.current == 4000        # the wrapper keeps what it wraps alive
        del kept
    assert tracker.current == 0


def test_wrapper_of_two_tensors_counts_both():
    a, b = torch.ones(1000), torch.ones(1000)
    tracker = LiveBytes()
    tracker.register([TwoTensor(a, b)], "input")
    assert tracker.current == 8000


def test_views_share_a_storage_and_dead_storages_are_freed():
    tracker = LiveBytes()
    with tracker:
        x = torch.ones(256)
        y = x.view(16, 16).t()
        assert tracker.current == 1024
        z = y.contiguous()
        assert tracker.current == 2048
        del x, y
        assert tracker.current == 1024
        del z
    assert tracker.current == 0 and tracker.peak == 2048


class _NoGradFor(torch.autograd.Function):
    """``x * 2`` whose backward gives ``w`` no gradient (None), as a planner stand-in may."""

    @staticmethod
    def forward(ctx, x, w):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2, None


def test_an_undefined_gradient_counts_nothing():
    # torch calls a post-accumulate-grad hook even when the gradient that arrived is undefined
    # (p.grad stays None): the tracker counts no gradient there and does not fail
    w = torch.nn.Parameter(torch.ones(64))
    v = torch.nn.Parameter(torch.ones(16))
    x = torch.ones(64, requires_grad=True)
    tracker = LiveBytes()
    tracker.register([w, v], "parameter")
    hooks = tracker.watch_gradients([w, v])
    with tracker:
        (_NoGradFor.apply(x, w).sum() + (v * 3).sum()).backward()
    for h in hooks:
        h.remove()
    assert w.grad is None and v.grad is not None
    assert tracker.sums["gradient"] == 16 * 4


def test_a_storage_released_on_another_thread_is_counted_until_then():
    # what gloo's worker does with a collective's buffers: it holds them until it drops its
    # work, which may be after this thread has dropped them and gone on
    import threading

    held, go = [], threading.Event()

    def worker():
        go.wait()
        held.clear()

    tracker = LiveBytes()
    with tracker:
        out = torch.ones(1000)
        held.append(out)
        kept = torch.ones(10)
        del out
        assert tracker.current == 4040          # still allocated: the other thread holds it
        t = threading.Thread(target=worker)
        t.start()
        go.set()
        t.join()
        assert tracker.current == 40
        del kept                                # released here: not counted as elsewhere
    assert tracker.peak == 4040 and tracker.current == 0
    assert tracker.released_elsewhere == 4000
