"""A segmented step reduces its segments' gradient buckets together
(``spdsl.collectives.grads``, ``spdsl.lower.grad_buckets.merge_buckets``).

A forward that reads values runs one program per segment, each with its own gradient bucket.
Counted at the process group (the profiler's ``c10d`` records, not spdsl's wrappers), at SP 2,
one launch: a branch per layer over 3 layers (4 segments, 4 buckets) reduces its gradients in
backward with one all-reduce of all the parameters' elements; with a cap below the buckets'
total, in more than one, each under the cap, and the plan lists the calls that ran
(``SegmentedPlan.collectives``). Loss and every gradient match single-device PyTorch: after one
step, after a second ``backward()`` into the same ``.grad`` (accumulated), and through
``torch.autograd.grad`` (which accumulates nothing: each bucket reduced where it is). The
tensor-op form of the same model (one program) keeps its one bucket.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter

import pytest
import torch
from torch import nn

from tests.dist import spawn

pytestmark = [pytest.mark.multirank]

S, D, LAYERS, TOL = 16, 8, 3, 1e-5
PARAMS = 2 * LAYERS * (D * D + D)         # elements of every parameter
SMALL_CAP = 3 * (D * D + D) * 4           # bytes: one and a half segments' buckets


class Branches(nn.Module):
    """Per layer: a branch on the global mean (a read: a segment ends there)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(D, D) for _ in range(LAYERS))
        self.b = nn.ModuleList(nn.Linear(D, D) for _ in range(LAYERS))

    def forward(self, x):
        for a, b in zip(self.a, self.b):
            h = a(x)
            h = h.relu() if h.mean() > 0 else h.tanh()
            x = x + b(h)
        return x.pow(2).mean()


class Where(Branches):
    """The same math as tensor ops: one program."""

    def forward(self, x):
        for a, b in zip(self.a, self.b):
            h = a(x)
            x = x + b(torch.where(h.mean() > 0, h.relu(), h.tanh()))
        return x.pow(2).mean()


def _worst(model, ref, scale: float = 1.0) -> float:
    return max(float((p.grad - scale * q.grad).abs().max() /
                     (scale * q.grad).abs().max().clamp_min(1e-30))
               for p, q in zip(model.parameters(), ref.parameters()))


def _forward(step, x, box: dict) -> None:
    box["loss"] = step(x)


def _backward_reduces(calls) -> list[int]:
    return [n for kind, n in calls if kind == "all_reduce"]


def _run(rank: int, world: int) -> dict:
    import spdsl
    from spdsl.lower import grad_buckets
    from tests.inspect.test_plan_runs import planned_calls
    from tests.parity.cases import counted

    x = torch.randn(1, S, D, generator=torch.Generator().manual_seed(3))
    out: dict = {}
    for name, cap in (("merged", None), ("capped", SMALL_CAP), ("one program", None)):
        torch.manual_seed(0)
        model = (Where if name == "one program" else Branches)()
        ref = copy.deepcopy(model)
        kept = grad_buckets.GRAD_BUCKET_BYTES
        grad_buckets.GRAD_BUCKET_BYTES = kept if cap is None else cap
        try:
            step = spdsl.sp_shard(model, seq=world)
            step(x).backward()                       # records the path, builds the programs
            model.zero_grad(set_to_none=True)
            box = {}
            fwd = counted(functools.partial(_forward, step, x, box))
            bwd = counted(box["loss"].backward)
            want = ref(x)
            want.backward()
            res = {"loss": abs(float(box["loss"].detach()) - float(want.detach())) /
                   abs(float(want.detach())),
                   "grads": _worst(model, ref), "bwd": _backward_reduces(bwd),
                   "segments": None if step._segmented is None else
                   len(spdsl.plan(step, x).segments)}
            if step._segmented is not None:
                ran = Counter([("fwd", *c) for c in fwd] + [("bwd", *c) for c in bwd])
                res["plan_vs_run"] = (planned_calls(spdsl.plan(step, x).collectives), ran)
            # a second backward accumulates into the same .grad
            step(x).backward()
            res["accumulated"] = _worst(model, ref, 2.0)
            # torch.autograd.grad: nothing accumulated, each bucket reduced where it is
            got = torch.autograd.grad(step(x), list(model.parameters()))
            wants = torch.autograd.grad(ref(x), list(ref.parameters()))
            res["autograd_grad"] = max(float((g - w).abs().max() / w.abs().max())
                                       for g, w in zip(got, wants))
        finally:
            grad_buckets.GRAD_BUCKET_BYTES = kept
        out[name] = res
    return out


@pytest.fixture(scope="module")
def sp2():
    return spawn(_run, 2, timeout=600)


def test_segments_buckets_reduce_as_one_all_reduce(sp2):
    for res in sp2:
        merged = res["merged"]
        assert merged["segments"] == LAYERS + 1
        # 4 segments, 4 buckets: one all-reduce of every parameter's gradient in backward
        assert merged["bwd"] == [PARAMS], merged["bwd"]
        assert res["one program"]["bwd"] == [PARAMS]
        assert res["one program"]["segments"] is None


def test_a_cap_splits_the_merged_reduction(sp2):
    for res in sp2:
        sizes = res["capped"]["bwd"]
        assert len(sizes) > 1 and sum(sizes) == PARAMS, sizes
        assert all(n * 4 <= SMALL_CAP for n in sizes), sizes


def test_the_plan_lists_the_merged_all_reduces(sp2):
    from tests.inspect.test_plan_runs import compare
    for res in sp2:
        for name in ("merged", "capped"):
            planned, ran = res[name]["plan_vs_run"]
            assert compare(planned, ran) == [], name


def test_merged_gradients_match_one_device(sp2):
    for res in sp2:
        for name, r in res.items():
            for what in ("loss", "grads", "accumulated", "autograd_grad"):
                assert r[what] < TOL, (name, what, r[what])
