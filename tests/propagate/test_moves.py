"""One redistribution (``spdsl.propagate.moves``): the collective each pair of placements is,
the bytes each collective moves forward and backward, what leaves a rank (the engine's cost),
the price one rank decides by, and which inputs of one op share an all-to-all."""

from __future__ import annotations

import math

import pytest

from spdsl.propagate.moves import Move, fused, kind_of
from spdsl.propagate.placement import PARTIAL, REPLICATE, Shard

SEQ, HEADS = Shard(1, 1, 16), Shard(2, 1, 8)
N = 4096                              # global bytes of the value moved


@pytest.mark.parametrize("src, dst, kind", [
    (PARTIAL, REPLICATE, "all_reduce"),
    (PARTIAL, SEQ, "reduce_scatter"),
    (SEQ, REPLICATE, "all_gather"),
    (REPLICATE, SEQ, "take"),
    (SEQ, HEADS, "all_to_all"),
    (SEQ, Shard(1, 1, 15), "all_to_all"),          # a re-chunk within the dim
    (SEQ, Shard(1, 1, 16), "none"),
    (PARTIAL, PARTIAL, "none"),
])
def test_the_collective_of_each_pair(src, dst, kind):
    assert kind_of(src, dst) == kind


@pytest.mark.parametrize("src", [REPLICATE, SEQ])
def test_nothing_becomes_a_partial_sum(src):
    with pytest.raises(TypeError, match="partial"):
        kind_of(src, PARTIAL)
    with pytest.raises(TypeError):
        _ = Move(src, PARTIAL, N, 4).cost


@pytest.mark.parametrize("src, dst, grad, want", [
    (PARTIAL, REPLICATE, True, [("all_reduce", N, 0)]),
    (PARTIAL, SEQ, True, [("reduce_scatter", N, 0), ("all_gather", 0, N // 4)]),
    (PARTIAL, SEQ, False, [("reduce_scatter", N, 0), ("all_gather", 0, 0)]),
    (SEQ, REPLICATE, True, [("all_gather", N // 4, 0)]),      # backward: a local slice
    (REPLICATE, SEQ, True, [("all_gather", 0, N // 4)]),      # forward: a local slice
    (SEQ, HEADS, True, [("all_to_all", N // 4, N // 4)]),
    (SEQ, HEADS, False, [("all_to_all", N // 4, 0)]),
    (SEQ, SEQ, True, []),
])
def test_collectives_and_their_bytes(src, dst, grad, want):
    assert Move(src, dst, N, 4).collectives(grad) == want


def test_one_rank_runs_no_collective():
    assert Move(SEQ, REPLICATE, N, 1).collectives() == []
    assert Move(PARTIAL, REPLICATE, N, 1).cost == 0.0


@pytest.mark.parametrize("src, dst, cost", [
    (SEQ, REPLICATE, N * 3 / 4),                  # gather: the others' pieces arrive
    (SEQ, HEADS, N / 4 * 3 / 4),                  # all-to-all: 1/P of a gather
    (PARTIAL, REPLICATE, 2 * N * 3 / 4),          # all-reduce: reduce-scatter + all-gather
    (PARTIAL, SEQ, N * 3 / 4),
    (REPLICATE, SEQ, 0.0),                        # a slice: free
    (SEQ, SEQ, 0.0),
])
def test_cost_is_the_bytes_leaving_a_rank(src, dst, cost):
    m = Move(src, dst, N, 4)
    assert m.cost == cost and m.price == cost


def test_uneven_all_to_all_and_reduce_scatter_are_unpriceable():
    assert Move(SEQ, Shard(2, 1, 6), N, 4).cost == math.inf        # 6 heads over 4 ranks
    assert Move(PARTIAL, Shard(1, 1, 6), N, 4).cost == math.inf
    assert Move(SEQ, Shard(2, 1, 6), N, 2).cost < math.inf


def test_one_rank_prices_as_two_would():
    # one rank sends nothing, but decides as the smallest real degree does
    assert Move(PARTIAL, SEQ, N, 1).price == N / 2
    assert Move(PARTIAL, REPLICATE, N, 1).price == N
    assert Move(SEQ, HEADS, N, 1).price == N / 2 / 2
    assert Move(SEQ, Shard(2, 1, 3), N, 1).price == N / 4      # divisibility aside
    assert Move(REPLICATE, SEQ, N, 1).price == 0.0


def test_inputs_changing_split_dims_together_share_one_all_to_all():
    qk = {0: Move(SEQ, HEADS, N, 4), 1: Move(SEQ, HEADS, N, 4)}
    assert fused(qk) == (0, 1)
    assert fused({0: qk[0]}) == ()                                  # alone: its own
    assert fused({0: qk[0], 2: Move(SEQ, REPLICATE, N, 4)}) == ()  # a gather is not fused
    rechunk = Move(SEQ, Shard(1, 1, 15), N, 4)                     # within one dim
    assert fused({0: qk[0], 1: rechunk}) == ()
    assert fused({0: qk[0], 1: qk[1], 3: rechunk}) == (0, 1)
