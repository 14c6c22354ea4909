"""``spdsl.annotate.runtime``'s helpers: the same-inputs checksum, the names an error gives
arguments, placements as DTensor placements, and the check's entry in the plan."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from spdsl.annotate.runtime import (
    Runtime,
    _checksum,
    _dtensor_placement,
    _leaf_names,
)
from spdsl.propagate.placement import PARTIAL, REPLICATE
from spdsl.propagate.placement import Shard as SShard


def test_the_checksum_sees_values_and_with_full_their_order():
    x = torch.arange(6.0)
    assert torch.equal(_checksum(x, False), _checksum(x.flip(0), False))
    assert not torch.equal(_checksum(x, True), _checksum(x.flip(0), True))
    assert not torch.equal(_checksum(x, False), _checksum(x + 1e-3, False))
    nan = torch.tensor([1.0, float("nan")])
    assert torch.equal(_checksum(nan, True), _checksum(nan.clone(), True))
    assert _checksum(torch.tensor([1 + 2j]), False).item() == 3.0
    assert _checksum(torch.ones(2, dtype=torch.bfloat16), False).dtype == torch.float64


def test_leaves_are_named_by_parameter():
    def step(input_ids, labels, extra=None):
        pass
    names = _leaf_names(step, (torch.zeros(1), [torch.zeros(1), torch.zeros(1)]),
                        {"extra": torch.zeros(1)}, 4)
    assert names == ["input_ids", "labels[0]", "labels[1]", "extra"]
    assert _leaf_names(lambda *a: None, (torch.zeros(1),), {}, 1) == ["argument 0"]
    assert _leaf_names(step, (torch.zeros(1),), {}, 3) == ["input 0", "input 1", "input 2"]


def test_placements_as_dtensor_placements():
    assert _dtensor_placement(SShard(2, 1, 8)) == Shard(2)
    assert _dtensor_placement(PARTIAL) == Partial()
    assert _dtensor_placement(REPLICATE) == Replicate()


def test_the_check_is_one_small_collective_per_call():
    r = Runtime()
    r.parts, r.axis, r.debug = 4, "sp", False
    leaves = [torch.zeros(2), 3, torch.zeros(5)]
    (c,) = r._check_collectives(leaves)
    assert (c.kind, c.bytes) == ("all_reduce", 32)
    r.debug = True
    assert r._check_collectives(leaves)[0].kind == "all_gather"
    r.parts = 1
    assert r._check_collectives(leaves) == ()
