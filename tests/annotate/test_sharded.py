"""``Sharded`` (spdsl/annotate/sharded.py) in one process: the decisions cached per call
signature and made again only when the signature changes, a frozen parameter making them
stale, the warning when a step keeps tracing, ``prepare`` building the rank's program without
running it, and a wrapped module's own attributes reachable through it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import spdsl


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.note = "kept"

    def forward(self, x):
        return self.b(self.a(x).relu()).pow(2).mean()


def test_decisions_are_cached_per_call_signature():
    step = spdsl.sp_shard(Net(), seq=2)
    x = torch.randn(1, 16, 8)
    first = step.build((x,), {})
    assert step.build((torch.randn(1, 16, 8),), {}) is first       # same shapes: no trace
    assert step._traces == 1
    longer = step.build((torch.randn(1, 32, 8),), {})               # a new length: a new one
    assert longer is not first and step._traces == 2 and len(step._cache) == 2
    step.module.eval()                                              # train/eval is in the key
    assert step.build((x,), {}) is not first and step._traces == 3


def test_freezing_a_parameter_makes_the_decisions_stale():
    m = Net()
    step = spdsl.sp_shard(m, seq=2)
    x = torch.randn(1, 16, 8)
    first = step.build((x,), {})
    assert not first.stale()
    m.a.weight.requires_grad_(False)
    assert first.stale()
    again = step.build((x,), {})
    assert again is not first and not again.stale()


def test_a_step_that_keeps_tracing_says_what_changed():
    class Counter(Net):
        def forward(self, x):
            self.calls = getattr(self, "calls", 0) + 1      # a plain attribute: in the key
            return super().forward(x)

    step = spdsl.sp_shard(Counter(), seq=2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(17):
            step.build((torch.randn(1, 16, 8),), {})
            step.module.calls += 1
    said = [str(w.message) for w in seen if "traced 16 programs" in str(w.message)]
    assert len(said) == 1 and "calls" in said[0], [str(w.message) for w in seen]


def test_prepare_builds_the_rank_program_without_running_it(one_rank):
    step = spdsl.sp_shard(Net(), seq=1)
    x = torch.randn(1, 16, 8)
    entry = step.prepare(x)
    assert entry.step is not None and entry.local is entry.step.program
    assert step.plan_of(entry, (x,), {}).remat is not None   # remat="fit" chose, and said why
    assert step.prepare(x) is entry


def test_a_wrapped_module_keeps_its_attributes():
    m = Net()
    step = spdsl.sp_shard(m, seq=2)
    assert step.note == "kept" and step.module is m
    assert list(step.parameters()) == list(m.parameters())
    with pytest.raises(AttributeError):
        step.missing         # noqa: B018
    f = spdsl.sp_shard(seq=2)(lambda x: x.sum())
    with pytest.raises(AttributeError):
        f.parameters         # noqa: B018
