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
