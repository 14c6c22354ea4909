"""The named lowerings (``spdsl.propagate.lowerings``): a name is a plain string as well as a
member, a rule may name only a registered one (checked when its ``Strategy`` is built), and
the sets the plan, remat and the data axis read find the strings rules spell."""

from __future__ import annotations

import pytest

from spdsl.propagate.lowerings import (
    AT_ONE_RANK,
    ATTENTION,
    DATA_SHARED,
    NAMES,
    Lowering,
    check,
)
from spdsl.propagate.placement import REPLICATE
from spdsl.propagate.rules import Strategy


def test_a_lowering_is_its_string():
    assert Lowering.ULYSSES == "ulysses" and str(Lowering.SLICE_WINDOW) == "slice_window"
    assert Lowering("mixer_state") is Lowering.MIXER_STATE
    assert NAMES == {m.value for m in Lowering}


def test_the_sets_find_members_and_plain_strings():
    assert "ring" in ATTENTION and Lowering.HYBRID in ATTENTION
    assert "view" not in ATTENTION and "nll_mean" in DATA_SHARED
    assert "ulysses" in AT_ONE_RANK and "ring" not in AT_ONE_RANK
    assert ATTENTION | DATA_SHARED | AT_ONE_RANK <= NAMES
    # what is attention is never a sum over tokens shared with the data axis
    assert not ATTENTION & DATA_SHARED


def test_only_registered_names_pass():
    check(None)
    check("ulysses")
    check(Lowering.RING)
    with pytest.raises(ValueError, match=r"unknown lowering 'ulyses'.*known: .*ulysses"):
        check("ulyses")


def test_a_strategy_naming_an_unknown_lowering_is_refused_when_built():
    assert Strategy((REPLICATE,), REPLICATE, "view").lowering == "view"
    with pytest.raises(ValueError, match="spdsl.propagate.lowerings"):
        Strategy((REPLICATE,), REPLICATE, "gather_all")
