"""The plan lists what runs under every remat mode, on the suite's models and on models written
the way their users write them (``tests/parity/user_models.py``): the plan's collectives against
the process group's count of one training step (kind, elements, forward or backward, on each
rank), and the step's loss and gradients against one device, at SP 2, ``compile=False``.

One 2-rank launch loops over every model and mode. Print the all-to-alls and the differences
with ``python -m tests.inspect.test_plan_remat [model ...]``.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from tests.dist import spawn
from tests.inspect.test_plan_runs import compare, planned_calls
from tests.parity.cases import _errs, counted

MODES = ["none", "auto", "auto_recompute", "full", "full_recompute"]
# the tiny Llama's modes are test_plan_runs.py's ("llama" here too, for the printed table)
MODELS = ["einops_net", "alibi_net", "alibi", "einops", "scalar_norm", "tied", "unprojected"]
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5


def _remat(mode: str):
    from spdsl.remat import Remat
    base, _, extra = mode.partition("_")
    return Remat(base, recompute_collectives="recompute" in extra, offload="offload" in extra)


def _model(name: str) -> torch.nn.Module:
    from spdsl.models.llama import Llama, LlamaConfig
    from spdsl.models.toys import AlibiNet, EinopsNet
    from tests.parity.user_models import MODELS as USER_MODELS

    zoo = {"llama": lambda: Llama(LlamaConfig.tiny()),
           "einops_net": lambda: EinopsNet(EinopsNet.Config()),
           "alibi_net": lambda: AlibiNet(AlibiNet.Config())}
    torch.manual_seed(0)
    return (zoo.get(name) or USER_MODELS[name])()


def run_cases(rank: int, world: int, models: list[str], modes: list[str]) -> dict:
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, dims=1)
    out = {}
    for name in models:
        ref = _model(name)
        loss_ref = ref(ids, labels)
        loss_ref.backward()
        for mode in modes:
            out[(name, mode)] = _case(ref, loss_ref, mode, (ids, labels), world)
    return out


def _case(ref: torch.nn.Module, loss_ref: torch.Tensor, mode: str, args: tuple,
          world: int) -> dict:
    """One step against one device, then one step counted against the plan."""
    import spdsl

    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    step = spdsl.sp_shard(model, seq=world, remat=_remat(mode), compile=False)
    loss = step(*args)                  # builds the step
    loss.backward()
    res = _errs(model, ref, loss, loss_ref)
    model.zero_grad(set_to_none=True)
    box = {}
    fwd = counted(lambda: box.setdefault("loss", step(*args)))
    bwd = counted(lambda: box["loss"].backward())
    plan = step.plan_call(args, {})
    res["ran"] = Counter([("fwd", *c) for c in fwd] + [("bwd", *c) for c in bwd])
    res["planned"] = planned_calls(plan.collectives)
    res["recomputed"] = sum(c.recomputed for c in plan.collectives)
    return res


@pytest.fixture(scope="module")
def sp2():
    return spawn(run_cases, 2, MODELS, MODES, timeout=1200)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.multirank
@pytest.mark.slow
def test_plan_lists_every_call_under_every_remat_mode(sp2, name, mode):
    for rank, res in enumerate(sp2):
        out = res[(name, mode)]
        assert out["ran"], "nothing was counted"
        assert compare(out["planned"], out["ran"]) == [], f"{name} {mode}, rank {rank}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.multirank
@pytest.mark.slow
def test_every_remat_mode_matches_one_device(sp2, name, mode):
    for rank, res in enumerate(sp2):
        out = res[(name, mode)]
        where = f"{name} {mode}, rank {rank}"
        assert not out["missing"] and not out["extra"], where
        assert out["n_grads"] > 0, where
        assert out["loss"] <= LOSS_RTOL, f"{where}: loss rel err {out['loss']:.2e}"
        assert out["grad"] <= GRAD_RTOL, f"{where}: grad rel err {out['grad']:.2e}"


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.multirank
@pytest.mark.slow
def test_recomputing_collectives_reruns_some(sp2, name):
    """With the all-to-alls recomputed, backward runs more of them than without."""
    res = sp2[0]

    def bwd_a2a(mode: str) -> int:
        return sum(n for (ph, kind, _), n in res[(name, mode)]["ran"].items()
                   if ph == "bwd" and kind == "all_to_all")
    for mode in ("auto", "full"):
        assert res[(name, mode)]["recomputed"] == 0, (name, mode)
        assert res[(name, mode + "_recompute")]["recomputed"] > 0, (name, mode)
        assert bwd_a2a(mode + "_recompute") > bwd_a2a(mode), (name, mode)


def _a2a(name: str) -> list:
    import spdsl

    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    step = spdsl.sp_shard(_model(name), seq=2, remat=_remat("full_recompute"))
    return [(c.module, c.recomputed) for c in spdsl.plan(step, ids, ids).collectives
            if c.kind == "all_to_all"]


def test_recomputation_stops_after_the_last_saved_tensor():
    """Backward recomputes a layer only up to its last op that saves a tensor: an attention
    output added to the residual unprojected is not exchanged again, one that a projection
    reads (and keeps) is. Planned on one process, no launch."""
    for name, again in (("unprojected", 1), ("alibi", 2)):
        calls = _a2a(name)
        for layer in ("layers.0", "layers.1"):
            mine = [r for m, r in calls if m.startswith(layer)]
            assert mine.count(False) == 2 and mine.count(True) == again, (name, layer, calls)


if __name__ == "__main__":
    import sys
    results = spawn(run_cases, 2, sys.argv[1:] or MODELS, MODES, timeout=1200)
    for (name, mode), out in results[0].items():
        diff = compare(out["planned"], out["ran"])
        a2a = {ph: sum(n for (p, k, _), n in out["ran"].items() if p == ph and k == "all_to_all")
               for ph in ("fwd", "bwd")}
        planned = {ph: sum(n for (p, k, _), n in out["planned"].items()
                           if p == ph and k == "all_to_all") for ph in ("fwd", "bwd")}
        print(f"{name:22} {mode:24} a2a planned {planned['fwd']:>3}/{planned['bwd']:>3} "
              f"ran {a2a['fwd']:>3}/{a2a['bwd']:>3} loss {out['loss']:.1e} "
              f"grad {out['grad']:.1e} {'; '.join(diff) or 'same'}")
