"""``spdsl.annotate.api``: ``shard``/``sp_shard`` as calls and decorators, their options read
once when wrapped, their argument checks, and ``plan`` of a wrapped or plain function (no
process group)."""

from __future__ import annotations

import pytest
import torch

from spdsl.annotate.api import plan, shard, sp_shard
from spdsl.annotate.sharded import Sharded
from spdsl.errors import ShardingError
from spdsl.pipeline.spec import P
from spdsl.remat import Remat


def _loss(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).sum()


def test_sp_shard_wraps_now_or_as_a_decorator():
    direct = sp_shard(_loss, seq=2, remat="full", axis="cp")
    deco = sp_shard(seq=2, remat="full", axis="cp")
    assert isinstance(direct, Sharded) and not isinstance(deco, Sharded)
    wrapped = deco(_loss)
    for f in (direct, wrapped):
        assert f.axis == "cp" and f.remat == Remat("full") and f.seq_dim == 1
        assert f.__name__ == "_loss"


def test_shard_reads_its_axis_off_the_specs():
    f = shard(_loss, mesh=None, in_specs=(P(None, "tp"),), out_specs=P())
    assert isinstance(f, Sharded) and f.axis == "tp"
    assert shard(mesh=None, in_specs=(P("sp"),))(_loss).axis == "sp"


@pytest.mark.parametrize("seq_dim", [True, -1, 1.0])
def test_seq_dim_is_a_dim_from_the_front(seq_dim):
    with pytest.raises(ShardingError) as e:
        sp_shard(seq=2, seq_dim=seq_dim)
    assert e.value.rule == "sequence dim" and f"seq_dim={seq_dim!r}" in e.value.value


def test_options_are_checked_when_wrapped():
    with pytest.raises(ShardingError):
        sp_shard(seq=2, remat="sometimes")


def test_plan_needs_no_process_group():
    x = torch.randn(2, 8, 4)
    p = plan(sp_shard(seq=4)(_loss), x)
    assert (p.axis, p.parts) == ("sp", 4)
    assert plan(_loss, x).parts == 1          # a plain function: over the job's ranks (none)
