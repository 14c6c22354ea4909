"""``spdsl.pipeline.spec``: ``P`` as a frozen value, and ``as_spec``."""

from __future__ import annotations

import pickle

import pytest

from spdsl.errors import ShardingError
from spdsl.pipeline.spec import P, as_spec


def test_p_is_a_value_whose_repr_is_its_constructor():
    p = P(None, "sp", None)
    assert repr(p) == "P(None, 'sp', None)" and repr(P()) == "P()"
    assert eval(repr(p)) == p and p == P(None, "sp", None) and p != P("sp", None, None)
    assert hash(p) == hash(P(None, "sp", None)) and len({p, P(None, "sp", None)}) == 1
    assert pickle.loads(pickle.dumps(p)) == p and type(pickle.loads(pickle.dumps(p))) is P


def test_axis_of_and_sharded():
    p = P("dp", None, "sp")
    assert [p.axis_of(d) for d in range(4)] == ["dp", None, "sp", None]
    assert list(p.sharded()) == [(0, "dp"), (2, "sp")]
    assert list(P(None, None).sharded()) == []


@pytest.mark.parametrize("bad", [1, 0.5, ("sp",), ["sp"]])
def test_entries_are_axis_names_or_none(bad):
    with pytest.raises(TypeError, match="mesh axis names or None"):
        P(None, bad)


def test_as_spec():
    assert as_spec(None, "x") is None
    p = P(None, "sp")
    assert as_spec(p, "x") is p
    assert as_spec((None, "sp"), "x") == p and isinstance(as_spec([None, "sp"], "x"), P)
    with pytest.raises(ShardingError) as e:
        as_spec("sp", "in_specs[0]", 3)
    assert e.value.rule == "spec type" and e.value.value == "in_specs[0]='sp'"
    assert "P(None, 'sp', None)" in e.value.fix and "[batch, seq, ...]" in e.value.fix
