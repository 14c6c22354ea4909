"""``ShardOptions`` (spdsl/annotate/options.py): every option read once, checked when a function
is wrapped, frozen, and carried whole into what is built from it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import spdsl
from spdsl.annotate.options import ShardOptions
from spdsl.remat import Remat


def test_options_are_read_once_and_frozen():
    o = ShardOptions.of(seq_dim=1, remat="full", kernels="off", strict=True,
                        attention="ring", batch="local")
    assert o.remat == Remat.of("full") and o.kernels.mode == "off" and o.strict
    assert o.attention.kind == "ring" and o.batch == "local" and o.seq_dim == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.strict = False
    p = o.replace(seq_dim=None)
    assert p.seq_dim is None and o.seq_dim == 1 and p.remat == o.remat


def test_debug_default_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPDSL_DEBUG", "1")
    assert ShardOptions.of().debug and not ShardOptions.of(debug=False).debug
    monkeypatch.delenv("SPDSL_DEBUG")
    assert not ShardOptions.of().debug


@pytest.mark.parametrize("kwargs, rule", [
    ({"batch": "rows"}, "[batch]"),
    ({"remat": "full", "memory_budget": "40GiB"}, "[memory budget]"),
    ({"memory_budget": "lots"}, "[memory budget]"),
])
def test_a_wrong_option_fails_when_the_function_is_wrapped(kwargs, rule):
    with pytest.raises(spdsl.ShardingError) as e:
        spdsl.sp_shard(seq=2, **kwargs)
    assert rule in str(e.value)


def test_a_memory_budget_becomes_the_fit_budget():
    step = spdsl.sp_shard(torch.nn.Linear(4, 4), seq=2, memory_budget="1GiB")
    assert step.remat.fit and step.remat.budget == 2 ** 30
    assert step.options.remat is step.remat


def test_sharded_takes_options_or_keywords_not_both():
    o = ShardOptions.of(strict=True)
    f = spdsl.Sharded(lambda x: x.sum(), parts=2, options=o)
    assert f.strict and f.options is o
    assert spdsl.Sharded(lambda x: x.sum(), parts=2, strict=True).options == o
    with pytest.raises(TypeError, match="not both"):
        spdsl.Sharded(lambda x: x.sum(), parts=2, options=o, strict=False)


def test_a_segment_takes_the_function_options():
    """A forward that reads a value runs in segments, each a ``Sharded`` of its own, built with
    the function's options (before, a hand copy dropped ``debug`` and ``batch``)."""
    class Branch(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.a(x)
            return (h.relu() if h.mean() > 0 else h).sum()

    step = spdsl.sp_shard(Branch(), seq=2, remat="full", debug=True, kernels="off")
    spdsl.plan(step, torch.randn(1, 8, 4))
    progs = list(step._segmented.programs.values())
    assert progs
    for p in progs:
        assert p.options == step.options.replace(seq_dim=None, shard_state=False)
