"""The planner's simulation (fake tensors) matches the same tracker run on real tensors within
10%: tiny and small Llamas, several lengths, every remat mode, SP 1, 2 and 4.

Both sides are ``LiveBytes`` (dispatch level, with the same kernel-scratch model): this checks
that fake kernels, collectives and the checkpoint machinery behave as the real ones, not the
planner's accounting. The independent check, against the allocator's own count, is
``tests/memory/test_measured.py``."""

from __future__ import annotations

import pytest

from tests.memory.cases import launch

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

TOL = 0.10


@pytest.mark.parametrize("world", [1, 2, 4], ids=lambda w: f"sp{w}")
def test_planner_matches_measured_peak(world):
    rows = []
    for rank, res in enumerate(launch(world)):
        for name, modes in res.items():
            for mode, out in modes.items():
                err = out["plan"] / out["real"]["peak"] - 1
                rows.append(f"sp{world} r{rank} {name:10} {mode:10} plan {out['plan']:>11,} "
                            f"real {out['real']['peak']:>11,} {err:+.2%}")
                assert abs(err) <= TOL, "\n".join(rows)
    print("\n" + "\n".join(rows))           # the table, with pytest -s


@pytest.mark.parametrize("world", [1, 4], ids=lambda w: f"sp{w}")
def test_budget_is_respected(world):
    for res in launch(world):
        out = res["budget"]["budget"]
        assert out["plan"] <= out["budget"], (out["plan"], out["budget"])
        assert out["real"]["peak"] <= out["budget"] * (1 + TOL)
        # the budget sits between "none" and "full": auto keeps some, not all, matmuls
        assert 0 < len(out["saved_ops"]) < len(res["tiny_256"]["auto"]["saved_ops"]) + 1


def test_memtracker_agrees_on_a_fresh_model():
    """Cross-check against PyTorch's own MemTracker (real mode) on a fresh model."""
    for res in launch(1):
        out = res["memtracker"]["none"]
        assert abs(out["plan"] / out["real"]["peak"] - 1) <= TOL
