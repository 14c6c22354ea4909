"""Errors a user can cause that propagation finds (``spdsl.propagate``): heads that do not
divide the ranks, the attention option, an op with no rule and ``register_rule``, constraints
that conflict, in-place writes to a split value, ops along the sequence (a warning, an error
under ``strict``) and data-dependent control flow. Each names the rule, the value in
typed-shape notation, where it came from (the user's line and module path), and the fix."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import spdsl
from spdsl import P, ShardingError
from spdsl.models.llama import Llama, LlamaConfig
from tests._util import dtensor_has_strategy

HERE = "test_errors.py:"


def _plan(model, parts, *args, attention="ulysses"):
    return spdsl.plan(spdsl.sp_shard(seq=parts, attention=attention)(model), *args)


def _plan4(fn, *args, **opts):
    return spdsl.plan(spdsl.sp_shard(seq=4, **opts)(fn), *args)


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


def test_dropout_in_attention_past_the_heads_names_the_rule():
    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1)

    q = torch.randn(1, 2, 64, 8)        # 2 heads over 4 ranks: only a ring could run it
    with pytest.raises(ShardingError, match=r"\[ring attention\]") as e:
        spdsl.plan(spdsl.sp_shard(seq=4, seq_dim=2)(attend), q, q, q)
    assert "dropout_p=0.1" in str(e.value)


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


@torch.library.custom_op("spdsl_test::reverse_seq", mutates_args=())
def reverse_seq(x: torch.Tensor) -> torch.Tensor:
    return x.flip(1)


@reverse_seq.register_fake
def _(x):
    return torch.empty_like(x)


class _Inner(nn.Module):
    def forward(self, x):
        return reverse_seq(x)


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixer = nn.ModuleList([_Inner()])

    def forward(self, x):
        return self.mixer[0](x * 2).sum()


def test_unknown_op_names_its_module_path_and_line():
    with pytest.raises(ShardingError) as e:
        spdsl.plan(spdsl.sp_shard(seq=2)(_Outer()), torch.randn(2, 8, 4))
    msg = str(e.value)
    assert msg.startswith("[unknown op] spdsl has no propagation rule for "
                          "spdsl_test.reverse_seq.default")
    assert "value: f32[2,8@sp,4]" in msg
    assert HERE in msg and "(mixer.0)" in msg
    assert "spdsl.register_rule(" in msg and "with_sharding_constraint(x, P())" in msg


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


def _slice_write(x):
    y = x * 2
    y[:, :2] = 0
    return y.sum()


def _mask_write(x):
    y = x * 2
    y[y > 0] = 0
    return y.sum()


@pytest.mark.parametrize("fn,op", [(_slice_write, "aten.fill_"), (_mask_write, "aten.index_put_")])
def test_in_place_write_to_a_split_value(fn, op):
    with pytest.raises(ShardingError) as e:
        _plan4(fn, torch.randn(2, 16, 8))
    msg = str(e.value)
    assert "[in-place write to a traced value]" in msg and op in msg
    assert "@sp" in msg and HERE in msg
    assert "masked_fill" in msg and "torch.where" in msg and "unknown op" not in msg


ALONG = {
    "cumsum": lambda x: torch.cumsum(x, dim=1).sum(),
    "sort": lambda x: torch.sort(x, dim=1).values.sum(),
    "argsort": lambda x: torch.argsort(x, dim=1).float().sum(),
    "topk": lambda x: torch.topk(x, 2, dim=1).values.sum(),
    "fft": lambda x: torch.fft.rfft(x, dim=1).real.sum(),
    "cummax": lambda x: torch.cummax(x, dim=1).values.sum(),
}
OPS = {"cumsum": "aten.cumsum", "sort": "aten.sort", "argsort": "aten.sort",
       "topk": "aten.topk", "fft": "aten._fft_r2c", "cummax": "aten.cummax"}


@pytest.mark.parametrize("name", list(ALONG))
def test_op_along_the_sequence_warns_once_at_the_users_line(name):
    with pytest.warns(UserWarning, match="gathers the whole sequence") as rec:
        plan = _plan4(ALONG[name], torch.randn(2, 16, 8))
    ours = [w for w in rec if "spdsl:" in str(w.message)]
    assert len(ours) == 1
    msg = str(ours[0].message)
    assert OPS[name] in msg and "f32[2,16@sp,8]" in msg and "strict=True" in msg
    assert "\n" not in msg and ours[0].filename.endswith("test_errors.py")
    assert any(c.kind == "all_gather" for c in plan.collectives)      # the plan says it too


@pytest.mark.parametrize("name", ["cumsum", "topk"])
def test_strict_makes_it_an_error(name):
    with pytest.raises(ShardingError) as e:
        _plan4(ALONG[name], torch.randn(2, 16, 8), strict=True)
    msg = str(e.value)
    assert "[sequence gathered]" in msg and OPS[name] in msg and "f32[2,16@sp,8]" in msg
    assert HERE in msg and "with_sharding_constraint(x, P())" in msg


def test_shard_takes_strict_too():
    f = spdsl.shard(ALONG["cumsum"], mesh=None, in_specs=(P(None, "sp", None),), strict=True)
    f._parts = 4
    with pytest.raises(ShardingError, match=r"\[sequence gathered\]"):
        spdsl.plan(f, torch.randn(2, 16, 8))


def _quiet(fn, *args, **opts):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return _plan4(fn, *args, **opts)


def test_no_warning_along_other_dims_on_integers_or_after_a_chosen_gather():
    x = torch.randn(2, 16, 8)
    _quiet(lambda x: torch.cumsum(x, dim=2).sum(), x)
    _quiet(lambda x: torch.sort(x, dim=-1).values.sum(), x)
    _quiet(lambda i: torch.cumsum(i, dim=1).sum(), torch.ones(2, 16, dtype=torch.long))
    _quiet(lambda x: torch.cumsum(spdsl.with_sharding_constraint(x, P()), 1).sum(), x,
           strict=True)


def test_a_model_with_labels_plans_quietly():
    """The label shift gathers a neighbour's token (a halo), not the sequence: no warning."""
    ids = torch.randint(0, 256, (1, 64))
    _quiet(Llama(LlamaConfig.tiny()), ids, ids, strict=True)


def test_hugging_face_packed_position_ids_plan_quietly():
    """HF scans the position ids (cumsum along the sequence) to find packed documents: integer
    bookkeeping, not a warning."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(1, 128, (1, 32))
    pos = torch.cat([torch.arange(n) for n in (5, 14, 13)]).unsqueeze(0)
    _quiet(lambda i, l, p: model(input_ids=i, labels=l, position_ids=p, use_cache=False).loss,
           ids, ids, pos, strict=True)


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
