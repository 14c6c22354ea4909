"""Forwards that read tensor values in Python replay the segments of a path seen before
(``spdsl.annotate.breaks``): a call that takes a recorded path traces nothing (counted by
``Segments.traces`` and ``Segments.replays``), and every step is exact against single-device
PyTorch (loss and every gradient, fp32) while the values read change from step to step (an SGD
step between steps, batches whose mean alternates in sign, so the branches switch back and
forth). One launch at SP 2 runs every case.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

import spdsl
from tests.dist import spawn

S, D, TOL = 16, 8, 1e-5


class Lifted(nn.Module):
    """A branch on a global mean per layer and a ``.item()`` scale used only in a tensor op:
    the scale stays a tensor (an input of the next segment), so a new value is no new path."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(D, D) for _ in range(layers))
        self.b = nn.ModuleList(nn.Linear(D, D) for _ in range(layers))

    def forward(self, x):
        for a, b in zip(self.a, self.b):
            h = a(x)
            h = h.relu() if h.mean() > 0 else h.tanh()
            scale = h.pow(2).mean().item()
            x = x + b(h / scale)
        return x.pow(2).mean()

    @torch.no_grad()
    def path(self, x) -> tuple:
        """The branches this batch takes, eagerly."""
        taken = []
        for a, b in zip(self.a, self.b):
            h = a(x)
            taken.append(bool(h.mean() > 0))
            h = h.relu() if taken[-1] else h.tanh()
            x = x + b(h / h.pow(2).mean())
        return tuple(taken)


class Looked(nn.Module):
    """A scale Python also compares: guarded on its exact value, each new value traces."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)

    def forward(self, x):
        h = self.a(x)
        scale = min(h.abs().mean().item(), 1e6)       # a comparison: Python looks at it
        return (h * scale).pow(2).mean()


class Experts(nn.Module):
    """A loop over the experts routing used (``unique().tolist()``) and a boolean mask."""

    def __init__(self, experts: int = 3) -> None:
        super().__init__()
        self.router = nn.Linear(D, experts)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(experts))

    def forward(self, x):
        logits = self.router(x)
        gate, routing = logits.softmax(-1), logits.argmax(-1)
        out = torch.zeros_like(x)
        for e in torch.unique(routing).tolist():
            out = out + gate[..., e:e + 1] * (routing == e).unsqueeze(-1) * self.experts[e](x)
        picked = out[routing == 0]           # x[mask]: how many tokens varies by batch
        return out.pow(2).mean() + picked.sum() / x.shape[1]


class Drawn(nn.Module):
    """A draw from Python's random: every call traces."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.a(x)
        if h.mean() > 0:
            h = h.relu()
        return (self.b(h) if random.random() < 0.5 else h).pow(2).mean()


class Counting(nn.Module):
    """A forward that changes module attributes (a counter, a number it keeps): every call
    traces."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.calls, self.scale = 0, None

    def forward(self, x):
        h = self.a(x)
        self.calls += 1
        self.scale = h.pow(2).mean().item()       # looked at only after the call
        return (h.relu() if h.mean() > 0 else h.tanh()).pow(2).mean() / self.scale


class Handed(nn.Module):
    """A partial sum made before a read and used after it: a segment hands it on as it is (a
    ``Partial`` DTensor) and the next reduces it where it needs it. A number kept on the module,
    read after the call on one rank only (no collective may remain for that read)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.kept = None

    def forward(self, x):
        m = x.pow(2).mean()                   # a partial sum over the split sequence
        h = self.a(x)
        h = h.relu() if h.mean() > 0 else h.tanh()
        self.kept = m.item() * 2              # kept past the call, read later
        return (h * m).pow(2).mean()

    @torch.no_grad()
    def kept_value(self, x) -> float:
        return float(x.pow(2).mean()) * 2


def _batch(k: int, toward: torch.Tensor) -> torch.Tensor:
    """Noise plus a push along ``toward`` whose sign alternates step by step."""
    g = torch.Generator().manual_seed(10 + k)
    return torch.randn(2, S, D, generator=g) + (3.0 if k % 2 else -3.0) * toward


def _steps(model, batches, seed_py: int | None = None, lr: float = 0.05) -> dict:
    """Each step against a single-device copy, then an SGD step on both."""
    ref = copy.deepcopy(model)
    step = spdsl.sp_shard(seq=2)(model)
    worst, counts, paths = 0.0, [], []
    for k, x in enumerate(batches):
        if hasattr(ref, "path"):
            paths.append(ref.path(x))
        if seed_py is not None:
            random.seed(seed_py + k)
        model.zero_grad()
        loss = step(x)
        loss.backward()
        if seed_py is not None:
            random.seed(seed_py + k)
        ref.zero_grad()
        want = ref(x)
        want.backward()
        worst = max(worst, abs(float(loss) - float(want)) / abs(float(want)))
        for p, q in zip(model.parameters(), ref.parameters()):
            if q.grad is None:
                assert p.grad is None or not p.grad.any()
                continue
            worst = max(worst, float((p.grad - q.grad).abs().max() /
                                     q.grad.abs().max().clamp_min(1e-12)))
        with torch.no_grad():
            for m in (model, ref):
                for p in m.parameters():
                    if p.grad is not None:
                        p.sub_(lr * p.grad)
        seg = step._segmented
        counts.append((seg.traces, seg.replays))
    return {"worst": worst, "counts": counts, "volatile": list(seg.volatile.values()),
            "paths": paths}


def check(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    random.seed(0)
    out = {}
    m = Lifted()
    d = m.a[0].weight.detach().mean(0)          # mean(a0(x)) follows x's push along d
    batches = [_batch(k, d / d.norm()) for k in range(6)]
    out["lifted"] = _steps(m, batches)
    torch.manual_seed(1)
    out["looked"] = _steps(Looked(), batches[:3] + batches[:1], lr=0.0)
    torch.manual_seed(2)
    m = Experts()
    with torch.no_grad():
        m.router.bias.copy_(torch.tensor([0.0, 0.3, -0.2]))
    noise = [_batch(k, torch.zeros(D)) for k in (0, 1, 0, 2, 1)]
    with torch.no_grad():
        out["experts_used"] = [torch.unique(m.router(x).argmax(-1)).tolist() for x in noise]
        out["experts_picked"] = [int((m.router(x).argmax(-1) == 0).sum()) for x in noise]
    out["experts"] = _steps(m, noise, lr=0.0)
    torch.manual_seed(3)
    out["drawn"] = _steps(Drawn(), batches[:4], seed_py=20)
    torch.manual_seed(4)
    m = Counting()
    out["counting"] = _steps(m, batches[:3], lr=0.0)
    with torch.no_grad():
        want = float(m.a(batches[2]).pow(2).mean())
    out["kept"] = (float(m.scale), want, type(m.scale).__name__)
    torch.manual_seed(5)
    m = Handed()
    out["handed"] = _steps(m, batches[:3], lr=0.0)
    if rank == 0:              # on one rank only: a collective here would hang the next case
        out["handed_kept"] = (float(m.kept), m.kept_value(batches[2]))
    out["after"] = _steps(Looked(), batches[:1], lr=0.0)["worst"]
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(check, 2)


@pytest.mark.multirank
@pytest.mark.slow
def test_a_path_seen_before_traces_nothing_and_stays_exact(results):
    for r in results:
        got = r["lifted"]
        assert got["worst"] < TOL, got
        # the branches switch back and forth; each path is traced the first time it is taken
        # and replayed after, though the scales are new numbers every step
        paths = got["paths"]
        assert paths[0] != paths[1] and len(set(paths)) < len(paths), paths
        traces = [len(set(paths[:k + 1])) for k in range(len(paths))]
        assert got["counts"] == [(t, k + 1 - t) for k, t in enumerate(traces)], got


@pytest.mark.multirank
@pytest.mark.slow
def test_a_number_python_compares_is_guarded_on_its_value(results):
    for r in results:
        got = r["looked"]
        assert got["worst"] < TOL, got
        # three batches, three values: three traces; the first batch again (no SGD step): a
        # replay of its path
        assert got["counts"] == [(1, 0), (2, 0), (3, 0), (3, 1)], got


@pytest.mark.multirank
@pytest.mark.slow
def test_expert_loop_and_mask_replay_where_the_experts_match(results):
    for r in results:
        got = r["experts"]
        assert got["worst"] < TOL, got
        assert len(set(map(tuple, r["experts_used"]))) == 1, r["experts_used"]
        assert len(set(r["experts_picked"])) > 1, r["experts_picked"]
        # the same experts every step, but x[mask] picks a different number of tokens: a new
        # path for each count seen (the count is its guard), replayed when a count repeats
        picked = r["experts_picked"]
        traces = [len(set(picked[:k + 1])) for k in range(len(picked))]
        assert traces[-1] < len(picked), picked
        assert got["counts"] == [(t, k + 1 - t) for k, t in enumerate(traces)], (got, picked)


@pytest.mark.multirank
@pytest.mark.slow
def test_a_partial_sum_handed_on_and_a_number_read_on_one_rank(results):
    for r in results:
        assert r["handed"]["worst"] < TOL and r["after"] < TOL, (r["handed"], r["after"])
    got, want = results[0]["handed_kept"]
    assert got == pytest.approx(want, rel=1e-6), (got, want)


def test_python_random_and_attribute_changes_trace_every_call(results):
    for r in results:
        for name, why in (("drawn", "random"), ("counting", "attributes")):
            got = r[name]
            assert got["worst"] < TOL, (name, got)
            assert all(rep == 0 for _, rep in got["counts"]), (name, got)
            assert [t for t, _ in got["counts"]] == list(range(1, len(got["counts"]) + 1))
            assert any(why in v for v in got["volatile"]), (name, got)
        kept, want, kind = r["kept"]        # the number the last call kept, read after it
        assert kind == "Lifted" and kept == pytest.approx(want, rel=1e-6), r["kept"]


def test_a_lifted_number_is_read_once_at_the_first_look():
    """``Lifted`` alone: no read until Python looks at it, then one, and every look after sees
    the same float."""
    from spdsl.annotate.lifted import Lifted as Number

    class Reads:
        calls = 0

        def read_number(self, tensor, where):
            Reads.calls += 1
            return float(tensor) * 2          # a value the tensor alone would not give

    n = Number(torch.tensor(1.25), Reads(), "model.py:1")
    assert Reads.calls == 0
    assert n > 2 and Reads.calls == 1                   # the first look reads it
    assert (n + 1, 1 - n, n * 2, n / 5, -n, abs(n)) == (3.5, -1.5, 5.0, 0.5, -2.5, 2.5)
    assert float(n) == 2.5 and f"{n:.1f}" == "2.5" and round(n) == 2 and int(n) == 2
    assert torch.equal(torch.ones(2) * n, torch.full((2,), 2.5))    # outside a trace: the float
    assert Reads.calls == 1
