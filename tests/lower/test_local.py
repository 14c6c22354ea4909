"""``spdsl.lower.local``: the one chunking of global shapes into a rank's. Uneven splits are
``torch.chunk``'s pieces (DTensor's ``Shard``: 10 tokens over 4 ranks are 3, 3, 3, 1, not
``torch.tensor_split``'s 3, 3, 2, 2), the pieces of every rank put back together are the
global tensor, a data axis cuts the batch first, and the input specs the pipeline sizes a
program by are the pieces the run cuts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from spdsl.errors import ShardingError
from spdsl.lower.local import bounds, input_shapes, local_shape, local_specs, sequence_inside
from spdsl.propagate.placement import REPLICATE, Shard


@pytest.mark.parametrize("tokens, parts", [(10, 4), (5, 4), (64, 4), (7, 3), (3, 8)])
def test_uneven_pieces_are_torch_chunk_s(tokens, parts):
    x = torch.arange(2 * tokens * 3).view(2, tokens, 3)
    p = Shard(1, 1, tokens)
    pieces = list(torch.chunk(x, parts, dim=1))
    pieces += [x[:, :0]] * (parts - len(pieces))        # torch.chunk drops empty tails
    for rank in range(parts):
        assert local_shape(x.shape, p, parts, rank) == list(pieces[rank].shape)
        lo, hi = bounds(p, parts, rank)
        assert torch.equal(x.narrow(1, lo, hi - lo), pieces[rank])
    assert torch.equal(torch.cat([x.narrow(1, *_start_len(p, parts, r)) for r in range(parts)],
                                 dim=1), x)


def _start_len(p: Shard, parts: int, rank: int) -> tuple[int, int]:
    lo, hi = bounds(p, parts, rank)
    return lo, hi - lo


def test_ten_tokens_over_four_ranks():
    assert [local_shape((1, 10), Shard(1, 1, 10), 4, r)[1] for r in range(4)] == [3, 3, 3, 1]


def test_data_axis_cuts_the_batch_then_the_sequence():
    x = torch.arange(4 * 10).view(4, 10)
    for data_rank in range(2):
        for rank in range(2):
            want = x[2 * data_rank:2 * data_rank + 2, 5 * rank:5 * rank + 5]
            got = local_shape(x.shape, Shard(1, 1, 10), 2, rank, Shard(0, 1, 4), 2, data_rank)
            assert got == list(want.shape)


def test_batch_and_sequence_merged_in_one_dim():
    # [B*S] after a flatten: the batch the outer factor (split over dp), the sequence inside
    sp, dp = Shard(0, 4, 10), Shard(0, 1, 4)
    assert sequence_inside(sp, dp, 2) == Shard(0, 2, 10)
    flat = torch.arange(40)
    for data_rank, rank in [(0, 0), (1, 1)]:
        rows = flat.view(4, 10)[2 * data_rank:2 * data_rank + 2, 5 * rank:5 * rank + 5]
        assert local_shape((40,), sp, 2, rank, dp, 2, data_rank) == [rows.numel()]
    with pytest.raises(ShardingError, match="data and sequence axes"):
        sequence_inside(Shard(0, 4, 10), Shard(0, 10, 4), 2)     # the batch inside the tokens


def _entry(placements, data_in=None):
    return SimpleNamespace(traced=SimpleNamespace(tensor_leaf_index=list(range(len(placements))),
                                                  state=[torch.zeros(3, 2)]),
                           in_placements=placements, data=object() if data_in else None,
                           data_in=data_in or [])


def test_input_specs_are_the_pieces_the_run_cuts():
    ids, mask = torch.zeros(4, 10, dtype=torch.long), torch.ones(4, 10)
    entry = _entry([Shard(1, 1, 10), REPLICATE], [Shard(0, 1, 4), Shard(0, 1, 4)])
    args = (ids, mask)
    assert input_shapes(entry, args, {}, 4, 3, data_parts=2, data_rank=1) == [(2, 1), (2, 10)]
    # batch="local": each data rank passed its own rows already
    assert input_shapes(entry, args, {}, 4, 0, data_parts=2, batch="local") == [(4, 3),
                                                                                (4, 10)]
    state, ins = local_specs(entry, args, {}, 4, 3, data_parts=2, data_rank=1)
    assert [s.shape for s in state] == [(3, 2)]
    assert [(s.shape, s.dtype) for s in ins] == [((2, 1), torch.long), ((2, 10), torch.float32)]
