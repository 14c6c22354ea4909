"""The plan's collectives read off the local program (one process, a fake process group):
one entry per call, buckets naming their parameters, recomputed collectives listed, and the
describer registry. The multi-rank comparison with the process group's count is
``test_plan_runs.py``."""

from __future__ import annotations

import operator

import torch

import spdsl
from spdsl.lower.calls import _REGISTRY, Call, describe, register
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.remat import Remat


def _plan(remat, seq: int = 64, parts: int = 2):
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    ids = torch.randint(0, 256, (1, seq))
    return model, spdsl.plan(spdsl.sp_shard(seq=parts, remat=remat)(model), ids, ids)


def test_one_bucket_carries_every_parameter():
    model, plan = _plan("none")
    grads = [c for c in plan.collectives if c.purpose == "gradient"]
    assert len(grads) == 1
    assert sorted(grads[0].carries) == sorted(n for n, _ in model.named_parameters())
    assert grads[0].bytes == 0
    assert grads[0].bytes_bwd == sum(p.numel() * p.element_size() for p in model.parameters())
    # in the order gradients complete: the head's first, the embedding's last
    assert grads[0].carries[0] == "lm_head.weight"
    assert grads[0].carries[-1] == "tok_embeddings.weight"
    assert grads[0].values[0] == "f32[256,64]"


def test_recomputed_all_to_alls_are_backward_entries():
    from spdsl.lower.ops import head_groups
    _, kept = _plan(Remat("full"))
    _, again = _plan(Remat("full", recompute_collectives=True))
    assert not any(c.recomputed for c in kept.collectives)
    redo = [c for c in again.collectives if c.recomputed]
    first = [c for c in again.collectives if c.kind == "all_to_all" and c.purpose == "ulysses"
             and not c.recomputed]
    # 2 layers x head groups (tiny Llama: 2 heads a rank) x (q/k/v in, output out)
    assert len(redo) == len(first) == 2 * len(head_groups(4, 2, 2)) * 2
    assert [(c.bytes, c.bytes_bwd) for c in redo] == [(0, c.bytes) for c in first]
    assert [c.module for c in redo] == [c.module for c in first]
    assert again.totals.bytes_bwd == kept.totals.bytes_bwd + sum(c.bytes for c in first)
    assert "all_to_all ulysses recomputed" in str(again)


def test_halo_exchange_carries_the_ranks_buffer():
    _, plan = _plan("none", seq=64, parts=4)
    halo = next(c for c in plan.collectives if c.kind == "halo_exchange")
    # rank 0 keeps labels 1..15 of its 16 (int64, one row): they go through the exchange
    assert (halo.bytes, halo.bytes_bwd, halo.values) == (15 * 8, 0, ("i64[1,64@sp]",))


def test_json_round_trip_keeps_recomputed_and_carries():
    _, plan = _plan(Remat("full", recompute_collectives=True))
    again = spdsl.ShardingPlan.from_json(plan.to_json())
    assert again.collectives == plan.collectives
    assert any(c.recomputed for c in again.collectives)
    assert any(c.carries for c in again.collectives)


def _double(x: torch.Tensor, group: str) -> torch.Tensor:
    return x * 2


def test_a_registered_call_is_described():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(3, 4)
    y = g.call_function(_double, (x, "g0"))
    y.meta["val"] = torch.empty(3, 4)
    z = g.call_function(operator.neg, (y,))
    assert describe(y, lambda a: True) == [] and describe(z, lambda a: True) == []

    @register(_double)
    def _(node, grad):
        a, group = node.args
        return [Call("all_reduce", group, 48, 48 if grad(a) else 0, "reshard", (a,)),
                Call("all_gather", group, 0, 0, "reshard", (a,))]     # moves nothing: dropped

    try:
        assert describe(y, lambda a: True) == [Call("all_reduce", "g0", 48, 48, "reshard", (x,))]
        assert describe(y, lambda a: False)[0].bytes_bwd == 0
    finally:
        _REGISTRY.pop(_double)
