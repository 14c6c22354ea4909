"""Mistakes in the options and arguments of the transforms (``sp_shard``/``shard``, their
``remat=`` read by ``Remat.of``, their specs, ``with_sharding_constraint``'s spec): each is a
``ShardingError`` raised when the transform is made, before any trace, that names the rule, the
value as the user wrote it, the user's line and the fix. A call's specs read against its
arguments are ``tests/pipeline/test_starts.py``'s; mistakes found while propagating are
``tests/propagate/test_errors.py``'s; the mesh's are ``tests/annotate/test_mesh.py``'s."""

from __future__ import annotations

import pytest
import torch

import spdsl
from spdsl import P, ShardingError
from spdsl.remat import Remat

HERE = "test_errors.py:"


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


def test_constraint_is_identity_outside_a_sharded_function():
    x = torch.randn(3)
    assert spdsl.with_sharding_constraint(x, P("sp")) is x
