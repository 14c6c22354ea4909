"""The plan of a forward that reads tensor values in Python lists what runs
(``spdsl.annotate.cut``, ``SegmentedPlan.collectives``): every collective one training step
issues at the process group, forward and backward (kind and elements, counted by the profiler's
``c10d`` records, not through spdsl's wrappers), equals the plan's list for the path the call
takes -- each segment's program with its gradient buckets, the reads' own gathers and
reductions, and the check that every rank passed the same arguments. At SP 2, under
``remat=None`` and ``Remat("full", recompute_collectives=True)``, on the suite's segmented
models: a branch on a global mean and a lifted ``.item()`` scale per layer, a loop over
``unique().tolist()`` experts with a boolean mask, ``x[mask]``, a ``[B*S, H]`` base Python holds
beside its view, and OPT with layerdrop. The counted step replays the path the first step
recorded; both steps' loss and every gradient match single-device PyTorch (fp32).

With a batch of two rows, a linear layer's ``[B*S, H]`` output is the base of the ``[B, S, H]``
view Python holds: a segment hands on the view, split on the sequence, and its forward gathers
nothing. One launch of 2 ranks runs every case; ``python -m tests.annotate.test_breaks_plan``
prints the planned and counted calls.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn

from tests.annotate.test_replay import Experts, Lifted
from tests.dist import spawn

S, D, TOL = 16, 8, 1e-5
MODES = ["none", "full_recompute"]
CASES = ["reads", "experts", "mask", "held_base", "handed_back", "opt"]


class Masked(nn.Module):
    """``x[mask]`` of a projection: the rows picked depend on the data, the gradient flows."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.a(x)
        picked = h[h[..., 0] > 0]                    # [n, D]: n read from the mask
        return self.b(h).pow(2).mean() + picked.pow(2).sum() / x.shape[1]


class HeldBase(nn.Module):
    """Python holds a linear layer's ``[B*S, D]`` output and its ``[B, S, D]`` view across a
    read, and uses both after it: the base is handed on as its view and viewed back."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        flat = self.a(x.reshape(-1, D))              # [B*S, D]
        h = flat.view(x.shape)                       # [B, S, D]
        h = h.relu() if h.mean() > 0 else h.tanh()
        return self.b(h).pow(2).mean() + flat.pow(2).mean()


class HandedBack(nn.Module):
    """A partial sum made before a read and handed back as it is: the segment hands it on as a
    partial sum, reduced when the call returns."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)

    def forward(self, x):
        m = x.pow(2).mean()                          # a partial sum over the split sequence
        h = self.a(x)
        h = h.relu() if h.mean() > 0 else h.tanh()
        return h.pow(2).mean() * m, m


def _remat(mode: str):
    from spdsl.remat import Remat
    return None if mode == "none" else Remat("full", recompute_collectives=True)


def _case(name: str, mode: str, world: int):
    """(model, step, args, loss of the model on args, seed drawn before each call)."""
    import spdsl
    if name == "opt":
        from tests.hf.families import batch, build
        model = build("opt", num_hidden_layers=2, layerdrop=0.5).train()
        args = batch(b=2, s=32)

        def loss_of(m, i, lab):
            return m(input_ids=i, labels=lab, use_cache=False).loss
        step = spdsl.sp_shard(seq=world, remat=_remat(mode))(
            lambda i, lab: loss_of(model, i, lab))
        return model, step, args, loss_of, 7
    torch.manual_seed(0)
    model = {"reads": Lifted, "experts": Experts, "mask": Masked, "held_base": HeldBase,
             "handed_back": HandedBack}[name]()
    x = torch.randn(2, S, D, generator=torch.Generator().manual_seed(3))
    if name == "experts":
        with torch.no_grad():
            model.router.bias.copy_(torch.tensor([0.0, 0.3, -0.2]))
    step = spdsl.sp_shard(model, seq=world, remat=_remat(mode), compile=False)
    return model, step, (x,), lambda m, x: _first(m(x)), None


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _worst(model, ref, loss, want) -> float:
    err = abs(float(loss.detach()) - float(want.detach())) / abs(float(want.detach()))
    top = max(float(q.grad.abs().max()) for q in ref.parameters() if q.grad is not None)
    for p, q in zip(model.parameters(), ref.parameters()):
        if q.grad is None:           # a layer skipped: no gradient on either side
            assert p.grad is None or not p.grad.any()
            continue
        err = max(err, float((p.grad - q.grad).abs().max()) /
                  max(float(q.grad.abs().max()), 1e-3 * top))
    return err


def _one(name: str, mode: str, world: int) -> dict:
    import spdsl
    from tests.inspect.test_plan_runs import planned_calls
    from tests.parity.cases import counted
    model, step, args, loss_of, seed = _case(name, mode, world)
    ref = copy.deepcopy(model)
    worst = 0.0
    out = {}
    box: dict = {}

    def forward() -> None:
        box["loss"] = _first(step(*args))
    for k in range(2):               # the first records the path, the second replays it
        if seed is not None:
            torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        if k == 0:
            forward()
            box["loss"].backward()
        else:
            fwd = counted(forward)
            bwd = counted(box["loss"].backward)
            out["ran"] = Counter([("fwd", *c) for c in fwd] + [("bwd", *c) for c in bwd])
        loss = box["loss"]
        if seed is not None:
            torch.manual_seed(seed)
        ref.zero_grad(set_to_none=True)
        want = loss_of(ref, *args)
        want.backward()
        worst = max(worst, _worst(model, ref, loss, want))
    if seed is not None:
        torch.manual_seed(seed)
    plan = spdsl.plan(step, *args)
    out["planned"] = planned_calls(plan.collectives)
    out["worst"] = worst
    out["replays"] = step._segmented.replays
    out["reads"] = [(b.kind, len(b.issued)) for b in plan.breaks]
    out["outputs"] = [s.outputs for s in plan.segments]
    out["after"] = [c.kind for s in plan.segments for c in s.after]
    return out


def run_cases(rank: int, world: int, cases: list[str], modes: list[str]) -> dict:
    return {(name, mode): _one(name, mode, world) for name in cases for mode in modes}


@pytest.fixture(scope="module")
def sp2():
    return spawn(run_cases, 2, CASES, MODES, timeout=1200)


def _fwd(res: dict, kind: str) -> int:
    return sum(n for (ph, k, _), n in res["ran"].items() if ph == "fwd" and k == kind)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CASES)
@pytest.mark.multirank
@pytest.mark.slow
def test_plan_lists_every_call_of_a_segmented_step(sp2, name, mode):
    from tests.inspect.test_plan_runs import compare
    for rank, res in enumerate(sp2):
        out = res[(name, mode)]
        assert out["ran"], "nothing was counted"
        assert compare(out["planned"], out["ran"]) == [], f"{name} {mode}, rank {rank}"
        assert out["replays"] == 1, (name, mode, out["replays"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CASES)
@pytest.mark.multirank
@pytest.mark.slow
def test_segmented_step_matches_one_device(sp2, name, mode):
    for rank, res in enumerate(sp2):
        assert res[(name, mode)]["worst"] < TOL, (name, mode, rank, res[(name, mode)]["worst"])


@pytest.mark.multirank
@pytest.mark.slow
def test_the_reads_and_the_same_inputs_check_are_listed(sp2):
    res = sp2[0]
    # the expert loop's unique and its mask read split values: one gather each, listed
    assert res[("experts", "none")]["reads"] == [("unique", 1), ("x[mask]", 1)]
    assert _fwd(res[("experts", "none")], "all_gather") >= 2
    # the same-inputs check: one all-reduce of 2 float64 per argument (OPT: ids and labels)
    assert res[("reads", "none")]["ran"][("fwd", "all_reduce", 2)] == 1
    assert res[("opt", "none")]["ran"][("fwd", "all_reduce", 4)] == 1
    # a partial sum an earlier segment handed on, handed back: reduced as the call returns
    assert res[("handed_back", "none")]["after"] == ["all_reduce"]
    # recomputing collectives reruns OPT's all-to-alls in backward
    bwd = {m: sum(n for (ph, k, _), n in res[("opt", m)]["ran"].items()
                  if ph == "bwd" and k == "all_to_all") for m in MODES}
    assert bwd["full_recompute"] > bwd["none"] > 0, bwd


@pytest.mark.multirank
@pytest.mark.slow
def test_a_base_of_a_view_is_handed_on_as_the_view_with_no_gather(sp2):
    """Batch 2: a linear layer's ``[B*S, H]`` output, the base of the view Python holds, is no
    segment output (it was one, all-gathered, before: 2 gathers of 128 elements a step here)."""
    for res in sp2:
        for mode in MODES:
            for name in ("reads", "held_base"):
                assert _fwd(res[(name, mode)], "all_gather") == 0, (name, mode, res[(name, mode)])


if __name__ == "__main__":
    import sys

    from tests.inspect.test_plan_runs import compare
    results = spawn(run_cases, 2, sys.argv[1:] or CASES, MODES, timeout=1200)
    for (name, mode), out in results[0].items():
        print(f"{name:10} {mode:15} worst {out['worst']:.1e} outputs {out['outputs']} "
              f"{'; '.join(compare(out['planned'], out['ran'])) or 'same'}")
        print("   ran", dict(out["ran"]))
