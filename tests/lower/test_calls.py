"""What the plan lists for a gather of a dim shorter than the ranks: every rank hands over a
chunk padded to the largest, also a rank that holds none of it (Bamba's packed batch gathers
a one-token value over 2 ranks; the plan listed 0 bytes on rank 1, which sent 1 element)."""

from __future__ import annotations

import torch

from spdsl.lower.calls import _chunk_bytes


class _Node:
    def __init__(self, val: torch.Tensor) -> None:
        self.meta = {"val": val}


def test_a_rank_without_rows_still_hands_over_the_padded_chunk():
    split = (1, 1, 1, 1)                      # dim 1, one row of 1 over the ranks
    held = _Node(torch.empty(2, 1, dtype=torch.int64))
    empty = _Node(torch.empty(2, 0, dtype=torch.int64))
    assert _chunk_bytes(held, split, 2) == _chunk_bytes(empty, split, 2) == 2 * 8


def test_uneven_chunks_are_padded_to_the_largest():
    split = (0, 1, 5, 3)                      # 5 rows of 3 over 2 ranks: chunks of 3 and 2
    for rows in (3, 2):
        x = _Node(torch.empty(rows * 3, 4))
        assert _chunk_bytes(x, split, 2) == 3 * 3 * 4 * 4
