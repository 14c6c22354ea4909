"""Short convolutions along the sequence written as ``nn.Conv1d`` / ``F.conv1d``
(``spdsl.propagate.convs``) stay split over the sequence with a halo exchange: loss and every
parameter gradient equal single-device PyTorch (fp32) at SP 4 and at dp 2 x SP 2, one launch of
4 gloo ranks; every convolution runs by state passing (not whole), and the collectives one step
ran are those the plan lists (halo exchanges, no gather of a convolution's input). The
exchange alone over simulated ranks: ``tests/lower/test_mixers.py``; the rewrite and the plan
in one process: ``tests/propagate/test_convs.py``."""

from __future__ import annotations

import pytest

from tests.dist import spawn
from tests.parity.conv_cases import CASES, LAYERS, run_all
from tests.parity.test_parity import plan_vs_run

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def results():
    return spawn(run_all, 4)


def _case(results, name):
    for r, res in enumerate(results):
        assert "error" not in res[name], f"{name} rank {r}: {res[name]['error']}"
    return [res[name] for res in results]


@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_every_gradient(results, name):
    for r, out in enumerate(_case(results, name)):
        assert out["missing"] == [] and out["extra"] == [], out
        assert out["n_grads"] == 1 + sum(2 if bias else 1 for *_, bias in LAYERS) + 2
        assert out["loss"] <= LOSS_RTOL, f"{name} rank {r}: loss rel err {out['loss']:.2e}"
        assert out["grad"] <= GRAD_RTOL, f"{name} rank {r}: grad rel err {out['grad']:.2e}"


@pytest.mark.parametrize("name", list(CASES))
def test_convolutions_split_with_a_halo(results, name):
    for r, out in enumerate(_case(results, name)):
        assert out["strategies"] == ["mixer.conv1d.state"] * len(LAYERS), out["strategies"]
        assert not [c for c in out["planned"] if c[0] == "all_gather"], out["planned"]
        halos = [c for c in out["planned"] if c[0] == "halo_exchange"]
        assert halos, f"rank {r}: no halo exchange planned"
        # a rank with nothing to send one way (a causal convolution's last rank forward, its
        # first in backward) still takes part in the all-to-all, with 0 elements; the plan
        # lists the rank's own buffer
        ran = [c for c in out["ran"] if c[1]]
        assert plan_vs_run(ran, out["planned"]) == [], f"{name} rank {r}"
