"""``spdsl.pipeline.starts`` in one process: specs read into the placements a trace starts
from, the sequence-dim specs ``sp_shard`` writes, the constraint's spec encoding, and every
error a call's specs can raise (the last ones planned on torch's fake 4-rank group)."""

from __future__ import annotations

import pytest
import torch

import spdsl
from spdsl.errors import ShardingError
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.pipeline.spec import P
from spdsl.pipeline.starts import Reading, _respelled, decode, encode
from spdsl.propagate.placement import PARTIAL, REPLICATE, Shard


def _specs(parts=4, data=None, data_parts=1, seq_dim=None, in_specs=None, batch="global",
           **kw):
    return Reading("sp", parts, data, data_parts, batch, seq_dim, in_specs, **kw)


def test_a_split_spec_is_a_shard_of_the_global_size():
    x = torch.zeros(2, 8, 3)
    assert _specs().placement_of(x, P(None, "sp", None), 0) == Shard(1, 1, 8)
    assert _specs().placement_of(x, None, 0) == REPLICATE
    assert _specs().placement_of(x, P(None, None, None), 0) == REPLICATE
    assert _specs().placement_of(x, (None, "sp", None), 0) == Shard(1, 1, 8)   # a tuple
    assert _specs().placement_of(x, P(), 0) == REPLICATE       # whole-value replicated


@pytest.mark.parametrize("spec,rule,text", [
    (P(None, "sp"), "spec rank", "P(None, 'sp', None)"),
    (P("sp", "sp", None), "one split dim", "splits two dims"),
    (P(None, None, "sp"), "divisible sequence", "multiple of 4 (e.g. 4)"),
    (P(None, "tp", None), "one split axis", "name 'sp' in every spec"),
])
def test_specs_that_cannot_hold_say_why(spec, rule, text):
    with pytest.raises(ShardingError) as e:
        _specs().placement_of(torch.zeros(2, 8, 3), spec, 1)
    assert e.value.rule == rule and e.value.where == "argument 1"
    assert text in str(e.value)


def test_the_data_axis_splits_the_batch():
    s = _specs(data="dp", data_parts=2)
    x = torch.zeros(4, 8)
    spec = P("dp", "sp")
    assert s.placement_of(x, spec, 0) == Shard(1, 1, 8)       # the data axis is not "sp"'s
    assert s.data_placement_of(x, spec, 0) == Shard(0, 1, 4)
    assert s.data_placement_of(x, P(None, "sp"), 0) == REPLICATE
    local = _specs(data="dp", data_parts=2, batch="local")
    assert local.data_placement_of(x, spec, 0) == Shard(0, 1, 8)    # rows of every group
    with pytest.raises(ShardingError) as e:
        s.data_placement_of(torch.zeros(3, 8), spec, 0)
    assert e.value.rule == "divisible batch" and "multiple of 2 rows (e.g. 4)" in e.value.fix


def test_sp_shard_specs_split_every_tensor_with_the_sequence_length():
    s = _specs(seq_dim=1, data="dp")
    ids, mask, table = torch.zeros(2, 8), torch.zeros(2, 8, 8), torch.zeros(5, 3)
    got = s.specs_for((ids, mask, table, 3), [ids, mask, table, 3])
    assert got == [P("dp", "sp"), P("dp", "sp", None), None, None]


def test_in_specs_mirror_the_arguments():
    s = _specs(in_specs=(P(None, "sp"), None))
    a, b = torch.zeros(2, 8), [torch.zeros(1), torch.zeros(2)]
    assert s.specs_for((a, b), [a, *b]) == [P(None, "sp"), None, None]
    assert _specs().specs_for((a,), [a]) is None


def test_respelled_keeps_the_axis_and_prefers_the_sequence_dim():
    assert _respelled(P("sp"), 2).startswith("P(None, 'sp') (dim 1, the sequence")
    assert _respelled(P(None, "sp", None, None), 2).startswith("P(None, 'sp')")
    assert _respelled(P("dp", "sp", None), 2) == "P('dp', 'sp')"
    assert _respelled(P(None), 3) == "P(None, None, None)"


@pytest.mark.parametrize("spec", [P(), P(None), P("sp"), P(None, "sp", None), P("dp", "sp")])
def test_constraint_specs_survive_their_encoding(spec):
    assert decode(encode(spec)) == spec


def test_an_axis_the_mesh_lacks_is_named_with_the_mesh_axes():
    with pytest.raises(ShardingError) as e:
        _specs(mesh_axes=("dp", "sp")).placement_of(torch.zeros(2, 8), P(None, "cp"), 1)
    assert e.value.rule == "unknown mesh axis" and e.value.where == "argument 1"
    assert "('dp', 'sp')" in str(e.value)


def test_a_partial_spec_is_read_only_for_a_segment():
    x = torch.zeros(2, 8)
    assert _specs(partial_in=True).placement_of(x, PARTIAL, 0) == PARTIAL
    with pytest.raises(TypeError):
        _specs().placement_of(x, PARTIAL, 0)


# The same errors reached from a call: ``Sharded.build`` on the specs as written, a model
# planned through ``sp_shard``, and a plan on a mesh (torch's fake 4-rank process group).


def _plan(model, parts, *args, attention="ulysses"):
    return spdsl.plan(spdsl.sp_shard(seq=parts, attention=attention)(model), *args)


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


def test_sequence_not_divisible():
    ids = torch.randint(0, 256, (1, 4097))
    with pytest.raises(ShardingError) as e:
        _plan(Llama(LlamaConfig.tiny()), 4, ids, ids)
    msg = str(e.value)
    assert "[divisible sequence]" in msg
    assert "i64[1,4097@sp]" in msg
    assert "multiple of 4" in msg and "4100" in msg


def test_spec_naming_a_missing_mesh_axis(fake_world):
    mesh = spdsl.mesh(sp=4)
    step = spdsl.shard(lambda t: t.sum(), mesh=mesh, in_specs=(P(None, "tp"),), out_specs=P())
    with pytest.raises(ShardingError) as e:
        spdsl.plan(step, torch.randn(2, 8))
    msg = str(e.value)
    assert msg.startswith("[unknown mesh axis] a spec names mesh axis 'tp', but the mesh has "
                          "axes ('sp',)")
    assert "spdsl.mesh(tp=N)" in msg
