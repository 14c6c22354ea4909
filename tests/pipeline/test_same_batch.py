"""``spdsl.pipeline.same_batch``'s helpers (the same-inputs checksum, the names an error gives
arguments), placements as DTensor placements (``spdsl.pipeline.run``), and the check's entry in
the plan (``Sharded._check_collectives``). The check itself across ranks:
``tests/annotate/test_same_inputs.py``."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import spdsl
from spdsl.pipeline.run import _dtensor_placement
from spdsl.pipeline.same_batch import _checksum, _leaf_names
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
    def f(x, n, y):
        return x.sum() + y.sum()
    leaves = [torch.zeros(2), 3, torch.zeros(5)]
    (c,) = spdsl.Sharded(f, parts=4, seq_dim=0)._check_collectives(leaves)
    assert (c.kind, c.bytes) == ("all_reduce", 32)
    debug = spdsl.Sharded(f, parts=4, seq_dim=0, debug=True)
    assert debug._check_collectives(leaves)[0].kind == "all_gather"
    assert spdsl.Sharded(f, parts=1, seq_dim=0)._check_collectives(leaves) == ()
