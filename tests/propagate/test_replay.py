"""Tracing a repeated layer once and copying it gives the graph a full trace gives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spdsl.models.llama import Llama, LlamaConfig
from spdsl.models.toys import GPT2Like
from spdsl.propagate import replay as replay_mod
from spdsl.propagate.trace import trace


def _graph(gm: torch.fx.GraphModule) -> list[tuple]:
    out = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        out.append((n.name, n.op, str(n.target), str(n.args), str(n.kwargs),
                    n.meta.get("spdsl_module"), tuple(val.shape)
                    if isinstance(val, torch.Tensor) else None,
                    (n.meta.get("stack_trace") or "").strip().splitlines()[-1:]))
    return out


def _both(model: nn.Module, args: tuple, monkeypatch) -> tuple[list, list, int]:
    count = [0]
    real = replay_mod.LayerReplay._replay

    def counting(self, *a):
        out = real(self, *a)
        count[0] += out is not None
        return out

    monkeypatch.setattr(replay_mod.LayerReplay, "_replay", counting)
    monkeypatch.setenv("SPDSL_TRACE_REPLAY", "0")
    full = _graph(trace(model, args, {}).graph)
    assert count[0] == 0
    monkeypatch.setenv("SPDSL_TRACE_REPLAY", "1")
    fast = _graph(trace(model, args, {}).graph)
    return full, fast, count[0]


@pytest.mark.parametrize("make", [
    lambda: Llama(LlamaConfig.tiny().replace(n_layers=3)),
    lambda: GPT2Like(GPT2Like.Config(n_layers=3)),
], ids=["llama", "gpt2like"])
def test_copied_layers_equal_traced_layers(make, monkeypatch):
    ids = torch.randint(0, 200, (2, 16))
    full, fast, replayed = _both(make(), (ids, ids.clone()), monkeypatch)
    assert replayed == 2                          # layers 1 and 2 copied from layer 0
    assert fast == full


class _Scaled(nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.lin, self.scale = nn.Linear(8, 8), float(i + 1)

    def forward(self, x):
        return self.lin(x) * self.scale           # differs per layer: never copied


class _ReadsOutside(nn.Module):
    def __init__(self, ctx: list) -> None:
        super().__init__()
        self.lin, self.ctx = nn.Linear(8, 8), ctx

    def forward(self, x):
        return self.lin(x) + self.ctx[0]          # a tensor that is not an argument


class _Stack(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.ctx: list = []
        self.layers = nn.ModuleList(
            _Scaled(i) if kind == "scaled" else _ReadsOutside(self.ctx) for i in range(3))

    def forward(self, x):
        self.ctx[:] = [x.sum(-1, keepdim=True)]
        for layer in self.layers:
            x = layer(x)
            self.ctx[:] = [x.mean(-1, keepdim=True)]
        return x.sum()


@pytest.mark.parametrize("kind", ["scaled", "reads_outside"])
def test_layers_that_are_not_identical_are_traced(kind, monkeypatch):
    full, fast, replayed = _both(_Stack(kind), (torch.randn(2, 4, 8),), monkeypatch)
    assert replayed == 0
    assert fast == full
