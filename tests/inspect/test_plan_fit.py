"""A plan under ``remat="fit"`` (the default) chooses the mode only when asked: printing or
exporting it never runs the memory planner, and says that the choice is the run's; with
``fit=True`` (``--remat-fit``) the choice is made and shown."""

from __future__ import annotations

import json

import pytest
import torch

import spdsl
from spdsl.cli.plan import main
from spdsl.memory import fit
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.pipeline import Sizing

TINY = "spdsl.models.llama:LlamaConfig.tiny"
NOT_CHOSEN = "remat:              fit, chosen when the step is built"


@pytest.fixture
def choices(monkeypatch) -> list:
    """Every call of the fit choice (the memory planner's simulation of each mode)."""
    calls: list = []

    def counted(*args, **kwargs):
        calls.append(args[1])
        return fit.choose_remat(*args, **kwargs)
    monkeypatch.setattr(fit, "SIZING", Sizing(peak=fit.SIZING.peak, choose=counted))
    return calls


def _meta_model(layers: int = 2):
    with torch.device("meta"):
        return Llama(LlamaConfig.tiny().replace(n_layers=layers)).to(torch.bfloat16)


def test_printing_and_exporting_a_plan_never_simulates(choices):
    ids = torch.empty(1, 256, dtype=torch.long, device="meta")
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(_meta_model()), ids, ids)
    text, d = str(plan), json.loads(plan.to_json())
    plan.to_html()
    assert choices == []
    assert NOT_CHOSEN in text and plan.remat is None
    assert d["remat"] is None and d["remat_mode"] == "fit"
    assert NOT_CHOSEN in str(spdsl.ShardingPlan.from_json(plan.to_json()))


def test_fit_true_chooses_and_the_plan_shows_it(choices, monkeypatch):
    monkeypatch.setenv("SPDSL_MEMORY_BUDGET", "1TiB")
    ids = torch.empty(1, 256, dtype=torch.long, device="meta")
    step = spdsl.sp_shard(seq=4)(_meta_model())
    plain = spdsl.plan(step, ids, ids)
    str(plain)                                         # read once without the choice
    plan = spdsl.plan(step, ids, ids, fit=True)        # the same plan, now chosen
    assert len(choices) == 1
    assert plan.remat is not None and plan.remat.chosen == "none"
    assert "remat:              fit -> none (fits)" in str(plan)
    assert json.loads(plan.to_json())["remat"]["chosen"] == "none"
    spdsl.plan(step, ids, ids, fit=True)
    assert len(choices) == 1, "chosen again for a plan already chosen"


def test_a_named_mode_is_listed_as_it_is(choices):
    ids = torch.empty(1, 256, dtype=torch.long, device="meta")
    plan = spdsl.plan(spdsl.sp_shard(seq=4, remat="full")(_meta_model()), ids, ids)
    assert "remat:              full" in str(plan) and choices == []


def test_cli_chooses_only_with_remat_fit(choices, capsys, monkeypatch):
    monkeypatch.setenv("SPDSL_MEMORY_BUDGET", "1")        # nothing fits: the warning says so
    assert main(["plan", TINY, "--seq", "64", "--sp", "4"]) == 0
    out, err = capsys.readouterr()
    assert choices == [] and NOT_CHOSEN in out and "no remat mode fits" not in err
    with pytest.warns(UserWarning, match="no remat mode fits"):
        assert main(["plan", TINY, "--seq", "64", "--sp", "4", "--remat-fit"]) == 0
    out, _ = capsys.readouterr()
    # a meta plan is for CUDA (--device cuda, the default): its modes end in offload
    assert len(choices) == 1 and "remat:              fit -> full(offload) (nothing fits" in out
