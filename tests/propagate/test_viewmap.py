"""Following a split factor through views (``spdsl.propagate.viewmap``): where the sequence
split lands when a view merges, splits or cuts dims, when it cannot land anywhere, the factor
structure a view leaves on each dim, and which factor of a merged dim takes a split."""

from __future__ import annotations

import pytest
import torch

from spdsl.propagate.placement import Shard, typed_shape
from spdsl.propagate.viewmap import atoms_through_view, innermost_split, map_shard

SEQ = Shard(1, 1, 16)                # [B, S@sp, D] = [2, 16, 8]


@pytest.mark.parametrize("out_shape, parts, want, typed", [
    ((32, 8), 4, Shard(0, 2, 16), "f32[2x16@sp,8]"),          # [B*S, D]: the inner factor
    ((2, 16, 2, 4), 4, Shard(1, 1, 16), "f32[2,16@sp,2,4]"),  # a later dim split
    ((2, 128), 4, Shard(1, 1, 16), "f32[2,16@spx8]"),         # [B, S*D]: features inside
    ((256,), 4, Shard(0, 2, 16), "f32[2x16@spx8]"),           # everything merged
    ((2, 4, 4, 8), 4, Shard(1, 1, 4), "f32[2,4@sp,4,8]"),     # the sequence cut: its outer part
    ((2, 4, 4, 8), 8, None, None),                            # ... which 8 ranks cannot share
    ((2, 8, 16), 4, Shard(1, 1, 8), "f32[2,8@sp,16]"),        # pairs of tokens in a row
    ((4, 8, 8), 4, None, None),                               # halves of it in the batch dim
])
def test_where_the_sequence_split_lands(out_shape, parts, want, typed):
    got = map_shard((2, 16, 8), SEQ, out_shape, parts)
    assert got == want
    if want is not None:
        assert typed_shape(out_shape, torch.float32, got) == typed


def test_merging_and_unmerging_round_trips():
    merged = map_shard((2, 16, 8), SEQ, (32, 8), 4)
    assert map_shard((32, 8), merged, (2, 16, 8), 4) == SEQ
    assert map_shard((32, 8), merged, (2, 16, 2, 4), 4) == SEQ


def test_a_merged_split_cannot_be_unmerged_in_another_order():
    # [2x16@sp, 8] viewed as [4, 8, 8] puts two halves of the tokens in one dim
    assert map_shard((32, 8), Shard(0, 2, 16), (4, 8, 8), 4) is None


def test_atoms_through_views():
    atoms = [(2,), (16,), (8,)]
    assert atoms_through_view((2, 16, 8), atoms, (32, 8)) == [(2, 16), (8,)]
    assert atoms_through_view((2, 16, 8), atoms, (2, 16, 2, 4)) == [(2,), (16,), (2,), (4,)]
    assert atoms_through_view((32, 8), [(2, 16), (8,)], (256,)) == [(2, 16, 8)]
    # [6, 4] -> [4, 6]: the dims do not nest, each output dim is one atom
    assert atoms_through_view((6, 4), [(6,), (4,)], (4, 6)) == [(4,), (6,)]


@pytest.mark.parametrize("size, atoms, parts, want", [
    (32, (2, 16), 4, Shard(0, 2, 16)),      # sequence inside batch*seq
    (32, (16, 2), 4, Shard(0, 1, 16)),      # the innermost factor that divides
    (8, (2, 4), 2, Shard(0, 2, 4)),         # both divide: the innermost wins
    (6, (2, 3), 4, None),                   # nothing divides
    (8, (8,), 4, Shard(0, 1, 8)),
    (1, (1,), 1, None),                     # one row: nothing to split
])
def test_innermost_split(size, atoms, parts, want):
    assert innermost_split(size, atoms, 0, parts) == want
