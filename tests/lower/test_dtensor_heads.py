"""The DTensor adapter (``spdsl.dtensor_attention()``) moves the heads the traced path moves."""

from __future__ import annotations

import pytest

from spdsl.dtensor_ops import head_repeats
from spdsl.propagate.heads import kv_repeat


@pytest.mark.parametrize("hq,hk,parts", [(8, 8, 4), (8, 2, 4), (8, 1, 4), (12, 3, 4),
                                         (12, 6, 4), (16, 4, 8), (6, 6, 2)])
def test_kv_heads_repeat_as_traced(hq, hk, parts):
    q, kv, mask = (2, hq, 32, 8), (2, hk, 32, 8), (2, 32, 32)
    assert head_repeats([q, kv, kv, mask], hq, parts) == [
        1, kv_repeat(hq, hk, parts), kv_repeat(hq, hk, parts), 1]
    # the repeated kv heads split evenly over the ranks, as the all-to-all needs
    assert hk * kv_repeat(hq, hk, parts) % parts == 0


def test_heads_fewer_than_ranks_and_not_dividing():
    # 3 kv heads over 4 ranks: each kv head goes with all its query heads (as written), not
    # unrepeated (3 heads do not split over 4 ranks)
    assert head_repeats([(1, 12, 16, 8), (1, 3, 16, 8)], 12, 4) == [1, 4]
