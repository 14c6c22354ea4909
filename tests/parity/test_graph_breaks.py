"""Forwards that read tensor values in Python (graph breaks) run in segments, exactly: loss and
every parameter gradient of ``sp_shard(seq=world)`` against single-device PyTorch (fp32), at
SP 2 and 4, one launch per degree.

Each case's data is chosen so that the value read from one rank's piece differs from the
global one (the test checks that it does): a branch on a rank's local mean takes the other
branch, a rank's local ``unique`` misses an expert, a rank's local scale is another number.
"""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
from torch import nn

import spdsl
from tests.dist import spawn
from tests.propagate.test_tokenwise import Model as TokenLoop

S, D = 16, 8
TOL = 1e-5


class Branch(nn.Module):
    """A branch on a global statistic: the mean of the first projection over every token."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.taken: list[str] = []

    def forward(self, x):
        h = self.a(x)
        if h.mean() > 0:
            self.taken.append("b")
            h = self.b(h).relu()
        else:
            self.taken.append("c")
            h = self.c(h).tanh()
        return h.pow(2).mean()


class Scale(nn.Module):
    """``.item()`` read as a Python float and used as a scale."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        self.read: list[float] = []

    def forward(self, x):
        h = self.a(x)
        scale = h.abs().mean().item() + h.pow(2).mean().item()
        self.read.append(scale)
        return (self.b(h / scale) * h).sum() / x.shape[1]


class LoopMoE(nn.Module):
    """A hand-written mixture of experts looping in Python over the experts routing used."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(D, experts)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(experts))
        self.head = nn.Linear(D, D)
        self.used: list[list[int]] = []

    def forward(self, x):
        logits = self.router(x)
        gate, routing = logits.softmax(-1), logits.argmax(-1)       # [B, S, E], [B, S]
        out = torch.zeros_like(x)
        used = torch.unique(routing).tolist()
        self.used.append(used)
        for e in used:
            w = gate[..., e:e + 1] * (routing == e).unsqueeze(-1)
            out = out + w * self.experts[e](x)
        # the experts' tokens gathered by a boolean mask (a shape from data, with a gradient)
        picked = out[routing == used[0]]
        return self.head(out).pow(2).mean() + picked.sum() / x.shape[1]


class PyLayerDrop(nn.Module):
    """Layers skipped by a draw from Python's random module."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(layers))
        self.kept: list[list[int]] = []

    def forward(self, x):
        kept = [i for i in range(len(self.layers)) if random.random() >= 0.5]
        self.kept.append(kept)
        h = x
        for i in kept:
            h = torch.tanh(self.layers[i](h))
        return h.pow(2).mean()


def _branch_data():
    torch.manual_seed(1)
    m = Branch()
    x = torch.randn(2, S, D) * 0.1
    d = m.a.weight.mean(0)          # mean(a(x)) = d . mean(x) + mean(bias)
    alpha = torch.full((S,), 2.0)
    alpha[: S // 4] = -3.0          # the first quarter pulls the mean down
    x = x + (alpha[:, None] - m.a.bias.mean()) * (d / d.pow(2).sum())
    return m, x.detach()


def _moe_data():
    torch.manual_seed(2)
    m = LoopMoE()
    x = torch.randn(2, S, D)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.bias.copy_(torch.tensor([0.0, 0.5, 0.2, -5.0]))
        m.router.weight[3, 0], m.router.weight[1, 1], m.router.weight[2, 2] = 1.0, 1.0, 1.0
    x[:, :, 0] = -1.0
    x[:, : S // 4, 0] = 20.0       # only the first quarter routes to expert 3
    return m, x


def _local_reads(world: int) -> dict:
    """What each rank would read from its own piece: must differ from the global read."""
    out = {}
    m, x = _branch_data()
    with torch.no_grad():
        out["branch"] = (float(m.a(x).mean()),
                         [float(m.a(c).mean()) for c in x.chunk(world, 1)])
        m2, x2 = _moe_data()
        out["moe"] = (torch.unique(m2.router(x2).argmax(-1)).tolist(),
                      [torch.unique(m2.router(c).argmax(-1)).tolist()
                       for c in x2.chunk(world, 1)])
        m3 = Scale()
        torch.manual_seed(3)
        m3 = Scale()
        x3 = torch.randn(2, S, D)
        x3[:, : S // 4] *= 5.0
        h = m3.a(x3)
        out["scale"] = (float(h.abs().mean() + h.pow(2).mean()),
                        [float(m3.a(c).abs().mean() + m3.a(c).pow(2).mean())
                         for c in x3.chunk(world, 1)])
    return out


def _exact(model: nn.Module, x, world: int, steps: int = 2,
           seed_py: int | None = None, **options) -> dict:
    """Loss and every gradient of the sharded model against a single-device copy; ``x``: the
    input, or a tuple of inputs."""
    xs = x if isinstance(x, tuple) else (x,)
    ref = copy.deepcopy(model)
    step = spdsl.sp_shard(seq=world, **options)(model)
    worst, losses = 0.0, []
    for k in range(steps):
        if seed_py is not None:
            random.seed(seed_py + k)
        model.zero_grad()
        loss = step(*xs)
        loss.backward()
        if seed_py is not None:
            random.seed(seed_py + k)
        ref.zero_grad()
        want = ref(*xs)
        want.backward()
        losses.append((float(loss), float(want)))
        worst = max(worst, abs(float(loss) - float(want)) / abs(float(want)))
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if q.grad is None:
                assert p.grad is None or not p.grad.any(), name
                continue
            assert p.grad is not None, name
            worst = max(worst, float((p.grad - q.grad).abs().max() /
                                     q.grad.abs().max().clamp_min(1e-12)))
    return {"worst": worst, "losses": losses, "ref": ref, "step": step}


def check(rank: int, world: int) -> dict:
    random.seed(0)
    torch.manual_seed(0)
    out = {}
    m, x = _branch_data()
    r = _exact(m, x, world)
    out["branch"] = (r["worst"], m.taken, r["ref"].taken)
    torch.manual_seed(3)
    m = Scale()
    x = torch.randn(2, S, D)
    x[:, : S // 4] *= 5.0
    r = _exact(m, x, world)
    out["scale"] = (r["worst"], m.read, r["ref"].read)
    m, x = _moe_data()
    r = _exact(m, x, world)
    out["moe"] = (r["worst"], m.used, r["ref"].used)
    torch.manual_seed(5)            # the experts loop as Hugging Face writes it, unmarked
    m = TokenLoop()
    ids = torch.randint(0, 32, (2, S))
    out["hf_loop"] = _exact(m, (ids, ids), world)["worst"]
    torch.manual_seed(4)
    m = PyLayerDrop()
    x = torch.randn(2, S, D)
    r = _exact(m, x, world, steps=3, seed_py=10)
    out["random"] = (r["worst"], m.kept, r["ref"].kept)
    # ranks whose Python generators differ are refused before they diverge
    random.seed(rank)
    try:
        spdsl.sp_shard(seq=world)(PyLayerDrop())(x)
        out["unseeded"] = "ran"
    except spdsl.ShardingError as e:
        out["unseeded"] = str(e)
    return out


def check_compiled(rank: int, world: int) -> dict:
    m, x = _branch_data()
    r = _exact(m, x, world, compile=True)
    compiled = [type(e.local).__name__ for p in r["step"]._segmented.programs.values()
                for e in p._cache.values()]
    return {"worst": r["worst"], "taken": m.taken, "compiled": compiled}


@pytest.mark.multirank
@pytest.mark.slow
def test_compiled_segments():
    """compile=True compiles each segment's program (once: the second call reuses them)."""
    for r in spawn(check_compiled, 2):
        assert r["taken"] == ["b", "b"] and r["worst"] < TOL, r
        assert len(r["compiled"]) == 2 and all(c != "GraphModule" for c in r["compiled"]), r


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"sp{w}")
def results(request):
    return request.param, spawn(check, request.param)


def _case(results, name):
    world, ranks = results
    return world, [r[name] for r in ranks]


@pytest.mark.multirank
@pytest.mark.slow
def test_branch_on_a_global_statistic(results):
    world, got = _case(results, "branch")
    glob, local = _local_reads(world)["branch"]
    assert glob > 0 and any(v < 0 for v in local), (glob, local)   # a piece would branch away
    for worst, taken, want in got:
        assert taken == want == ["b", "b"], (taken, want)
        assert worst < TOL, worst


@pytest.mark.multirank
@pytest.mark.slow
def test_item_as_a_float_scale(results):
    world, got = _case(results, "scale")
    glob, local = _local_reads(world)["scale"]
    assert all(abs(v - glob) > 1e-3 * glob for v in local), (glob, local)
    for worst, read, want in got:
        assert read == pytest.approx(want, rel=1e-6), (read, want)
        assert worst < TOL, worst


@pytest.mark.multirank
@pytest.mark.slow
def test_python_loop_over_routed_experts(results):
    world, got = _case(results, "moe")
    glob, local = _local_reads(world)["moe"]
    assert any(v != glob for v in local), (glob, local)        # a piece misses an expert
    for worst, used, want in got:
        assert used == want == [glob, glob], (used, want)
        assert worst < TOL, worst


@pytest.mark.multirank
@pytest.mark.slow
def test_python_random_draw(results):
    _, got = _case(results, "random")
    for worst, kept, want in got:
        assert kept == want, (kept, want)
        assert len({tuple(k) for k in kept}) > 1, kept      # fresh draws every call
        assert worst < TOL, worst
    unseeded = [r["unseeded"] for r in results[1]]
    assert all("[same random state]" in u for u in unseeded), unseeded


@pytest.mark.multirank
@pytest.mark.slow
def test_hugging_face_style_expert_loop(results):
    world, got = _case(results, "hf_loop")
    assert all(worst < TOL for worst in got), got


def test_plan_shows_segments_breaks_and_their_cost():
    m, x = _branch_data()
    state = random.getstate(), torch.get_rng_state()
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(m), x)
    assert random.getstate() == state[0] and torch.equal(torch.get_rng_state(), state[1])
    assert m.taken == ["b"]                 # planned on the global mean, as the run reads it
    (brk,) = plan.breaks
    assert [s.index for s in plan.segments] == [0, 1] and brk.segment == 0
    assert "test_graph_breaks.py:" in brk.where and brk.where.endswith("if h.mean() > 0:")
    assert (brk.kind, brk.collectives, brk.whole) == ("bool", ("all_reduce 4 B",), False)
    m, x = _moe_data()
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(m), x)
    unique, mask = plan.breaks
    assert unique.kind == "unique" and unique.value == "i64[2,16@sp]", unique
    assert unique.collectives == ("all_gather 64 B",) and unique.whole   # 2x4 ids x 8 B
    assert mask.kind == "x[mask]" and mask.whole and mask.segment == 1, mask
    text = str(plan)
    assert text.startswith("3 segments, 2 breaks") and "the whole sequence on every rank" in text
    assert len(json.loads(plan.to_json())["breaks"]) == 2
    # every collective of the call, in order: the same-inputs check, each segment's, the reads'
    seg = plan.segments
    assert [c.purpose for c in seg[0].before] == ["check"]
    assert [(c.kind, c.bytes, c.purpose) for c in unique.issued + mask.issued] == [
        ("all_gather", 64, "read"), ("all_gather", 8, "read")]
    listed = [*seg[0].before, *seg[0].plan.collectives, *unique.issued,
              *seg[1].plan.collectives, *mask.issued, *seg[2].plan.collectives]
    # the segments' gradient buckets merged as backward reduces them: one all-reduce of all
    buckets = [c for c in listed if c.purpose == "gradient"]
    merged = [c for c in plan.collectives if c.purpose == "gradient"]
    assert len(buckets) > 1 and len(merged) == 1, (buckets, merged)
    assert merged[0].bytes_bwd == sum(c.bytes_bwd for c in buckets)
    assert [c for c in plan.collectives if c.purpose != "gradient"] == \
        [c for c in listed if c.purpose != "gradient"]


def test_reads_that_cannot_be_made_right_name_the_line_and_the_fix():
    m, x = _moe_data()
    with pytest.raises(spdsl.ShardingError) as e:       # strict: no op on the whole sequence
        spdsl.plan(spdsl.sp_shard(seq=4, strict=True)(m), x)
    msg = str(e.value)
    assert "[gather]" in msg and "strict=True" in msg, msg
    assert "test_graph_breaks.py:" in msg and "torch.unique(routing).tolist()" in msg, msg
    with torch.device("meta"):
        meta = Branch()
    with pytest.raises(spdsl.ShardingError) as e:       # no values to read on meta tensors
        spdsl.plan(spdsl.sp_shard(seq=4)(meta), x.to("meta"))
    msg = str(e.value)
    assert "[data-dependent control flow]" in msg and "real arguments" in msg, msg
    assert "if h.mean() > 0:" in msg, msg
