"""Ulysses attention pipelined by head groups (``spdsl.lower.ops.head_groups``): the grouping
itself (one process), and on 2 and 4 gloo ranks (one launch each): the op with groups equals
the op without (output bitwise, gradients to fp32 rounding), the exchanges are in flight
while another group attends (the order of issues, waits and attention, forward and backward),
the tiny Llama with more heads trains to single-device parity with groups on, eager and
compiled (compiled gradients equal eager ones), the output projection fused into the pipelined
attention (``spdsl.lower.project``) equals the attention followed by the projection and runs
its shares as the groups' outputs arrive, and the plan lists one all-to-all per group each
way, call for call against the process group.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch

from spdsl.lower.ops import head_groups
from tests.dist import spawn

CACHE = os.path.join(tempfile.gettempdir(), "spdsl_inductor_cache")
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-5


@pytest.mark.parametrize("hq,hk,parts,groups", [
    (4, 2, 2, 2), (8, 4, 4, 2), (8, 2, 4, 4), (8, 2, 2, 2), (8, 2, 2, 4), (16, 4, 2, 4),
    (12, 4, 2, 4), (12, 12, 2, 4), (4, 1, 4, 2), (6, 3, 3, 2), (32, 8, 8, 4)])
def test_groups_cover_the_heads_and_carry_what_they_read(hq, hk, parts, groups):
    from spdsl.propagate.heads import kv_repeat
    got = head_groups(hq, hk, parts, groups)
    n = hq // parts
    m = hk * kv_repeat(hq, hk, parts) // parts
    per = n // m
    assert 1 <= len(got) <= groups and n % len(got) == 0
    assert [g.q for g in got] == list(range(0, n, n // len(got)))
    assert sum(g.nq for g in got) == n and sum(g.nk for g in got) == m     # each kv head once
    sent = 0
    for g in got:
        assert g.k == sent
        sent += g.nk
        # the kv heads the group's queries read, all sent by now, and nothing else
        reads = sorted({h // per for h in range(g.q, g.q + g.nq)})
        assert reads == list(range(g.read, g.read + g.n_read))
        assert g.read + g.n_read <= sent
        assert g.nq % g.n_read == 0          # SDPA's grouped-query layout within the group


def test_group_count():
    assert len(head_groups(4, 2, 2, 2)) == 2          # tiny Llama at SP 2: 2 heads, 1 kv head
    assert len(head_groups(4, 2, 4, 2)) == 1          # one head per rank: nothing to pipeline
    assert len(head_groups(12, 4, 2, 4)) == 2         # 6 heads, 3 per kv head: 4 would split one
    assert len(head_groups(8, 4, 4, 1)) == 1          # the switch off
    assert len(head_groups(32, 8, 8, 4)) == 4         # Llama-3.1-8B at SP 8


# -- multi-rank ---------------------------------------------------------------------------

def _op(world: int, rank: int, group: str, hq: int, hk: int, groups: int, mask: bool) -> dict:
    """ulysses_attention with ``groups`` against one group: output, every gradient."""
    from spdsl.lower import ops
    g = torch.Generator().manual_seed(rank + 10 * hq + hk)
    s = 8
    q = torch.randn(2, hq, s, 16, generator=g)
    k, v = (torch.randn(2, hk, s, 16, generator=g) for _ in range(2))
    w = torch.randn(2, hq, s, 16, generator=g)
    full = s * world
    m = None
    if mask:        # per-head boolean mask over the whole sequence, the diagonal always on
        m = (torch.rand(1, hq, full, full, generator=torch.Generator().manual_seed(5)) > 0.4)
        m |= torch.eye(full, dtype=torch.bool)
    res = []
    for n in (1, groups):
        ops.ULYSSES_GROUPS = n
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        o = ops.ulysses_attention(*xs, m, 0.0, m is None, None, hq != hk, world, rank, group)
        (o * w).sum().backward()
        res.append([o.detach()] + [x.grad for x in xs])
    ops.ULYSSES_GROUPS = 2
    return {"groups": len(head_groups(hq, hk, world, groups)),
            "out_equal": torch.equal(res[0][0], res[1][0]),
            "grad_err": max(((a - b).abs().max() / b.abs().max()).item()
                            for a, b in zip(res[1][1:], res[0][1:]))}


def _project(world: int, rank: int, group: str, hq: int, hk: int, groups: int, bias: bool,
             dtype: torch.dtype) -> dict:
    """ulysses_attention with the output projection fused in (``project=``) against the
    attention followed by the projection as the model writes it: output and every gradient
    (q, k, v, the weight, the bias)."""
    from spdsl.lower import ops
    g = torch.Generator().manual_seed(rank + 3 * hq)
    s, d, dm = 8, 16, 24
    q = torch.randn(2, hq, s, d, generator=g, dtype=dtype)
    k, v = (torch.randn(2, hk, s, d, generator=g, dtype=dtype) for _ in range(2))
    wt = torch.randn(hq * d, dm, generator=g, dtype=dtype)
    b = torch.randn(dm, generator=g, dtype=dtype)
    w = torch.randn(2 * s, dm, generator=g, dtype=dtype)
    ops.ULYSSES_GROUPS = groups
    res = []
    for fused in (False, True):
        xs = [t.clone().requires_grad_() for t in (q, k, v, wt, b)]
        bb = xs[4] if bias else None
        args = (*xs[:3], None, 0.0, True, None, hq != hk, world, rank, group)
        if fused:
            y = ops.ulysses_attention(*args, project=(xs[3], bb))
        else:
            flat = ops.ulysses_attention(*args).transpose(1, 2).reshape(2 * s, hq * d)
            y = flat @ xs[3] if bb is None else torch.addmm(bb, flat, xs[3])
        (y * w).sum().backward()
        res.append([y.detach()] + [x.grad for x in xs if x.grad is not None])
    ops.ULYSSES_GROUPS = 2
    assert len(res[0]) == len(res[1]) == 5 + bias
    return {"groups": len(head_groups(hq, hk, world, groups)),
            "err": max(((a - b).abs().max() / b.abs().max()).item()
                       for a, b in zip(res[1], res[0]))}


class _Order(torch.utils._python_dispatch.TorchDispatchMode):
    """The sequence of collective issues, waits and attention ops (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if "all_to_all_single" in name:
            self.seen.append("issue")
        elif "wait_tensor" in name:
            self.seen.append("wait")
        elif "scaled_dot_product" in name:
            self.seen.append("attn_bwd" if "backward" in name else "attn")
        elif name in ("aten::mm", "aten::addmm"):
            self.seen.append("mm")
        return func(*args, **(kwargs or {}))


def _order(world: int, rank: int, group: str) -> dict:
    from spdsl.lower import ops
    q = torch.randn(1, 2 * world, 8, 16, requires_grad=True)
    k = torch.randn(1, world, 8, 16, requires_grad=True)
    v = torch.randn(1, world, 8, 16, requires_grad=True)
    wt = torch.randn(2 * world * 16, 8, requires_grad=True)
    out = {}
    for n in (1, 2, "projected"):
        ops.ULYSSES_GROUPS = 2 if n == "projected" else n
        project = {"project": (wt, None)} if n == "projected" else {}
        with _Order() as fwd:
            o = ops.ulysses_attention(q, k, v, None, 0.0, True, None, True, world, rank, group,
                                      **project)
        with _Order() as bwd:
            o.sum().backward()
        out[n] = (fwd.seen, bwd.seen)
    ops.ULYSSES_GROUPS = 2
    return out


def _llama(world: int, groups: int, compile: bool = False, remat: str = "fit") -> dict:
    import spdsl
    from spdsl.lower import ops
    from spdsl.models.llama import Llama, LlamaConfig
    from tests.parity.cases import _errs, ran_and_planned
    ops.ULYSSES_GROUPS = groups
    cfg = LlamaConfig.tiny().replace(n_heads=8, n_kv_heads=2)      # GQA, 8 / P heads a rank
    torch.manual_seed(0)
    ref = Llama(cfg)
    model = copy.deepcopy(ref)
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    loss_ref = ref(ids, ids)
    loss_ref.backward()
    step = spdsl.sp_shard(seq=world, compile=compile, remat=remat)(model)
    loss = step(ids, ids)
    loss.backward()
    out = _errs(model, ref, loss, loss_ref)
    out["grads"] = [p.grad.clone() for p in model.parameters()]
    lowered = next(iter(step._cache.values())).step.lowered      # the output projection fused
    out["fused"] = sum(1 for n in lowered.graph.nodes if n.kwargs.get("project") is not None)
    if not compile:
        out["ran"], out["planned"] = ran_and_planned(step, model, (ids, ids))
    ops.ULYSSES_GROUPS = 2
    return out


def _complex(world: int, rank: int, group: str) -> dict:
    """Complex tensors through the packed, the in-flight and the gathering exchanges, beside a
    real one: each rank's result against its piece of the global tensors (no exchange)."""
    import spdsl.collectives as C
    from spdsl.collectives.raw import _all_gather_raw
    g = torch.Generator().manual_seed(3)
    full_c = torch.randn(2, 2 * world, 8 * world, 4, dtype=torch.complex64, generator=g)
    full_r = torch.randn(2, 2 * world, 8 * world, 4, generator=g)
    n, h = 8, 2
    mine_c, mine_r = (t[:, :, rank * n:(rank + 1) * n] for t in (full_c, full_r))
    want = [t[:, rank * h:(rank + 1) * h] for t in (full_c, full_r)]
    seq, heads = (2, 1), (1, 1)
    packed = C.all_to_all_many([mine_c, mine_r], [seq] * 2, [heads] * 2, world, group)
    flight = C.all_to_all_many_start([mine_c, mine_r], [seq] * 2, [heads] * 2, world,
                                     group).wait()
    gathered = _all_gather_raw(mine_c.movedim(2, 0).contiguous(), group).movedim(0, 2)
    return {"packed": [torch.equal(a, b) for a, b in zip(packed, want)] +
            [packed[0].dtype == torch.complex64],
            "flight": [torch.equal(a, b) for a, b in zip(flight, want)],
            "gathered": torch.equal(gathered, full_c)}


def _run_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", CACHE)
    group = dist.group.WORLD.group_name
    out = {"op": {}, "complex": _complex(world, rank, group)}
    for hq, hk, groups, mask in ((2 * world, world, 2, False), (4 * world, world, 4, False),
                                 (4 * world, 2 * world, 4, True), (8, 2, 2, False)):
        out["op"][(hq, hk, groups, mask)] = _op(world, rank, group, hq, hk, groups, mask)
    out["project"] = {
        (hq, hk, groups, bias, str(dtype)): _project(world, rank, group, hq, hk, groups, bias,
                                                     dtype)
        for hq, hk, groups, bias in ((2 * world, world, 2, False), (4 * world, world, 4, True),
                                     (8, 2, 2, True))
        for dtype in (torch.float64, torch.float32)}
    out["order"] = _order(world, rank, group)
    out["llama_g1"] = _llama(world, 1)
    out["llama_g2"] = _llama(world, 2)
    out["llama_g2_full"] = _llama(world, 2, remat="full")      # the fused op recomputed
    if world == 2:
        out["llama_g2_compiled"] = _llama(world, 2, compile=True)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"sp{w}")
def results(request):
    world = request.param
    return world, spawn(_run_rank, world, timeout=1800)


@pytest.mark.multirank
@pytest.mark.slow
def test_complex_tensors_cross_the_exchanges(results):
    """gloo has no complex type: complex tensors travel as their real pairs and come back
    complex, equal to the rank's piece of the global tensor, packed beside a real tensor,
    in flight, and gathered."""
    _world, per_rank = results
    for r, res in enumerate(per_rank):
        c = res["complex"]
        assert all(c["packed"]) and all(c["flight"]) and c["gathered"], (r, c)


@pytest.mark.multirank
@pytest.mark.slow
def test_groups_give_the_same_attention(results):
    world, per_rank = results
    for r, res in enumerate(per_rank):
        for key, got in res["op"].items():
            assert got["groups"] > 1, f"sp{world} {key}: not pipelined"
            assert got["out_equal"], f"sp{world} rank {r} {key}: output differs"
            assert got["grad_err"] <= 1e-6, f"sp{world} rank {r} {key}: {got['grad_err']:.2e}"


@pytest.mark.multirank
@pytest.mark.slow
def test_the_fused_output_projection_is_the_projection(results):
    # the same sums in another order: float64 to its rounding, fp32 to its
    world, per_rank = results
    for r, res in enumerate(per_rank):
        for key, got in res["project"].items():
            assert got["groups"] > 1, f"sp{world} {key}: not pipelined"
            bound = 1e-12 if key[-1] == "torch.float64" else 1e-6
            assert got["err"] <= bound, f"sp{world} rank {r} {key}: {got['err']:.2e}"


@pytest.mark.multirank
@pytest.mark.slow
def test_exchanges_in_flight_while_another_group_attends(results):
    _, per_rank = results
    fwd1, bwd1 = per_rank[0]["order"][1]
    assert fwd1 == ["issue", "wait", "attn", "issue", "wait"]
    assert bwd1 == ["issue", "wait", "attn_bwd", "issue", "wait"]
    fwd, bwd = per_rank[0]["order"][2]
    # group 1's exchange issued before group 0 attends; group 0's output issued before
    # group 1 attends; the outputs waited last
    assert fwd == ["issue", "issue", "wait", "attn", "issue", "wait", "attn", "issue",
                   "wait", "wait"]
    # backward mirrors it: both output gradients issued, group 1's awaited and its attention
    # backward run while group 0's is in flight; group 1's input gradients issued before
    # group 0's attention backward, waited after it
    assert bwd == ["issue", "issue", "wait", "attn_bwd", "issue", "wait", "attn_bwd",
                   "issue", "wait", "wait"]
    # the output projection fused in: group 0's share projected once group 1's output is
    # issued, group 1's share last; backward, the output gradients leave as their shares'
    # gradients are known, before any attention backward
    fwd, bwd = per_rank[0]["order"]["projected"]
    assert fwd == ["issue", "issue", "wait", "attn", "issue", "wait", "attn", "issue",
                   "wait", "mm", "wait", "mm"]
    assert bwd.index("issue") < max(i for i, x in enumerate(bwd) if x == "mm")
    assert bwd.count("issue") == 4 and bwd.count("attn_bwd") == 2
    assert max(i for i, x in enumerate(bwd) if x == "mm") < bwd.index("attn_bwd")
    for res in per_rank:
        assert res["order"] == per_rank[0]["order"]


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("name", ["llama_g1", "llama_g2", "llama_g2_full",
                                  "llama_g2_compiled"])
def test_llama_parity_with_groups(results, name):
    world, per_rank = results
    if name not in per_rank[0]:
        pytest.skip(f"{name}: SP 2 only (one cold compile)")
    for r, res in enumerate(per_rank):
        out = res[name]
        assert out["missing"] == [] and out["extra"] == [] and out["n_grads"] > 0
        # groups on: the output projection runs inside each layer's attention
        assert out["fused"] == (0 if name == "llama_g1" else 2), out["fused"]
        assert out["loss"] <= LOSS_RTOL, f"sp{world} rank {r}: loss {out['loss']:.2e}"
        assert out["grad"] <= GRAD_RTOL, f"sp{world} rank {r}: grad {out['grad']:.2e}"
        for a, b in zip(out["grads"], res["llama_g1"]["grads"]):     # groups on against off
            assert ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() <= 1e-5


@pytest.mark.multirank
@pytest.mark.slow
def test_plan_lists_one_exchange_per_group(results):
    from tests.parity.test_parity import plan_vs_run
    _, per_rank = results
    for name, per_layer in (("llama_g1", 2), ("llama_g2", 4), ("llama_g2_full", 4)):
        for r, res in enumerate(per_rank):
            out = res[name]
            ulysses = [p for p in out["planned"] if p[1] == "ulysses"]
            assert len(ulysses) == per_layer * 2, f"{name}: {ulysses}"      # 2 layers
            assert plan_vs_run(out["ran"], out["planned"]) == [], f"{name} rank {r}"
    g1 = [p for p in per_rank[0]["llama_g1"]["planned"] if p[1] == "ulysses"]
    g2 = [p for p in per_rank[0]["llama_g2"]["planned"] if p[1] == "ulysses"]
    assert sum(p[2] for p in g1) == sum(p[2] for p in g2)        # the same elements, forward
    assert sum(p[3] for p in g1) == sum(p[3] for p in g2)        # and backward
