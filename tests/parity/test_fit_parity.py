"""The default ``remat`` ("fit": chosen from memory) trains exactly like single-device PyTorch
at SP 2 whichever mode it picks (loss and every parameter gradient, fp32), every rank runs the
same mode, and the choice is made once per program."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

from tests.dist import spawn

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


def _errs(model, ref, loss, loss_ref) -> dict:
    out = {"loss": abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()), "grad": 0.0,
           "missing": []}
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.grad is None:
            out["missing"].append(name)
            continue
        scale = q.grad.abs().max().item() or 1.0
        out["grad"] = max(out["grad"], (p.grad - q.grad).abs().max().item() / scale)
    return out


def _cases(rank: int, world: int) -> dict:
    import spdsl
    from spdsl.memory import fit
    from spdsl.memory.planner import plan_memory
    from spdsl.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    ref = Llama(LlamaConfig.tiny())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 256), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    loss_ref = ref(ids, labels)
    loss_ref.backward()
    # this rank's own peaks (they differ by rank: the labels' halo, say)
    peaks = {m: plan_memory(spdsl.sp_shard(seq=world, remat=m)(copy.deepcopy(ref)), ids,
                            labels, rank=rank).peak for m in ("none", "auto", "full")}
    chosen_calls = []
    real = fit.choose_remat

    def counted(*a, **kw):
        chosen_calls.append(1)
        return real(*a, **kw)
    fit.choose_remat = counted

    def broken(*a, **kw):
        raise RuntimeError("no fake kernel for this op\nsecond line of the error")

    def run(budget=None, device_budget=None, fail=False) -> dict:
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        step = spdsl.sp_shard(seq=world, memory_budget=budget)(model)
        saved, simulate = fit.device_budget, fit.simulate
        if device_budget is not None:
            fit.device_budget = lambda device, resident=0: (device_budget, "test")
        if fail:
            fit.simulate = broken
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                loss = step(ids, labels)
            finally:
                fit.device_budget, fit.simulate = saved, simulate
            loss.backward()
            out = _errs(model, ref, loss, loss_ref)
            before = len(chosen_calls)
            for _ in range(2):          # the same program again: built once, chosen once
                model.zero_grad(set_to_none=True)
                step(ids, labels).backward()
        plan = spdsl.plan(step, ids, labels)
        out.update(chosen=plan.remat.chosen, fits=plan.remat.fits,
                   considered=[m for m, _ in plan.remat.considered],
                   again=len(chosen_calls) - before, warned=[str(x.message) for x in w],
                   text=str(plan), json=json.loads(plan.to_json())["remat"])
        return out

    out = {"peaks": peaks}
    out["default"] = run()
    out["huge"] = run(budget=2 ** 50)
    out["between"] = run(budget=peaks["none"] - 1)
    out["below_auto"] = run(budget=peaks["auto"] - 1)
    out["nothing"] = run(budget=peaks["full"] - 1)
    # a measured budget that differs by rank: rank 1 needs auto, so both run auto
    out["agree"] = run(device_budget=2 ** 50 if rank == 0 else peaks["none"] - 1)
    # one budget for both ranks, between rank 1's peak without remat and rank 0's (higher):
    # rank 0 needs auto, so both run auto
    lo, hi = sorted(plan_memory(spdsl.sp_shard(seq=world, remat="none")(copy.deepcopy(ref)),
                                ids, labels, rank=r).peak for r in range(world))
    out["peaks_differ"] = hi > lo
    out["between_ranks"] = run(budget=lo)
    # rank 1's planner fails (rank 0 would pick auto): both run unplanned, without remat
    out["unplanned"] = run(budget=peaks["none"] - 1, fail=rank == 1)
    fit.choose_remat = real
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_cases, 2)


@pytest.mark.parametrize("case,want", [("default", "none"), ("huge", "none"),
                                       ("between", "auto"), ("below_auto", "full"),
                                       ("nothing", "full"), ("agree", "auto"),
                                       ("between_ranks", "auto"), ("unplanned", "none")])
def test_the_default_is_exact_in_the_mode_it_picks(results, case, want):
    peaks = results[0]["peaks"]
    assert peaks["none"] > peaks["auto"] > peaks["full"], peaks
    for r, res in enumerate(results):
        out = res[case]
        assert out["chosen"] == want, f"rank {r}: {out['text'].splitlines()[-1]}"
        assert out["missing"] == [], f"rank {r}: no gradient for {out['missing']}"
        assert out["loss"] <= LOSS_RTOL, f"rank {r}: loss rel err {out['loss']:.2e}"
        assert out["grad"] <= GRAD_RTOL, f"rank {r}: grad rel err {out['grad']:.2e}"
        assert out["again"] == 0, "the mode was chosen again for a program already built"
        assert f"fit -> {want}" in out["text"] and out["json"]["chosen"] == want
    assert results[0]["nothing"]["fits"] is False
    assert any("no remat mode fits" in w for w in results[0]["nothing"]["warned"])
    assert results[0]["between"]["considered"] == ["none", "auto"]
    assert "tightest rank" in results[0]["agree"]["text"]
    assert results[0]["peaks_differ"]


def test_a_rank_whose_planner_fails_makes_every_rank_run_unplanned(results):
    """One warning of one line per rank, once for the three calls; the failing rank names
    the error, the other says another rank could not plan."""
    why = {0: "another rank could not plan it", 1: "RuntimeError: no fake kernel for this op"}
    for r, res in enumerate(results):
        out = res["unplanned"]
        said = [w for w in out["warned"] if "could not plan" in w]
        assert len(said) == 1 and "\n" not in said[0], said
        assert why[r] in said[0] and out["json"]["unplanned"] == why[r]
        assert "unplanned" in out["text"]
