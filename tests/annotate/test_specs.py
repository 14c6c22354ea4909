"""``spdsl.annotate.specs`` (one process, no mesh): specs read into the placements a trace
starts from, the errors for specs that cannot hold, the sequence-dim specs ``sp_shard``
writes, and the constraint's spec encoding."""

from __future__ import annotations

import pytest
import torch

from spdsl.annotate.spec import P
from spdsl.annotate.specs import (
    InputSpecs,
    _axis_of,
    _decode,
    _encode,
    _respelled,
    with_sharding_constraint,
)
from spdsl.errors import ShardingError
from spdsl.propagate.placement import REPLICATE, Shard


def _specs(parts=4, data=None, data_parts=1, seq_dim=None, in_specs=None, batch="global"):
    s = InputSpecs()
    s.axis, s.parts, s.data_axis, s.data_parts, s._mesh = "sp", parts, data, data_parts, None
    s.seq_dim, s.in_specs, s.batch = seq_dim, in_specs, batch
    return s


def test_a_split_spec_is_a_shard_of_the_global_size():
    x = torch.zeros(2, 8, 3)
    assert _specs()._placement_of(x, P(None, "sp", None), 0) == Shard(1, 1, 8)
    assert _specs()._placement_of(x, None, 0) == REPLICATE
    assert _specs()._placement_of(x, P(None, None, None), 0) == REPLICATE
    assert _specs()._placement_of(x, (None, "sp", None), 0) == Shard(1, 1, 8)   # a tuple
    assert _specs()._placement_of(x, P(), 0) == REPLICATE       # whole-value replicated


@pytest.mark.parametrize("spec,rule,text", [
    (P(None, "sp"), "spec rank", "P(None, 'sp', None)"),
    (P("sp", "sp", None), "one split dim", "splits two dims"),
    (P(None, None, "sp"), "divisible sequence", "multiple of 4 (e.g. 4)"),
    (P(None, "tp", None), "one split axis", "name 'sp' in every spec"),
])
def test_specs_that_cannot_hold_say_why(spec, rule, text):
    with pytest.raises(ShardingError) as e:
        _specs()._placement_of(torch.zeros(2, 8, 3), spec, 1)
    assert e.value.rule == rule and e.value.where == "argument 1"
    assert text in str(e.value)


def test_the_data_axis_splits_the_batch():
    s = _specs(data="dp", data_parts=2)
    x = torch.zeros(4, 8)
    spec = P("dp", "sp")
    assert s._placement_of(x, spec, 0) == Shard(1, 1, 8)       # the data axis is not "sp"'s
    assert s._data_placement_of(x, spec, 0) == Shard(0, 1, 4)
    assert s._data_placement_of(x, P(None, "sp"), 0) == REPLICATE
    local = _specs(data="dp", data_parts=2, batch="local")
    assert local._data_placement_of(x, spec, 0) == Shard(0, 1, 8)    # rows of every group
    with pytest.raises(ShardingError) as e:
        s._data_placement_of(torch.zeros(3, 8), spec, 0)
    assert e.value.rule == "divisible batch" and "multiple of 2 rows (e.g. 4)" in e.value.fix


def test_sp_shard_specs_split_every_tensor_with_the_sequence_length():
    s = _specs(seq_dim=1, data="dp")
    ids, mask, table = torch.zeros(2, 8), torch.zeros(2, 8, 8), torch.zeros(5, 3)
    got = s._specs_for((ids, mask, table, 3), {}, [ids, mask, table, 3])
    assert got == [P("dp", "sp"), P("dp", "sp", None), None, None]


def test_in_specs_mirror_the_arguments():
    s = _specs(in_specs=(P(None, "sp"), None))
    a, b = torch.zeros(2, 8), [torch.zeros(1), torch.zeros(2)]
    assert s._specs_for((a, b), {}, [a, *b]) == [P(None, "sp"), None, None]
    assert _specs()._specs_for((a,), {}, [a]) is None


def test_the_split_axis_is_read_off_the_specs():
    assert _axis_of((P(None, "sp"), None)) == "sp"
    assert _axis_of((P("dp", "sp"),)) == "sp"              # the data axis named first
    assert _axis_of((P("dp", None),)) == "dp"
    assert _axis_of((P("dp", "cp"),), skip="cp") == "dp"
    assert _axis_of(None) is None


def test_respelled_keeps_the_axis_and_prefers_the_sequence_dim():
    assert _respelled(P("sp"), 2).startswith("P(None, 'sp') (dim 1, the sequence")
    assert _respelled(P(None, "sp", None, None), 2).startswith("P(None, 'sp')")
    assert _respelled(P("dp", "sp", None), 2) == "P('dp', 'sp')"
    assert _respelled(P(None), 3) == "P(None, None, None)"


@pytest.mark.parametrize("spec", [P(), P(None), P("sp"), P(None, "sp", None), P("dp", "sp")])
def test_constraint_specs_survive_their_encoding(spec):
    assert _decode(_encode(spec)) == spec


def test_a_constraint_outside_a_trace_is_the_value_itself():
    x = torch.randn(2, 4)
    assert with_sharding_constraint(x, P(None, "sp")) is x
    with pytest.raises(ShardingError):
        with_sharding_constraint(x, "sp")
