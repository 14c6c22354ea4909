"""CI smoke of the benchmark harness: one step at 256 tokens on 2 gloo ranks, reference and
hand-written DeepSpeed-Ulysses (eager), and the hand-written loss must match the reference.

Runs::

    torchrun --standalone --nproc_per_node=2 bench/compare.py --smoke --systems ulysses-eager \
        --check 1e-5 --out <tmp>/smoke.json
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.bench._compare import run_compare


@pytest.mark.multirank
@pytest.mark.slow
def test_compare_smoke_ulysses_matches_reference(tmp_path):
    # The hand-written baseline is DeepSpeed's DistributedAttention: nothing to compare without it.
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed not installed (bench extra): no hand-written Ulysses to compare")
    out = tmp_path / "smoke.json"
    (result,) = run_compare(out, "--smoke", "--systems", "ulysses-eager", "--check", "1e-5")
    rows = {(r["system"], r["mode"]): r for r in result["rows"]}
    assert rows[("reference", "eager")]["status"] == "ok"
    ulysses = rows[("ulysses", "eager")]
    assert ulysses["status"] == "ok", ulysses["reason"]
    assert ulysses["loss_rel_err"] < 1e-5
    assert ulysses["grad_rel_err"] < 1e-5
    # The bytes counted at the collectives are the analytic Ulysses floor, to within the
    # few scalar all-reduces of the loss.
    assert ulysses["comm_total"] == pytest.approx(result["floor"]["total"], rel=1e-3)
