"""A replayed call runs its segments' built steps directly (``spdsl.annotate.breaks``): no
segment goes through ``Sharded.prepare`` or computes its call key once the path is recorded,
its outputs pass to the next segment as this rank's pieces, and every step stays exact against
single-device PyTorch (loss and every gradient, fp32). A parameter frozen after the path was
recorded builds each segment again once (its gradient is gone), then replays directly again.
One launch at SP 2 runs every case.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import spdsl
from tests.dist import spawn

S, D, TOL = 16, 8, 1e-5


class Reads(nn.Module):
    """Per layer: a branch on the layer's global mean and a ``.item()`` scale."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(D, D) for _ in range(layers))
        self.b = nn.ModuleList(nn.Linear(D, D) for _ in range(layers))

    def forward(self, x):
        for a, b in zip(self.a, self.b):
            h = a(x)
            h = h.relu() if h.mean() > 0 else h.tanh()
            x = x + b(h / h.pow(2).mean().item())
        return x.pow(2).mean()


def _worst(model, ref) -> float:
    worst = 0.0
    for p, q in zip(model.parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None, "a gradient where one device has none"
            continue
        worst = max(worst, float((p.grad - q.grad).abs().max() /
                                 q.grad.abs().max().clamp_min(1e-12)))
    return worst


def check(rank: int, world: int) -> dict:
    import spdsl.pipeline.programs as programs
    from spdsl.annotate.breaks import _Segment
    from spdsl.annotate.sharded import Sharded

    calls = {"prepare": 0, "key": 0, "wrapped": 0}
    prepare, key, from_local = Sharded.prepare, programs.call_key, DTensor.from_local

    def counted_prepare(self, *a, **kw):
        calls["prepare"] += isinstance(self, _Segment)
        return prepare(self, *a, **kw)

    def counted_key(fn, *a, **kw):
        # a segment's function is the empty GraphModule it is built on (the model is not one)
        calls["key"] += isinstance(fn, torch.fx.GraphModule)
        return key(fn, *a, **kw)

    def counted_from_local(*a, **kw):
        calls["wrapped"] += 1
        return from_local(*a, **kw)

    Sharded.prepare, programs.call_key = counted_prepare, counted_key
    DTensor.from_local = staticmethod(counted_from_local)
    torch.manual_seed(0)
    model = Reads()
    ref = copy.deepcopy(model)
    step = spdsl.sp_shard(seq=world)(model)
    g = torch.Generator().manual_seed(7)
    # one batch, its values changed by the SGD steps, its branches not: one path, recorded
    # by the first call
    batches = [torch.randn(2, S, D, generator=g)] * 7
    out = {"worst": [], "calls": [], "counts": [], "wrapped": []}
    for k, x in enumerate(batches):
        if k == 4:            # frozen after the path was recorded: every segment re-keys
            model.a[0].weight.requires_grad_(False)
            ref.a[0].weight.requires_grad_(False)
        calls.update(prepare=0, key=0, wrapped=0)
        model.zero_grad()
        ref.zero_grad()
        loss = step(x)
        out["wrapped"].append(calls["wrapped"])      # DTensors made in forward
        loss.backward()
        out["calls"].append((calls["prepare"], calls["key"]))
        want = ref(x)
        want.backward()
        out["worst"].append(max(abs(float(loss) - float(want)) / abs(float(want)),
                                _worst(model, ref)))
        out["frozen_grad"] = model.a[0].weight.grad
        with torch.no_grad():
            for m in (model, ref):
                for p in m.parameters():
                    if p.grad is not None:
                        p.sub_(0.01 * p.grad)
        seg = step._segmented
        out["counts"].append((seg.traces, seg.replays))
    out["segments"] = len(seg.last) + 1
    Sharded.prepare, programs.call_key = prepare, key
    DTensor.from_local = staticmethod(from_local)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(check, 2)


@pytest.mark.multirank
@pytest.mark.slow
def test_a_replayed_call_skips_the_segments_full_call_and_stays_exact(results):
    for r in results:
        assert max(r["worst"]) < TOL, r["worst"]
        # one trace, then replays only
        assert r["counts"] == [(1, k) for k in range(len(r["counts"]))], r["counts"]
        first, replayed = r["calls"][0], r["calls"][1:4]
        assert first[0] >= r["segments"] > 1, (first, r["segments"])
        # a segment's outputs pass to the next as pieces: the traced call hands DTensors on,
        # a replayed one none (what the reads make whole here is replicated already)
        assert r["wrapped"][0] > 0 and r["wrapped"][1:4] == [0] * 3, r["wrapped"]
        assert replayed == [(0, 0)] * 3, r["calls"]


@pytest.mark.multirank
@pytest.mark.slow
def test_a_parameter_frozen_builds_each_segment_again_once(results):
    for r in results:
        assert r["frozen_grad"] is None
        # the first call after freezing: each segment through its full call (a new key, a
        # new build); the ones after: directly again
        assert r["calls"][4][0] == r["segments"], (r["calls"], r["segments"])
        assert r["calls"][5:] == [(0, 0)] * 2, r["calls"]
        assert max(r["worst"][4:]) < TOL, r["worst"]
