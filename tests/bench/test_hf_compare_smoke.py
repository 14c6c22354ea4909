"""ALST's HF integration beside spdsl on a tiny HF Llama: one step at 256 tokens on 2 gloo ranks.

Runs::

    torchrun --standalone --nproc_per_node=2 bench/compare.py --hf --smoke --out <tmp>/hf.json
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.bench._compare import run_compare


@pytest.mark.multirank
@pytest.mark.slow
def test_hf_compare_smoke(tmp_path):
    for pkg in ("deepspeed", "transformers"):
        if importlib.util.find_spec(pkg) is None:
            pytest.skip(f"{pkg} not installed: no ALST HF integration to compare")
    out = tmp_path / "hf.json"
    (result,) = run_compare(out, "--hf", "--smoke")
    rows = {(r["system"], r["mode"]): r for r in result["rows"]}
    spdsl, alst = rows[("spdsl", "eager")], rows[("alst", "eager")]
    assert spdsl["status"] == "ok", spdsl["reason"]
    assert alst["status"] == "ok", alst["reason"]
    assert spdsl["loss_rel_err"] < 1e-5 and spdsl["grad_rel_err"] < 1e-5
    # ALST's loss is the global mean; its gradient is P times the single-device one
    assert alst["loss_rel_err"] < 1e-5
    assert alst["grad_scale"] == 2 and alst["grad_rel_err_rescaled"] < 1e-5
    assert alst["grad_rel_err"] == pytest.approx(1.0, rel=1e-4)
