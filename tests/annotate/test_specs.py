"""``spdsl.annotate.specs``: the axis a function's specs split over, and
``with_sharding_constraint`` outside a trace."""

from __future__ import annotations

import pytest
import torch

from spdsl.annotate.specs import _axis_of, with_sharding_constraint
from spdsl.errors import ShardingError
from spdsl.pipeline.spec import P


def test_the_split_axis_is_read_off_the_specs():
    assert _axis_of((P(None, "sp"), None)) == "sp"
    assert _axis_of((P("dp", "sp"),)) == "sp"              # the data axis named first
    assert _axis_of((P("dp", None),)) == "dp"
    assert _axis_of((P("dp", "cp"),), skip="cp") == "dp"
    assert _axis_of(None) is None


def test_a_constraint_outside_a_trace_is_the_value_itself():
    x = torch.randn(2, 4)
    assert with_sharding_constraint(x, P(None, "sp")) is x
    with pytest.raises(ShardingError):
        with_sharding_constraint(x, "sp")
