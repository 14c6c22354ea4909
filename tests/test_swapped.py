"""``spdsl._torch.swapped``: the attribute is the new value inside and what it was after, on
any exit; one the object did not hold itself (a class's, a cached property not yet computed)
shows through again."""

from __future__ import annotations

import functools
import types

import pytest
import torch

from spdsl._torch import swapped


class Base:
    def method(self) -> str:
        return "base"


class Child(Base):
    @staticmethod
    def tool() -> str:
        return "static"

    @functools.cached_property
    def cached(self) -> int:
        return 1


def test_module_attribute_back_after_an_error():
    mod = types.ModuleType("m")
    mod.flag = True
    with pytest.raises(KeyError), swapped(mod, "flag", False) as now:
        assert mod.flag is False and now is False
        raise KeyError("inside")
    assert mod.flag is True


def test_inherited_and_cached_attributes_show_through_again():
    with swapped(Child, "method", lambda self: "swapped"):
        assert Child().method() == "swapped" and "method" in vars(Child)
    assert Child().method() == "base" and "method" not in vars(Child)
    obj = Child()
    with swapped(obj, "cached", 5):
        assert obj.cached == 5
    assert "cached" not in vars(obj) and obj.cached == 1
    with swapped(obj, "cached", 7):               # computed before: its value comes back
        assert obj.cached == 7
    assert vars(obj)["cached"] == 1


def test_descriptors_restored_as_they_were_and_nesting():
    raw = vars(Child)["tool"]
    with swapped(Child, "tool", staticmethod(lambda: "one")):
        with swapped(Child, "tool", staticmethod(lambda: "two")):
            assert Child().tool() == "two"
        assert Child().tool() == "one"
    assert vars(Child)["tool"] is raw and Child().tool() == "static"


def test_a_modules_forward_and_one_removed_inside():
    m = torch.nn.Linear(2, 2)
    with swapped(m, "forward", lambda x: x):
        x = torch.ones(2)
        assert m(x) is x
    assert "forward" not in vars(m) and m(x).shape == (2,)
    with swapped(m, "forward", lambda x: x):
        del m.forward                              # taken away by someone else: nothing left
    assert "forward" not in vars(m)
