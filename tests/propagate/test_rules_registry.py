"""One rule per op: a second registration is an error, not a silent override."""

from __future__ import annotations

import pytest
import torch

import spdsl
from spdsl.propagate.rules import RULES, lookup


def _same(ctx):
    return [spdsl.Strategy((ctx.placements[0],), ctx.placements[0], None, "same")]


def test_every_op_has_one_rule_and_the_known_ones_are_their_family():
    aten = torch.ops.aten
    assert RULES[aten.tril].__name__ == "triangle"
    assert RULES[aten.native_dropout].__name__ == "dropout"


def test_second_registration_is_an_error():
    with pytest.raises(ValueError, match="already has the rule 'triangle'"):
        spdsl.register_rule(torch.ops.aten.tril, _same)
    assert RULES[torch.ops.aten.tril].__name__ == "triangle"


def test_replace_on_purpose():
    op = torch.ops.aten.triu
    old = RULES[op]
    try:
        spdsl.register_rule(op, _same, replace=True)
        assert lookup(op) is _same
    finally:
        spdsl.register_rule(op, old, replace=True)
