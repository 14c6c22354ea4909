"""dp x sp meshes with and without sharded state equal single-device training on the whole
global batch: loss and every parameter gradient (gathered to full), fp32, at dp=2 x sp=2,
dp=1 x sp=4 and dp=4 x sp=1, on the Llama and the toy families (one launch of 4 gloo ranks)."""

from __future__ import annotations

import pytest

from tests.dist import spawn
from tests.parity.mesh_cases import MESHES, MODELS, run_all

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
WORLD = 4


@pytest.fixture(scope="module")
def results():
    return spawn(run_all, WORLD, timeout=1800)


def _get(results, key):
    for r, res in enumerate(results):
        assert "error" not in res[key], f"rank {r} {key}: {res[key]['error']}"
    return [res[key] for res in results]


def _exact(out: dict, what: str) -> None:
    assert out["missing"] == [] and out["extra"] == [], (what, out)
    assert out["n_grads"] > 0
    assert out["loss"] <= LOSS_RTOL, f"{what}: loss rel err {out['loss']:.2e}"
    assert out["grad"] <= GRAD_RTOL, f"{what}: grad rel err {out['grad']:.2e}"


@pytest.mark.parametrize("shard_state", [False, True], ids=["replicated", "shard_state"])
@pytest.mark.parametrize("mesh", MESHES, ids=[f"dp{d}xsp{s}" for d, s in MESHES])
@pytest.mark.parametrize("name", list(MODELS))
def test_loss_and_every_gradient(results, name, mesh, shard_state):
    for out in _get(results, ("parity", name, *mesh, shard_state)):
        _exact(out, f"{name} dp{mesh[0]}xsp{mesh[1]} shard_state={shard_state}")
        assert out["sharded"], "parameters are DTensors exactly when the state is sharded"


def test_sharded_state_under_full_remat(results):
    for out in _get(results, ("parity_full", "llama", 2, 2, True)):
        _exact(out, "remat=full")


def test_each_dp_group_passing_its_own_rows(results):
    for out in _get(results, ("local_batch", 2, 2)):
        _exact(out, 'batch="local"')


def test_functional_form_with_data_axis_specs(results):
    for out in _get(results, ("shard_specs", 2, 2)):
        _exact(out, 'in_specs=(P("dp", "sp"), ...)')


@pytest.mark.parametrize("mesh", [(2, 2), (1, 4)], ids=["dp2xsp2", "dp1xsp4"])
def test_three_adamw_steps_stay_in_parity(results, mesh):
    for out in _get(results, ("adamw_steps", *mesh)):
        assert out["loss"] <= LOSS_RTOL
        # AdamW divides by sqrt(v): gradients near zero amplify rounding (~5e-7 in the
        # gradients becomes ~1e-4 in the weights after three steps). The yardstick is
        # single-device AdamW against itself with the batch summed in other orders.
        assert out["control"] > 0
        assert out["param"] <= max(GRAD_RTOL, 2 * out["control"]), out
        assert out["state_sharded"], "AdamW's moments are DTensor shards"


def _calls(out, kind):
    return [n for k, n in out["calls"] if k == kind]


def _reduces(out) -> list[int]:
    """The all-reduces the process group ran, less the same-inputs check the plan lists (one
    f64 all-reduce, two elements per tensor argument): each must have run exactly once."""
    reduces = _calls(out, "allreduce")
    for k, p, _, b, _ in out["plan"]:
        if p == "check":
            assert k == "all_reduce" and b // 8 in reduces, (b, reduces)
            reduces.remove(b // 8)
    return reduces


@pytest.mark.parametrize("shard_state", [False, True], ids=["replicated", "shard_state"])
@pytest.mark.parametrize("mesh", MESHES, ids=[f"dp{d}xsp{s}" for d, s in MESHES])
def test_each_gradient_reduced_exactly_once(results, mesh, shard_state):
    """Counted at the process group: every parameter's gradient is summed by exactly one
    collective -- a reduce-scatter of its own (sharded state) or its place in one bucketed
    all-reduce (replicated) -- and the loss by one 2-element all-reduce."""
    dp, sp = mesh
    for out in _get(results, ("counted", dp, sp, shard_state)):
        assert all(n >= 0 and not k.startswith("unmatched") for k, n in out["calls"]), \
            out["calls"]                                  # each call paired with its record
        reduces = _reduces(out)
        assert reduces.count(2) == 1, out["calls"]        # the loss (sum, count), once
        grads = [n for n in reduces if n != 2]
        scatters = _calls(out, "reduce_scatter_tensor_coalesced")
        if shard_state:
            assert grads == [], "no all-reduce of gradients on top of the reduce-scatters"
            world = out["world"]
            padded = sorted(-(-r // world) * world for r in out["rows"])
            # one reduce-scatter per parameter, of its whole (padded) gradient
            assert len(scatters) == len(out["rows"])
            assert sum(scatters) >= out["numel"]
            assert len(padded) == len(scatters)
        else:
            assert scatters == []
            assert sum(grads) == out["numel"], (sum(grads), out["numel"])
        a2a = _calls(out, "alltoall_base")
        layers = 2
        if sp > 1:    # Ulysses: q/k/v fused + o per layer, forward and backward (+ label halo)
            assert len([n for n in a2a if n > 64]) == 4 * layers
        else:
            assert a2a == []


@pytest.mark.parametrize("shard_state", [False, True], ids=["replicated", "shard_state"])
@pytest.mark.parametrize("mesh", MESHES, ids=[f"dp{d}xsp{s}" for d, s in MESHES])
def test_plan_lists_what_ran(results, mesh, shard_state):
    """The plan's collectives against the process group's count: all-to-alls, the loss,
    parameter gathers (forward and again in backward) and reduce-scatters; gradient bytes."""
    dp, sp = mesh
    for out in _get(results, ("counted", dp, sp, shard_state)):
        plan = out["plan"]
        ran_a2a = len([n for n in _calls(out, "alltoall_base") if n > 64])
        planned_a2a = sum((2 if b_bwd else 1) for k, p, _, b, b_bwd in plan
                          if k == "all_to_all" and p == "ulysses")
        assert ran_a2a == planned_a2a
        gathers = _calls(out, "allgather_into_tensor_coalesced")
        planned = [(b, b_bwd) for k, p, _, b, b_bwd in plan if k == "all_gather" and p == "state"]
        assert len(gathers) == sum(1 + (bb > 0) for _, bb in planned)
        assert 4 * sum(gathers) == sum(b + bb for b, bb in planned)
        scatters = _calls(out, "reduce_scatter_tensor_coalesced")
        planned_rs = [bb for k, p, _, b, bb in plan if k == "reduce_scatter"]
        assert sorted(4 * n for n in scatters) == sorted(planned_rs)
        grad_bytes = sum(bb for k, p, _, b, bb in plan if p == "gradient")
        ran_grads = sum(n for n in _reduces(out) if n != 2)
        assert 4 * ran_grads == grad_bytes
        assert [a for k, p, a, *_ in plan if p == "loss"] == \
            ["dp+sp" if dp > 1 and sp > 1 else "dp" if dp > 1 else "sp"]


def test_errors(results):
    out = _get(results, ("errors", 2, 2))[0]
    assert "[divisible batch]" in out["batch"] and "i64[3@dp,16]" in out["batch"]
    assert "multiple of 2" in out["batch"]
    assert "[state sharding]" in out["fsdp"] and "fully_shard" in out["fsdp"]
    assert "shard_state=True" in out["fsdp"]


def test_plan_text_and_json_show_the_state_collectives(results):
    import json

    out = _get(results, ("counted", 2, 2, True))[0]
    assert "[mesh dp=2 x sp=2]" in out["text"]
    assert "all_gather state" in out["text"] and "reduce_scatter state" in out["text"]
    assert "sharded state:" in out["text"]
    kinds = {(c["kind"], c["purpose"], c["axis"]) for c in json.loads(out["json"])["collectives"]}
    assert {("all_gather", "state", "dp+sp"), ("reduce_scatter", "state", "dp+sp"),
            ("all_to_all", "ulysses", "sp"), ("all_reduce", "loss", "dp+sp")} <= kinds
