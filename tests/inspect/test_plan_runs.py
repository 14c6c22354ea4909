"""The plan lists what runs: the plan's collectives against the process group's count of one
training step, call for call (kind, elements, forward or backward), on every rank, under each
remat mode, compiled, with sharded state and on a dp x sp mesh.

Two launches: SP 2 on 2 gloo ranks (one compiled case: a cold compile takes 20-80 s here),
dp 2 x sp 2 on 4. Print the table with ``python -m tests.inspect.test_plan_runs``.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.dist import spawn
from tests.parity.cases import ITEMSIZE, counted

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

SP_CASES = ["none", "auto", "full", "full_recompute", "offload", "compiled", "shard_state"]
MESH_CASES = ["dp2xsp2", "dp2xsp2_shard_state"]


def planned_calls(collectives) -> Counter:
    """``(phase, kind, elements)`` of every call the plan lists: an entry with forward bytes
    is one forward call, with backward bytes one backward call."""
    out: Counter = Counter()
    for c in collectives:
        kind = "all_to_all" if c.kind == "halo_exchange" else c.kind
        size = ITEMSIZE[c.values[0].lstrip("(").split("[")[0]]
        for phase, b in (("fwd", c.bytes), ("bwd", c.bytes_bwd)):
            if b:
                out[(phase, kind, b // size)] += 1
    return out


def compare(planned: Counter, ran: Counter) -> list[str]:
    """The differences between the plan's calls and the counted ones (empty: the same)."""
    out = []
    if planned - ran:
        out.append(f"planned, not run: {dict(planned - ran)}")
    if ran - planned:
        out.append(f"run, not planned: {dict(ran - planned)}")
    return out


def _step(name: str, world: int):
    import spdsl
    from spdsl.models.llama import Llama, LlamaConfig
    from spdsl.remat import Remat

    remat = {"none": "none", "auto": "auto", "full": "full", "compiled": "auto",
             "full_recompute": Remat("full", recompute_collectives=True),
             "offload": Remat("full", offload=True), "shard_state": "full",
             "dp2xsp2": "auto", "dp2xsp2_shard_state": "full"}[name]
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    mesh = spdsl.mesh(dp=2, sp=2) if name.startswith("dp2") else None
    step = spdsl.sp_shard(model, seq=2, mesh=mesh, remat=remat, compile=name == "compiled",
                          shard_state=name.endswith("shard_state"))
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    return model, step, ids


def run_cases(rank: int, world: int, names: list[str]) -> dict:
    return {name: _case(name, world) for name in names}


def _case(name: str, world: int) -> dict:
    model, step, ids = _step(name, world)
    step(ids, ids).backward()                   # builds (and compiles) the step
    model.zero_grad(set_to_none=True)
    box = {}
    fwd = counted(lambda: box.setdefault("loss", step(ids, ids)))
    bwd = counted(lambda: box["loss"].backward())
    ran = Counter([("fwd", *c) for c in fwd] + [("bwd", *c) for c in bwd])
    plan = step.plan_call((ids, ids), {})
    return {"ran": ran, "planned": planned_calls(plan.collectives),
            "recomputed": sum(c.recomputed for c in plan.collectives),
            "buckets": [c.carries for c in plan.collectives if c.purpose == "gradient"],
            "n_params": len(list(model.parameters()))}


@pytest.fixture(scope="module")
def sp2():
    return spawn(run_cases, 2, SP_CASES, timeout=1200)


@pytest.fixture(scope="module")
def mesh4():
    return spawn(run_cases, 4, MESH_CASES, timeout=1200)


@pytest.mark.parametrize("name", SP_CASES)
def test_plan_lists_every_call_at_sp2(sp2, name):
    for r, res in enumerate(sp2):
        out = res[name]
        assert out["ran"], "nothing was counted"
        assert compare(out["planned"], out["ran"]) == [], f"{name}, rank {r}"


@pytest.mark.parametrize("name", MESH_CASES)
def test_plan_lists_every_call_on_a_dp_sp_mesh(mesh4, name):
    for r, res in enumerate(mesh4):
        out = res[name]
        assert out["ran"], "nothing was counted"
        assert compare(out["planned"], out["ran"]) == [], f"{name}, rank {r}"


def test_gradients_go_in_one_bucket_that_names_its_parameters(sp2):
    out = sp2[0]["none"]
    assert len(out["buckets"]) == 1 and len(out["buckets"][0]) == out["n_params"]
    assert sp2[0]["shard_state"]["buckets"] == []      # reduce-scattered one by one instead


def test_recomputed_collectives_are_listed(sp2):
    res = sp2[0]
    assert res["none"]["recomputed"] == res["full"]["recomputed"] == 0
    # 2 layers x head groups (2 heads a rank) x (q/k/v in, output out)
    from spdsl.lower.ops import head_groups
    assert res["full_recompute"]["recomputed"] == 2 * len(head_groups(4, 2, 2)) * 2
    assert res["shard_state"]["recomputed"] > 0           # parameter gathers, again


def test_compare_sees_a_difference():
    planned = Counter({("fwd", "all_to_all", 8): 2, ("bwd", "all_reduce", 6): 1})
    assert compare(planned, Counter(planned)) == []
    assert compare(planned, planned - Counter({("fwd", "all_to_all", 8): 1}))
    assert compare(planned, planned + Counter({("bwd", "all_to_all", 8): 1}))
    assert compare(planned, Counter({("fwd", "all_to_all", 8): 2, ("bwd", "all_reduce", 5): 1}))


def _table(results: list, names: list[str]) -> list[str]:
    head = f"{'mode':22} {'phase':5} {'kind':14} {'planned n / elements':>22} "
    lines = [head + f"{'counted n / elements':>22}"]
    for name in names:
        out = results[0][name]
        keys = sorted({k[:2] for k in out["planned"]} | {k[:2] for k in out["ran"]})
        for phase, kind in keys:
            p = [(n, c) for (ph, k, n), c in out["planned"].items() if (ph, k) == (phase, kind)]
            q = [(n, c) for (ph, k, n), c in out["ran"].items() if (ph, k) == (phase, kind)]
            lines.append(f"{name:22} {phase:5} {kind:14} "
                         f"{sum(c for _, c in p):>8} / {sum(n * c for n, c in p):>11} "
                         f"{sum(c for _, c in q):>8} / {sum(n * c for n, c in q):>11}")
    return lines


if __name__ == "__main__":
    print("\n".join(_table(spawn(run_cases, 2, SP_CASES, timeout=1200), SP_CASES)))
    print("\n".join(_table(spawn(run_cases, 4, MESH_CASES, timeout=1200), MESH_CASES)[1:]))
