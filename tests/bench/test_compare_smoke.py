"""CI smoke of the benchmark harness: one step at 256 tokens on 2 gloo ranks, reference and
hand-written DeepSpeed-Ulysses (eager), and the hand-written loss must match the reference.

Runs::

    torchrun --standalone --nproc_per_node=2 bench/compare.py --smoke --systems ulysses-eager \
        --check 1e-5 --out <tmp>/smoke.json
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.multirank
@pytest.mark.slow
def test_compare_smoke_ulysses_matches_reference(tmp_path):
    # The hand-written baseline is DeepSpeed's DistributedAttention: nothing to compare without it.
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed not installed (bench extra): no hand-written Ulysses to compare")
    out = tmp_path / "smoke.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "bench", "compare.py"), "--smoke", "--systems", "ulysses-eager",
           "--check", "1e-5", "--out", str(out)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    (result,) = json.loads(out.read_text())
    rows = {(r["system"], r["mode"]): r for r in result["rows"]}
    assert rows[("reference", "eager")]["status"] == "ok"
    ulysses = rows[("ulysses", "eager")]
    assert ulysses["status"] == "ok", ulysses["reason"]
    assert ulysses["loss_rel_err"] < 1e-5
    assert ulysses["grad_rel_err"] < 1e-5
    # The bytes counted at the collectives are the analytic Ulysses floor, to within the
    # few scalar all-reduces of the loss.
    assert ulysses["comm_total"] == pytest.approx(result["floor"]["total"], rel=1e-3)
