"""Placements over the sequence axis (``spdsl.propagate.placement``): frozen values with
constructor-like reprs, ``torch.chunk``-style pieces (uneven ones too) and the local shapes they
give, a window's re-chunking plan, the DTensor placement each is, and typed-shape printing."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard

from spdsl.propagate.placement import (
    PARTIAL,
    REPLICATE,
    Partial,
    Replicate,
    Shard,
    chunk_bounds,
    dtype_name,
    even,
    local_shape,
    shard_of,
    to_dtensor,
    typed_shape,
    window_plan,
)


def test_values_compare_hash_and_print_as_built():
    assert Replicate() == REPLICATE and Partial() == PARTIAL and REPLICATE != PARTIAL
    assert Shard(1, 1, 16) == Shard(1, 1, 16) != Shard(1, 2, 16) != Shard(1, 2, 8)
    assert len({Shard(1, 1, 16), Shard(1, 1, 16), REPLICATE, Replicate()}) == 2
    assert (repr(REPLICATE), repr(PARTIAL)) == ("Replicate()", "Partial(sum)")
    assert (repr(Shard(1, 1, 16)), repr(Shard(0, 2, 16))) == ("Shard(1)", "Shard(0, outer=2)")
    with pytest.raises(AttributeError):
        Shard(1).dim = 0                                    # frozen


def test_inner_is_what_lies_inside_the_split_factor():
    assert Shard(1, 1, 16).inner((2, 16, 8)) == 1
    assert Shard(0, 2, 16).inner((256,)) == 8               # [2 x 16@sp x 8]
    assert Shard(0, 1, 0).inner((0, 8)) == 0                # an empty split: nothing inside


@pytest.mark.parametrize("size, parts, want", [
    (16, 4, [(0, 4), (4, 8), (8, 12), (12, 16)]),
    (15, 4, [(0, 4), (4, 8), (8, 12), (12, 15)]),           # the last rank short
    (9, 4, [(0, 3), (3, 6), (6, 9), (9, 9)]),               # torch.chunk: the last empty
    (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)]),
])
def test_chunks_as_torch_chunk_cuts_them(size, parts, want):
    assert [chunk_bounds(size, parts, r) for r in range(parts)] == want
    pieces = torch.arange(size).chunk(parts)
    got = [(int(p[0]), int(p[-1]) + 1) for p in pieces]
    assert got == [w for w in want if w[0] < w[1]]


def test_local_shapes_of_plain_merged_and_uneven_splits():
    assert local_shape((2, 16, 8), Shard(1, 1, 16), 4, 3) == [2, 4, 8]
    assert local_shape((32, 8), Shard(0, 2, 16), 4, 0) == [8, 8]          # 2 rows x 4 tokens
    assert local_shape((256,), Shard(0, 2, 16), 4, 1) == [64]             # x 8 inside
    assert local_shape((2, 15, 8), Shard(1, 1, 15), 4, 3) == [2, 3, 8]
    assert local_shape((2, 16, 8), REPLICATE, 4, 1) == [2, 16, 8]
    assert local_shape((2, 8), PARTIAL, 4, 1) == [2, 8]
    assert even((2, 16), Shard(1, 1, 16), 4) and not even((2, 15), Shard(1, 1, 15), 4)
    assert even((2, 15), REPLICATE, 4)


def test_a_trailing_trim_needs_no_exchange_and_a_shift_does():
    assert window_plan(16, 0, 13, 4) is None                # x[:, :13]: chunks of 4 still
    own, sends = window_plan(16, 1, 15, 4)                  # x[:, 1:]
    assert own == [(0, 4), (4, 8), (8, 12), (12, 16)]
    # rank 1 sends its first row (4) to rank 0, and keeps 5..7 for itself
    assert sends[1][0] == (4, 5) and sends[1][1] == (5, 8)
    assert sends[0][0] == (1, 4)


def test_shard_of_and_dtensor_placements():
    assert shard_of((2, 16, 8), 1) == Shard(1, 1, 16)
    assert to_dtensor(Shard(1, 1, 16)) == DShard(1)
    assert to_dtensor(Shard(0, 2, 16)) is None              # no plain DTensor form
    assert to_dtensor(PARTIAL) == DPartial() and to_dtensor(REPLICATE) == DReplicate()


def test_typed_shapes():
    f32 = torch.float32
    assert typed_shape((2, 16, 8), f32, Shard(1, 1, 16)) == "f32[2,16@sp,8]"
    assert typed_shape((32, 8), torch.bfloat16, Shard(0, 2, 16)) == "bf16[2x16@sp,8]"
    assert typed_shape((256,), f32, Shard(0, 2, 16), axis="cp") == "f32[2x16@cpx8]"
    assert typed_shape((2, 8), f32, PARTIAL) == "f32[2,8]{sum@sp}"
    assert typed_shape((), torch.int64, REPLICATE) == "i64[]"
    assert dtype_name(torch.complex64) == "complex64"
