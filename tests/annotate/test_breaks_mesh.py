"""Forwards that read tensor values in Python on a dp x sp mesh, with sharded state
(``spdsl.annotate.breaks``): a branch on a global statistic and an ``.item()`` scale, a loop over
the experts routing used (``unique().tolist()``) with a boolean mask, and OPT with layerdrop, at
dp 2 x sp 2 with ``shard_state=True``; the first again with ``batch="local"`` (each dp group passes
its own rows). Every step is exact against single-device PyTorch on the global batch (loss and
every gradient, fp32) while an SGD step between steps changes the values read, and a path seen
before replays (no trace). The values read are global, so every rank of the mesh must draw alike:
ranks whose generators differ across the data axis only are refused on every rank. One launch of
4 ranks runs every case.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import spdsl
from tests.annotate.test_replay import Experts, Lifted
from tests.dist import spawn

B, S, D, TOL = 4, 16, 8, 1e-5


class Dropper(nn.Module):
    """A layer skipped when torch's generator draws below one half (layerdrop, unmarked)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        if torch.rand([]) < 0.5:
            x = self.a(x)
        return self.b(x).pow(2).mean()


def _whole(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _steps(model, batches, rank: int, lr: float = 0.05, **options) -> dict:
    """Each step against a single-device copy on the global batch, then an SGD step on both."""
    ref = copy.deepcopy(model)
    mesh = spdsl.mesh(dp=2, sp=2)
    step = spdsl.sp_shard(model, seq=2, mesh=mesh, **options)
    worst = 0.0
    for x in batches:
        model.zero_grad()
        rows = x.chunk(2)[rank // 2] if options.get("batch") == "local" else x
        loss = step(rows)
        loss.backward()
        ref.zero_grad()
        want = ref(x)
        want.backward()
        worst = max(worst, abs(float(_whole(loss)) - float(want)) / abs(float(want)))
        for p, q in zip(model.parameters(), ref.parameters()):
            if q.grad is None:
                assert p.grad is None or not _whole(p.grad).any()
                continue
            worst = max(worst, float((_whole(p.grad) - q.grad).abs().max() /
                                     q.grad.abs().max().clamp_min(1e-12)))
        with torch.no_grad():
            for m in (model, ref):
                for p in m.parameters():
                    if p.grad is not None:
                        p.sub_(lr * p.grad)
    seg = step._segmented
    return {"worst": worst, "traces": seg.traces, "replays": seg.replays}


def _batches(n: int, toward: torch.Tensor, rows: int = B) -> list:
    """Noise plus a push along ``toward`` whose sign alternates: the branches switch."""
    return [torch.randn(rows, S, D, generator=torch.Generator().manual_seed(10 + k)) +
            (3.0 if k % 2 else -3.0) * toward for k in range(n)]


def _opt(rank: int) -> dict:
    from tests.hf.families import batch, build
    model = build("opt", num_hidden_layers=4, layerdrop=0.5).train()
    ref = copy.deepcopy(model)
    ids, labels = batch(b=B)
    step = spdsl.sp_shard(seq=2, mesh=spdsl.mesh(dp=2, sp=2), shard_state=True)(
        lambda i, lab: model(input_ids=i, labels=lab, use_cache=False).loss)
    out = {"worst": 0.0, "skipped": [], "ref_skipped": []}

    def skipped(m, whole) -> list:
        return [i for i, layer in enumerate(m.model.decoder.layers)
                if all(p.grad is None or not whole(p.grad).any() for p in layer.parameters())]
    for k in range(3):
        torch.manual_seed(7 + k % 2)           # the third step draws as the first
        model.zero_grad()
        loss = step(ids, labels)
        loss.backward()
        torch.manual_seed(7 + k % 2)
        ref.zero_grad()
        want = ref(input_ids=ids, labels=labels, use_cache=False).loss
        want.backward()
        out["skipped"].append(skipped(model, _whole))
        out["ref_skipped"].append(skipped(ref, lambda g: g))
        err = abs(float(_whole(loss)) - float(want)) / abs(float(want))
        top = max(float(q.grad.abs().max()) for q in ref.parameters() if q.grad is not None)
        for p, q in zip(model.parameters(), ref.parameters()):
            if q.grad is not None:
                err = max(err, float((_whole(p.grad) - q.grad).abs().max()) /
                          max(float(q.grad.abs().max()), 1e-3 * top))
        out["worst"] = max(out["worst"], err)
    seg = step._segmented
    out["traces"], out["replays"] = seg.traces, seg.replays
    return out


def check(rank: int, world: int) -> dict:
    out = {}
    torch.manual_seed(0)
    m = Lifted()
    d = m.a[0].weight.detach().mean(0)
    batches = _batches(6, d / d.norm())
    out["lifted"] = _steps(copy.deepcopy(m), batches, rank, shard_state=True)
    out["local"] = _steps(m, batches, rank, batch="local")
    torch.manual_seed(2)
    m = Experts()
    with torch.no_grad():
        m.router.bias.copy_(torch.tensor([0.0, 0.3, -0.2]))
    noise = _batches(4, torch.zeros(D))
    with torch.no_grad():
        out["experts_used"] = [torch.unique(m.router(x).argmax(-1)).tolist() for x in noise]
    out["experts"] = _steps(m, noise, rank, lr=0.0, shard_state=True)
    out["opt"] = _opt(rank)
    torch.manual_seed(rank // 2)        # the sp groups agree, the dp groups do not
    try:
        spdsl.sp_shard(Dropper(), seq=2, mesh=spdsl.mesh(dp=2, sp=2))(torch.randn(B, S, D))
        out["apart"] = "ran"
    except spdsl.ShardingError as e:
        out["apart"] = str(e)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(check, 4)


@pytest.mark.multirank
@pytest.mark.slow
def test_branch_and_item_scale_exact_with_sharded_state(results):
    for r in results:
        for case in ("lifted", "local"):
            got = r[case]
            assert got["worst"] < TOL, (case, got)
            # 6 steps whose branches alternate: a path seen before replays
            assert got["replays"] > 0 and got["traces"] + got["replays"] == 6, (case, got)


@pytest.mark.multirank
@pytest.mark.slow
def test_expert_loop_exact_with_sharded_state(results):
    used = results[0]["experts_used"]
    assert all(len(u) > 1 for u in used), used         # the loop runs over several experts
    for r in results:
        assert r["experts"]["worst"] < TOL, r["experts"]


@pytest.mark.multirank
@pytest.mark.slow
def test_opt_layerdrop_exact_with_sharded_state(results):
    pytest.importorskip("transformers")
    for r in results:
        got = r["opt"]
        assert got["skipped"] == got["ref_skipped"], got
        assert got["skipped"][0] == got["skipped"][2] != got["skipped"][1], got
        assert 0 < sum(map(len, got["skipped"])) < 12, got
        assert (got["traces"], got["replays"]) == (2, 1), got
        assert got["worst"] < TOL, got["worst"]


@pytest.mark.multirank
@pytest.mark.slow
def test_generators_apart_across_the_data_axis_refused_on_every_rank(results):
    for r in results:
        assert "[same random state]" in r["apart"] and "torch.manual_seed" in r["apart"], \
            r["apart"]
