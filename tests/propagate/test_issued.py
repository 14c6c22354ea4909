"""Collectives a named lowering issues are recorded by propagation (``Decision.issued``) and
listed by the plan from that record: the halo exchange of a slice of the split sequence, from
either end."""

from __future__ import annotations

import torch

import spdsl
from spdsl.propagate.placement import halo_rows


def _collectives(f, x):
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(f), x)
    return [(c.kind, c.bytes, c.purpose) for c in plan.collectives]


def test_halo_rows_by_hand():
    # 16 rows over 4 ranks, keep rows 2..15 (chunks of 4): ranks 1, 2, 3 each send 2 rows down
    assert halo_rows(16, 2, 14, 4) == 2
    # keep 0..11 (chunks of 3): rank 0 sends row 3, rank 1 rows 6-7, rank 2 rows 9-11
    assert halo_rows(16, 0, 12, 4) == 3
    assert halo_rows(16, 0, 13, 4) == 0          # chunks of 4 again: every rank has its rows


def test_a_slice_from_the_end_plans_the_same_halo_as_from_the_start():
    x = torch.randn(2, 16, 8)
    row = 2 * 8 * 4                                # [2, 1 row, 8] f32
    # then the same-inputs check: the input's checksum, its largest and smallest over the ranks
    want = [("halo_exchange", 2 * row, "halo"), ("all_reduce", 4, "loss"),
            ("all_reduce", 16, "check")]
    assert _collectives(lambda x: (x[:, 2:] * 2).sum(), x) == want
    assert _collectives(lambda x: (x[:, -14:] * 2).sum(), x) == want
