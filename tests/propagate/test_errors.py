"""Errors a user can cause name the rule, the value in typed-shape notation, where it came
from, and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spdsl
from spdsl import P, ShardingError
from spdsl.models.llama import Llama, LlamaConfig
from tests._util import dtensor_has_strategy


def _plan(model, parts, *args, attention="ulysses"):
    return spdsl.plan(spdsl.sp_shard(seq=parts, attention=attention)(model), *args)


def test_sequence_not_divisible():
    ids = torch.randint(0, 256, (1, 4097))
    with pytest.raises(ShardingError) as e:
        _plan(Llama(LlamaConfig.tiny()), 4, ids, ids)
    msg = str(e.value)
    assert "[divisible sequence]" in msg
    assert "i64[1,4097@sp]" in msg
    assert "multiple of 4" in msg and "4100" in msg


def test_query_heads_not_divisible():
    ids = torch.randint(0, 256, (1, 64))
    with pytest.raises(ShardingError) as e:
        _plan(Llama(LlamaConfig.tiny()), 8, ids, ids)     # 4 query heads over 8 ranks
    msg = str(e.value)
    assert "[divisible heads]" in msg
    assert "f32[1,4,64@sp,16]" in msg
    assert "spdsl/models/llama.py:" in msg and "(layers.0.attention)" in msg
    assert "divides 4" in msg and 'attention="ring"' in msg


def test_heads_fewer_than_ranks_run_hybrid_or_ring_by_default():
    ids = torch.randint(0, 256, (1, 64))
    plan = _plan(Llama(LlamaConfig.tiny()), 8, ids, ids, attention="auto")   # 4 heads, 8 ranks
    assert {c.purpose for c in plan.collectives} >= {"ulysses", "ring"}
    cfg = LlamaConfig.tiny().replace(dim=96, n_heads=6, n_kv_heads=3)
    plan = _plan(Llama(cfg), 4, ids, ids, attention="auto")      # 6 / 3 heads over 4 ranks
    assert "ring" in {c.purpose for c in plan.collectives}


def test_attention_option_mistakes():
    with pytest.raises(ShardingError, match=r"\[attention option\]"):
        spdsl.sp_shard(seq=2, attention="rings")
    ids = torch.randint(0, 256, (1, 64))
    with pytest.raises(ShardingError, match=r"\[hybrid attention\]"):
        _plan(Llama(LlamaConfig.tiny()), 8, ids, ids, attention=("hybrid", 3))


def test_kv_heads_neither_split_nor_repeated():
    cfg = LlamaConfig.tiny().replace(dim=96, n_heads=6, n_kv_heads=3)
    ids = torch.randint(0, 256, (1, 64))
    with pytest.raises(ShardingError, match=r"\[divisible kv heads\]") as e:
        _plan(Llama(cfg), 2, ids, ids)
    assert "f32[1,3,64@sp,16]" in str(e.value)


@torch.library.custom_op("spdsl_test::mirror", mutates_args=())
def mirror(x: torch.Tensor) -> torch.Tensor:
    return x.flip(1)


@mirror.register_fake
def _(x):
    return torch.empty_like(x)


class _Mirror(nn.Module):
    def forward(self, x):
        return mirror(x).sum()


class _Flip(nn.Module):
    def forward(self, x):
        return torch.flip(x, dims=[2]).sum()


def test_unknown_op_on_a_split_value_says_how_to_teach_it():
    x = torch.randn(2, 8, 4)
    with pytest.raises(ShardingError) as e:
        _plan(_Mirror(), 2, x)
    msg = str(e.value)
    assert "[unknown op]" in msg and "spdsl_test.mirror" in msg
    assert "f32[2,8@sp,4]" in msg
    assert "spdsl.register_rule" in msg
    assert "test_errors.py:" in msg


@pytest.mark.skipif(not dtensor_has_strategy(torch.ops.aten.flip.default),
                    reason="DTensor has a flip strategy since torch 2.13 (before: [unknown op])")
def test_ops_without_an_spdsl_rule_use_dtensor_strategies():
    plan = _plan(_Flip(), 2, torch.randn(2, 8, 4))
    flips = [v for v in plan.values if v.op == "aten.flip.default"]
    assert flips[0].typed == "f32[2,8@sp,4]" and flips[0].origin == "dtensor:flip"


def test_register_rule_teaches_an_op():
    from spdsl.propagate.placement import REPLICATE, Shard
    from spdsl.propagate.rules import RULES

    def mirror_rule(ctx):
        p = ctx.placements[0]
        if isinstance(p, Shard) and p.dim == 1:      # reverses dim 1: needs it whole
            return [spdsl.Strategy((REPLICATE,), REPLICATE, None, "mirror")]
        return [spdsl.Strategy((p,), p, None, "mirror")]

    spdsl.register_rule(torch.ops.spdsl_test.mirror, mirror_rule)
    try:
        plan = _plan(_Mirror(), 2, torch.randn(2, 8, 4))
        vals = [v for v in plan.values if v.op == "spdsl_test.mirror.default"]
        assert vals[0].placement == "Replicate()" and vals[0].origin == "mirror"
        assert [c.kind for c in plan.collectives if c.bytes and c.purpose != "check"] == \
            ["all_gather"]
    finally:
        RULES.pop(torch.ops.spdsl_test.mirror, None)


class _TwoConstraints(nn.Module):
    def forward(self, x):
        a = spdsl.with_sharding_constraint(x, P(None, "sp", None))
        b = spdsl.with_sharding_constraint(x, P(None, None, "sp"))
        return (a * 2).sum() + b.sum()


def test_conflicting_constraints_name_both_origins():
    with pytest.raises(ShardingError) as e:
        _plan(_TwoConstraints(), 2, torch.randn(2, 8, 4))
    msg = str(e.value)
    assert "[conflicting constraints]" in msg
    assert msg.count("test_errors.py:") == 2


def test_constraint_is_identity_outside_a_sharded_function():
    x = torch.randn(3)
    assert spdsl.with_sharding_constraint(x, P("sp")) is x


def test_spec_with_wrong_number_of_dims():
    f = spdsl.Sharded(lambda x: x.sum(), in_specs=(P(None, "sp"),), parts=2)
    with pytest.raises(ShardingError, match=r"\[spec rank\]") as e:
        f.build((torch.randn(2, 4, 6),), {})
    assert "one entry per dim" in str(e.value) and "f32[2,4,6]" in str(e.value)


def test_spec_naming_another_axis():
    f = spdsl.Sharded(lambda x, y: (x + y).sum(), in_specs=(P(None, "sp"), P("tp", None)),
                      parts=2)
    with pytest.raises(ShardingError, match=r"\[one split axis\]") as e:
        f.build((torch.randn(2, 4), torch.randn(2, 4)), {})
    assert "'tp'" in str(e.value)


def test_running_without_a_process_group_says_how_to_launch():
    model = Llama(LlamaConfig.tiny().replace(n_layers=1))
    ids = torch.randint(0, 256, (1, 16))
    with pytest.raises(ShardingError, match="torchrun"):
        spdsl.sp_shard(seq=2)(model)(ids, ids)


class _LayerDrop(nn.Module):
    """Skips its layer when a random draw says so, decided in Python (OPT's layerdrop)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        if torch.rand([]) < 0.1:
            return x
        return self.proj(x)


def test_data_dependent_control_flow_runs_in_segments_naming_the_line():
    x = torch.randn(1, 16, 8)
    plan = spdsl.plan(spdsl.sp_shard(seq=2)(_LayerDrop()), x)      # real arguments: planned
    (brk,) = plan.breaks
    assert brk.where.startswith("tests/propagate/test_errors.py:"), brk.where
    assert brk.where.endswith("if torch.rand([]) < 0.1:") and brk.kind == "bool", brk
    with pytest.raises(ShardingError) as e:                      # meta: no values to read
        spdsl.plan(spdsl.sp_shard(seq=2)(_LayerDrop()), x.to("meta"))
    msg = str(e.value)
    assert "[data-dependent control flow]" in msg
    assert "tests/propagate/test_errors.py:" in msg and "if torch.rand([]) < 0.1:" in msg
    assert "real arguments" in msg


def test_dropout_in_attention_past_the_heads_names_the_rule():
    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1)

    q = torch.randn(1, 2, 64, 8)        # 2 heads over 4 ranks: only a ring could run it
    with pytest.raises(ShardingError, match=r"\[ring attention\]") as e:
        spdsl.plan(spdsl.sp_shard(seq=4, seq_dim=2)(attend), q, q, q)
    assert "dropout_p=0.1" in str(e.value)
