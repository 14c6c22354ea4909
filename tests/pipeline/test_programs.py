"""``spdsl.pipeline.programs`` in one process, from values alone (a function, a ``Reading``, a
``Job``; no ``Sharded``): the key of a call and what changes it, one entry per key decided as
``Sharded`` decides it, an entry made again when a parameter is frozen, a program already
traced used instead of a trace, and ``prepare`` building the rank's step once."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import spdsl
from spdsl.lower.kernels import KernelChoice
from spdsl.memory.fit import SIZING
from spdsl.pipeline import Job, run
from spdsl.pipeline.programs import Entry, Programs, call_key
from spdsl.pipeline.starts import Reading
from spdsl.propagate.placement import REPLICATE, Shard
from spdsl.propagate.trace import trace
from spdsl.remat import Remat


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return self.b(self.drop(self.a(x)).relu()).pow(2).mean()


def _job(parts: int = 2) -> Job:
    return Job(parts=parts, axis="sp", data_axis=None, data_parts=1,
               remat=Remat.of("none"), kernels=KernelChoice.of("off"), compile=False)


def _reading(parts: int = 2) -> Reading:
    return Reading("sp", parts, seq_dim=1)


def test_the_key_follows_shapes_grad_mode_and_module_state():
    net, x = Net(), torch.randn(1, 16, 8)
    key = call_key(net, (x,), {})
    assert call_key(net, (torch.randn(1, 16, 8),), {}) == key        # values do not count
    assert call_key(net, (torch.randn(1, 32, 8),), {}) != key        # shapes do
    with torch.no_grad():
        assert call_key(net, (x,), {}) != key
    net.eval()
    assert call_key(net, (x,), {}) != key
    net.train()
    assert call_key(net, (x,), {}) == key


def test_an_entry_per_key_decided_as_sharded_decides():
    net, x = Net(), torch.randn(1, 16, 8)
    programs = Programs("net")
    key, entry = programs.entry(net, (x,), {}, _reading(), _job())
    assert isinstance(entry, Entry) and entry.step is None
    assert entry.in_placements == (Shard(1, 1, 16),) and entry.out_placements == (REPLICATE,)
    assert programs.entry(net, (x.clone(),), {}, _reading(), _job()) == (key, entry)
    assert programs.traces == 1 and list(programs.cache) == [key]
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.step = None

    wrapped = spdsl.sp_shard(Net(), seq=2, remat="none", kernels="off")
    theirs = wrapped.build((x,), {})
    assert theirs.in_placements == entry.in_placements
    assert theirs.out_placements == entry.out_placements
    ours = [repr(d.output) for d in entry.prop.decisions.values()]
    assert [repr(d.output) for d in theirs.prop.decisions.values()] == ours

    longer = programs.entry(net, (torch.randn(1, 32, 8),), {}, _reading(), _job())[1]
    assert longer is not entry and programs.traces == 2
    net.a.weight.requires_grad_(False)
    assert entry.stale()
    again = programs.entry(net, (x,), {}, _reading(), _job())[1]
    assert again is not entry and not again.stale() and programs.traces == 3
    assert again.decisions.requires[next(iter(again.traced.graph.graph.nodes))] is False


def test_a_program_already_traced_is_used_on_a_new_key_only():
    net, x = Net(), torch.randn(1, 16, 8)
    traced = trace(net, (x,), {})
    programs = Programs()
    entry = programs.entry(net, (x,), {}, _reading(), _job(), traced=traced)[1]
    assert entry.traced is traced
    other = trace(net, (x,), {})
    assert programs.entry(net, (x,), {}, _reading(), _job(), traced=other)[1] is entry


def test_the_arguments_are_read_with_the_reading_given():
    net, x = Net(), torch.randn(1, 16, 8)
    replicated = Reading("sp", 2)              # no seq_dim, no specs: every input whole
    entry = Programs().entry(net, (x,), {}, replicated, _job())[1]
    assert entry.in_placements == (REPLICATE,)


def test_prepare_builds_the_step_once(one_rank):
    net, x = Net(), torch.randn(1, 16, 8)
    job = dataclasses.replace(_job(1), groups=spdsl.sp_shard(net, seq=1).groups)
    programs = Programs()
    key, entry = programs.prepare(net, (x,), {}, _reading(1), job, SIZING)
    assert entry.step is not None and programs.cache[key] is entry
    assert key in programs.agreed
    assert programs.prepare(net, (x,), {}, _reading(1), job, SIZING)[1] is entry
    torch.testing.assert_close(run(entry.step, (x,), {}), net(x), rtol=1e-6, atol=0)
