"""The order check's judgement (``spdsl.watchdog.check_order``) of the rows a group gathered
(``spdsl.collectives`` gathers them), in one process: the same collective on every rank
passes; a different kind, number or byte count raises the ``ShardingError`` listing each
rank's; an uneven all-to-all's bytes (-1) are neither compared nor printed. The gather on
diverging ranks: ``tests/lower/test_watchdog.py``."""

from __future__ import annotations

import pytest
import torch

from spdsl.errors import ShardingError
from spdsl.watchdog import check_order, order_entry


def _rows(*entries: tuple) -> torch.Tensor:
    return torch.cat([order_entry(*e) for e in entries])      # as all_gather_single gives them


def test_the_same_collective_on_every_rank_passes():
    mine = order_entry(3, "all_to_all", 1024)
    check_order(mine, _rows((3, "all_to_all", 1024), (3, "all_to_all", 1024)))
    mine = order_entry(4, "all_to_all", -1)
    check_order(mine, _rows((4, "all_to_all", -1), (4, "all_to_all", -1)))


@pytest.mark.parametrize("other, says", [
    ((1, "all_reduce", 4), "#1 all_reduce of 4 B"),
    ((2, "all_gather", 8192), "#2 all_gather of 8.0 KiB"),
    ((1, "all_gather", 4096), "#1 all_gather of 4.0 KiB"),
])
def test_a_difference_raises_naming_every_ranks_collective(other, says):
    mine = order_entry(1, "all_gather", 8192)
    with pytest.raises(ShardingError) as e:
        check_order(mine, _rows((1, "all_gather", 8192), other))
    msg = str(e.value)
    assert msg.startswith("[collective order]"), msg
    assert f"rank 0 of the group: #1 all_gather of 8.0 KiB; rank 1 of the group: {says})" \
        in msg, msg


def test_an_uneven_all_to_all_is_compared_by_number_and_kind():
    mine = order_entry(5, "all_to_all", -1)
    with pytest.raises(ShardingError) as e:
        check_order(mine, _rows((5, "all_to_all", -1), (6, "all_to_all", -1)))
    assert "rank 0 of the group: #5 all_to_all; rank 1 of the group: #6 all_to_all)" \
        in str(e.value), str(e.value)


def test_a_ring_exchange_against_another_collective_raises():
    # ring attention's exchange (spdsl.collectives.ring) is compared by number and kind: the
    # ring's pieces may differ in bytes
    mine = order_entry(2, "send_recv", -1)
    check_order(mine, _rows((2, "send_recv", -1), (2, "send_recv", -1)))
    with pytest.raises(ShardingError) as e:
        check_order(mine, _rows((2, "send_recv", -1), (2, "all_reduce", 4)))
    assert "rank 0 of the group: #2 send_recv; rank 1 of the group: #2 all_reduce of 4 B)" \
        in str(e.value), str(e.value)
