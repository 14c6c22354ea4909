"""``compile=True`` with Hugging Face mixture-of-experts models at SP 2 and 4: the experts run
eagerly on each rank's tokens (a ``token_wise`` block, ``spdsl.lower.tokenwise``), Dynamo
breaks the rank's program there and only there, and compiles what lies between. Loss, the
load-balancing loss and every gradient equal single-device PyTorch (fp32).

Without ``remat`` the step is compiled in pieces: before the first MoE layer, between MoE
layers, after the last (3 graphs for 2 layers). Under ``remat="full"`` a checkpointed layer
that holds a token-wise block runs eagerly: only the code outside the layers is compiled.
One launch per degree; a cold compile is 10-40 s a case on two cores."""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("transformers")

from tests.dist import spawn
from tests.hf.moe_cases import MoeCase, run_moe_all

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
CASES = [MoeCase("mixtral", "grouped_mm", compile=True),
         MoeCase("qwen3_moe", "eager", compile=True),
         MoeCase("mixtral", "eager", remat="full", compile=True)]


@functools.cache
def _results(world: int) -> list[dict]:
    return spawn(run_moe_all, world, CASES, timeout=1800)


@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"sp{w}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_compiled_moe_step_is_exact(case, world):
    for r, res in enumerate(_results(world)):
        got = res[case.name]
        assert "error" not in got, f"rank {r}:\n{got.get('error')}"
        assert got["loss"] <= LOSS_RTOL, (r, got["loss"])
        assert got["aux"] <= LOSS_RTOL, (r, got["aux"])
        assert got["aux_local"] > 100 * LOSS_RTOL     # a rank-local router would be caught
        assert got["missing"] == [] and got["extra"] == [] and got["n_grads"] > 0, got
        assert got["grad"] <= GRAD_RTOL, (r, got["grad"], got["worst"])
        assert got["token_wise"], "the experts were not captured"
        assert got["moe_collectives"] == []
        # something was compiled: the pieces between the eager experts calls
        assert got["graphs"] >= (3 if case.remat is None else 1), got["graphs"]
