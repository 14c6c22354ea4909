"""Mistakes in the arguments of ``sp_shard``/``shard`` and in the traced code: each is a
``ShardingError`` that names the rule, the value as the user wrote it (or in typed-shape
notation), the user's line and the fix. Planning needs no process group."""

from __future__ import annotations

import warnings

import pytest
import torch

import spdsl
from spdsl import P, ShardingError
from spdsl.remat import Remat

HERE = "test_errors.py:"


def _plan(fn, *args, **opts):
    return spdsl.plan(spdsl.sp_shard(seq=4, **opts)(fn), *args)


@pytest.mark.parametrize("seq", [0, -2, 2.0, True])
def test_degree_must_be_a_positive_int(seq):
    with pytest.raises(ShardingError) as e:
        spdsl.sp_shard(seq=seq)
    msg = str(e.value)
    assert "[sequence-parallel degree]" in msg and f"seq={seq!r}" in msg
    assert "sp_shard(seq=4)" in msg and HERE in msg


def test_negative_seq_dim_says_to_count_from_the_front():
    with pytest.raises(ShardingError, match=r"seq_dim=-1") as e:
        spdsl.sp_shard(seq=2, seq_dim=-1)
    assert "seq_dim=1 for [batch, seq, ...]" in str(e.value)


@pytest.mark.parametrize("remat", ["bogus", "-1GiB", -5])
def test_remat_names_the_valid_modes(remat):
    with pytest.raises(ShardingError) as e:
        spdsl.sp_shard(seq=2, remat=remat)(lambda x: x)
    msg = str(e.value)
    assert f"remat={remat!r}" in msg and "cannot read" not in msg
    assert "'none', 'auto' or 'full'" in msg and "'60GiB'" in msg and HERE in msg
    assert isinstance(e.value, ValueError)       # what Remat.of raised before


def test_remat_budgets_still_read():
    assert Remat.of("60GiB").budget == 60 * 2 ** 30 and Remat.of(4096).budget == 4096


@pytest.mark.parametrize("specs,what", [("sp", "in_specs='sp'"), (("sp",), "in_specs[0]='sp'"),
                                        ((P(None, "sp"), "sp"), "in_specs[1]='sp'")])
def test_bare_string_spec_suggests_a_p(specs, what):
    with pytest.raises(ShardingError) as e:
        spdsl.shard(lambda x: x.sum(), mesh=None, in_specs=specs)
    msg = str(e.value)
    assert "[spec type]" in msg and what in msg
    assert "P(None, 'sp')" in msg and HERE in msg


def test_bare_string_out_spec_is_refused_too():
    with pytest.raises(ShardingError, match=r"out_specs='sp'"):
        spdsl.shard(lambda x: x, mesh=None, in_specs=(P(None, "sp"),), out_specs="sp")


def test_bare_string_constraint_is_refused():
    with pytest.raises(ShardingError, match=r"\[spec type\]") as e:
        spdsl.with_sharding_constraint(torch.randn(2, 8, 4), "sp")
    assert "P(None, 'sp', None)" in str(e.value)


def test_wrong_rank_spec_keeps_the_axis():
    f = spdsl.Sharded(lambda x: x.sum(), in_specs=(P("sp"),), parts=2)
    with pytest.raises(ShardingError, match=r"\[spec rank\]") as e:
        f.build((torch.randn(2, 4),), {})
    msg = str(e.value)
    assert "P(None, 'sp') (dim 1, the sequence" in msg and "P('sp', None) (dim 0)" in msg
    assert "P(None, None)" not in msg


def test_wrong_rank_spec_with_two_axes_pads_with_none():
    f = spdsl.Sharded(lambda x: x.sum(), in_specs=(P("dp", "sp"),), parts=2, axis="sp")
    with pytest.raises(ShardingError, match=r"\[spec rank\]") as e:
        f.build((torch.randn(2, 4, 6),), {})
    assert "P('dp', 'sp', None)" in str(e.value)


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
        _plan(fn, torch.randn(2, 16, 8))
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
        plan = _plan(ALONG[name], torch.randn(2, 16, 8))
    ours = [w for w in rec if "spdsl:" in str(w.message)]
    assert len(ours) == 1
    msg = str(ours[0].message)
    assert OPS[name] in msg and "f32[2,16@sp,8]" in msg and "strict=True" in msg
    assert "\n" not in msg and ours[0].filename.endswith("test_errors.py")
    assert any(c.kind == "all_gather" for c in plan.collectives)      # the plan says it too


@pytest.mark.parametrize("name", ["cumsum", "topk"])
def test_strict_makes_it_an_error(name):
    with pytest.raises(ShardingError) as e:
        _plan(ALONG[name], torch.randn(2, 16, 8), strict=True)
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
        return _plan(fn, *args, **opts)


def test_no_warning_along_other_dims_on_integers_or_after_a_chosen_gather():
    x = torch.randn(2, 16, 8)
    _quiet(lambda x: torch.cumsum(x, dim=2).sum(), x)
    _quiet(lambda x: torch.sort(x, dim=-1).values.sum(), x)
    _quiet(lambda i: torch.cumsum(i, dim=1).sum(), torch.ones(2, 16, dtype=torch.long))
    _quiet(lambda x: torch.cumsum(spdsl.with_sharding_constraint(x, P()), 1).sum(), x,
           strict=True)


def test_a_model_with_labels_plans_quietly():
    """The label shift gathers a neighbour's token (a halo), not the sequence: no warning."""
    from spdsl.models.llama import Llama, LlamaConfig
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
