"""``remat="fit"`` (the default) runs the least recomputation whose planned peak fits the
budget: none when the step fits, else auto, else full. Rank 0 of 2 is lowered against a fake
process group and planned on fake tensors; the multi-rank parity of the default is in
``tests/parity/test_fit_parity.py``."""

from __future__ import annotations

import warnings

import pytest
import torch

import spdsl
from spdsl.errors import ShardingError
from spdsl.inspect.plan import ShardingPlan
from spdsl.lower.graph import lower
from spdsl.lower.local import local_specs
from spdsl.memory import fit
from spdsl.memory.planner import plan_memory
from spdsl.memory.simulate import simulate
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.pipeline import planning_group
from spdsl.remat import Remat, RematChoice, apply_remat

SEQ = 512     # long enough that none > auto > full by kilobytes, not bytes


@pytest.fixture(scope="module")
def lowered():
    """(local graph, state specs, input specs, peak per mode) of rank 0 of 2, inside a fake
    process group that stays up for the module's tests."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    f = spdsl.sp_shard(seq=2)(model)
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    entry = f.build((ids, ids), {})
    with planning_group(2) as group:
        local = lower(entry.prop, 0, group, entry.out_placements)
        state, ins = local_specs(entry, (ids, ids), {}, 2, 0)
        peaks = {m: simulate(apply_remat(local, m, state, ins), state, ins).peak
                 for m in ("none", "auto", "full")}
        yield local, state, ins, peaks


def _choose(lowered, budget, **kw):
    local, state, ins, _ = lowered
    return fit.choose_remat(local, Remat("fit", budget=budget), state, ins, **kw)


def test_the_modes_differ_in_peak(lowered):
    peaks = lowered[3]
    assert peaks["none"] > peaks["auto"] > peaks["full"], peaks


@pytest.mark.parametrize("between", [
    ("huge", "none"), ("none", "none"), ("none-1", "auto"), ("auto", "auto"),
    ("auto-1", "full"), ("full", "full")])
def test_the_choice_follows_the_budget(lowered, between):
    peaks = lowered[3]
    where, want = between
    budget = 2 ** 50 if where == "huge" else \
        peaks[where.removesuffix("-1")] - where.endswith("-1")
    gm, r, why = _choose(lowered, budget)
    assert r.mode == want and why.chosen == want and why.fits
    modes = ["none", "auto", "full"]
    # tried in order, least recomputation first, up to the one chosen, each with its peak
    assert [m for m, _ in why.considered] == modes[: modes.index(want) + 1]
    assert dict(why.considered) == {m: peaks[m] for m in modes[: modes.index(want) + 1]}
    assert why.budget == budget and why.budget_source == "memory_budget="
    assert gm.spdsl_remat.remat.mode == want


def test_nothing_fits_runs_the_leanest_and_warns(lowered):
    peaks = lowered[3]
    with pytest.warns(UserWarning, match="no remat mode fits"):
        _, r, why = _choose(lowered, peaks["full"] - 1)
    assert r.mode == "full" and not why.fits and len(why.considered) == 3
    assert "nothing fits" in str(why)


def test_the_ranks_agree_on_the_leanest(lowered, monkeypatch):
    """Ranks combine their choices: one that needs full makes every rank run full, this one
    having planned what it had not tried yet."""
    monkeypatch.delenv(fit.ENV, raising=False)
    monkeypatch.setattr(fit, "device_budget", lambda device, resident=0: (2 ** 50, "test"))
    asked = []

    def agree(i: int) -> int:
        asked.append(i)
        return 2
    _, r, why = _choose(lowered, None, agree=agree)
    assert asked == [0] and r.mode == "full" and why.fits
    assert [m for m, _ in why.considered] == ["none", "auto", "full"]
    assert "tightest rank" in why.budget_source
    # a budget the user gave is combined too: planned peaks differ by rank
    asked.clear()
    _, r, _ = _choose(lowered, 2 ** 50, agree=lambda i: asked.append(i) or i)
    assert asked == [0] and r.mode == "none"


def test_budget_from_the_environment(lowered, monkeypatch):
    peaks = lowered[3]
    monkeypatch.setenv(fit.ENV, str(peaks["none"] - 1))
    _, r, why = _choose(lowered, None)
    assert r.mode == "auto" and why.budget_source == fit.ENV
    _, r, why = _choose(lowered, 2 ** 50)            # memory_budget= wins over the variable
    assert r.mode == "none" and why.budget_source == "memory_budget="
    monkeypatch.setenv(fit.ENV, "lots")
    with pytest.raises(ValueError, match=fit.ENV):
        _choose(lowered, None)


def test_cpu_budget_is_a_share_of_available_memory(monkeypatch):
    monkeypatch.setattr(fit, "_mem_available", lambda: (40 * 2 ** 30, "MemAvailable"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    budget, how = fit.device_budget("cpu", resident=2 ** 20)
    assert budget == int(0.9 * 10 * 2 ** 30) + 2 ** 20
    assert "MemAvailable" in how and "4 local ranks" in how


def test_the_ladder():
    names = [r.describe() for r in fit.ladder("cpu", compiled=False)]
    assert names == ["none", "auto", "full"]
    assert [r.describe() for r in fit.ladder("cuda", compiled=False)][-1] == "full(offload)"
    assert len(fit.ladder("cuda", compiled=True)) == 3      # offload does not compile


def test_plan_memory_plans_the_mode_fit_would_choose():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    big = plan_memory(spdsl.sp_shard(seq=2, memory_budget="1TiB")(model), ids, ids)
    assert big.label.startswith("none,")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        small = plan_memory(spdsl.sp_shard(seq=2, memory_budget=1)(model), ids, ids)
    assert small.label.startswith("full,") and small.peak < big.peak


def test_options_are_checked():
    with pytest.raises(ShardingError, match="memory budget"):
        spdsl.sp_shard(seq=2, remat="full", memory_budget="1GiB")(lambda x: x)
    with pytest.raises(ShardingError, match="memory budget"):
        spdsl.sp_shard(seq=2, memory_budget="plenty")(lambda x: x)
    assert spdsl.sp_shard(seq=2, memory_budget="1GiB")(lambda x: x).remat == \
        Remat("fit", budget=2 ** 30)
    with pytest.raises(TypeError, match="fit"):
        apply_remat(torch.fx.symbolic_trace(torch.nn.Identity()), "fit", [], [])
    with pytest.raises(ValueError, match="offload"):
        Remat("fit", offload=True)


def test_the_plan_shows_the_choice():
    why = RematChoice("auto", 3 * 2 ** 20, "memory_budget=",
                      (("none", 4 * 2 ** 20), ("auto", 2 * 2 ** 20)))
    plan = ShardingPlan("sp", 2, remat=why)
    assert "fit -> auto (fits): planned peak per rank none 4.00 MiB, auto 2.00 MiB; " \
           "budget 3.00 MiB (memory_budget=)" in str(plan)
    again = ShardingPlan.from_json(plan.to_json())
    assert again.remat == why
    assert ShardingPlan.from_json(ShardingPlan("sp", 2).to_json()).remat is None


def _broken(*a, **kw):
    raise RuntimeError("no fake kernel for this op\nsecond line of the error")


def test_a_planner_that_fails_runs_unplanned_and_says_why_in_one_line(lowered, monkeypatch):
    monkeypatch.setattr(fit, "simulate", _broken)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        gm, r, why = _choose(lowered, 2 ** 50)
    said = [str(x.message) for x in w]
    assert len(said) == 1 and "\n" not in said[0], said
    assert "could not plan" in said[0] and "RuntimeError: no fake kernel for this op" in said[0]
    assert r == fit.UNPLANNED and why.chosen == "none" and why.considered == ()
    assert why.unplanned == "RuntimeError: no fake kernel for this op"
    assert str(why) == "fit -> none (unplanned: RuntimeError: no fake kernel for this op)"
    assert RematChoice.from_dict(why.to_dict()) == why
    assert gm.spdsl_remat.remat.mode == "none"


def test_a_failing_rank_makes_every_rank_run_unplanned(lowered, monkeypatch):
    asked = []
    monkeypatch.setattr(fit, "simulate", _broken)
    with pytest.warns(UserWarning, match="could not plan"):
        _, r, _ = _choose(lowered, 2 ** 50, agree=lambda i: asked.append(i) or i)
    assert asked == [3] and r.mode == "none"        # past the ladder: "could not plan"
    monkeypatch.undo()
    with pytest.warns(UserWarning, match="another rank could not plan it"):
        _, r, why = _choose(lowered, 1, agree=lambda i: 3)     # this rank would pick full
    assert r.mode == "none" and why.unplanned == "another rank could not plan it"

