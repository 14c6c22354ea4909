"""What a traced program is keyed on besides its arguments (``spdsl.propagate.modes``): grad
mode, autocast, the default dtype and deterministic algorithms; every plain attribute of every
module reached (``training`` among them, private and non-plain ones not); what a change is
called when a step retraces; and autocast switched off while a traced program runs."""

from __future__ import annotations

import torch
from torch import nn

from spdsl.propagate.modes import describe_change, global_modes, module_modes, run_modes


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.1)
        self.scale = 2.0
        self._calls = 0                    # private: not part of the key
        self.table = [1, 2]                # not a plain value: not part of the key


def test_global_modes_follow_grad_autocast_dtype_and_determinism():
    base = global_modes()
    with torch.no_grad():
        assert dict(global_modes())["grad"] is False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dict(global_modes())["autocast"] == (("cpu", torch.bfloat16),)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert dict(global_modes())["default dtype"] is torch.float64
    finally:
        torch.set_default_dtype(old)
    assert global_modes() == base


def test_module_modes_keep_plain_attributes_of_every_module():
    g = Gate()
    modes = dict(module_modes([g]))
    assert modes["<root>"] == (("scale", 2.0), ("training", True))
    assert dict(modes["drop"])["p"] == 0.1
    assert dict(modes["lin"])["in_features"] == 4
    before = module_modes([g])
    g._calls += 1
    g.table.append(3)
    assert module_modes([g]) == before               # private and non-plain changes: none
    g.eval()
    assert module_modes([g]) != before
    assert [k for k, _ in module_modes([g, Gate()])][:2] == ["0.", "0.lin"]


def _key(shape=(2, 16), training=True, grad=True):
    leaf = (shape, torch.float32, torch.device("cpu"), False, True)
    g = (("grad", grad), ("autocast", ()), ("default dtype", torch.float32),
         ("deterministic", False))
    return (("spec", (leaf,)), (g, (("<root>", (("training", training),)),)))


def test_describe_change_names_what_differs():
    assert describe_change(_key(), _key((2, 32))) == \
        "argument leaf 0: shape (2, 16) -> (2, 32)"
    assert describe_change(_key(), _key(grad=False)) == "grad: True -> False"
    assert describe_change(_key(), _key(training=False)) == "<root>.training: True -> False"
    assert describe_change(_key(), _key()) == \
        "nothing visible (a parameter frozen or unfrozen)"
    (_, leaves), modes = _key()
    assert describe_change(_key(), (("other spec", leaves), modes)) == \
        "the arguments' structure"


def test_describe_change_says_at_most_four_things():
    (spec, _), (g, m) = _key()
    many = ((spec, ()), (g, m))
    attrs = tuple((f"a{i}", i) for i in range(6))
    old = (many[0], (g, (("<root>", attrs),)))
    new = (many[0], (g, (("<root>", tuple((k, v + 1) for k, v in attrs)),)))
    said = describe_change(old, new).split("; ")
    assert said[:4] == [f"<root>.a{i}: {i} -> {i + 1}" for i in range(4)]
    assert said[4:] == ["and 2 more"]


def test_a_traced_program_runs_without_autocast():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with run_modes():
            assert not torch.is_autocast_enabled("cpu")
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype is torch.float32
        assert torch.is_autocast_enabled("cpu")
    with run_modes():                                  # nothing to switch off
        assert not torch.is_autocast_enabled("cpu")
