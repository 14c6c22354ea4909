"""Replicated constants built already split: each rank computes its own rows of a table made
from ``arange`` (Llama's RoPE ``cos``/``sin``) instead of the global table and a slice of it;
tables that need a gradient, or a float ``arange``, keep the global tensor. Lowered against a
fake process group; the values are checked by the multi-rank parity tests."""

from __future__ import annotations

import torch
from torch import nn

import spdsl
from spdsl import collectives as C
from spdsl.lower.graph import lower
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.pipeline import planning_group

aten = torch.ops.aten


def _local(model, world: int, rank: int, seq: int = 64):
    f = spdsl.sp_shard(seq=world)(model)
    ids = torch.zeros(1, seq, dtype=torch.long)
    entry = f.build((ids, ids), {})
    with planning_group(world) as group:
        return lower(entry.prop, rank, group, entry.out_placements)


def _aranges(gm):
    return [n for n in gm.graph.nodes if n.target in (aten.arange.default, aten.arange.start,
                                                      aten.arange.start_step)]


def test_rope_tables_are_built_per_rank():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    for world, rank in [(2, 1), (4, 2)]:
        gm = _local(model, world, rank)
        rows = 64 // world
        assert [n.args for n in _aranges(gm)] == [(rank * rows, (rank + 1) * rows, 1)]
        assert not [n for n in gm.graph.nodes if n.target is C.take]
        # no op left that makes a [64, head_dim] table
        assert not [n for n in gm.graph.nodes if n.target in (aten.cos.default, aten.sin.default)
                    and n.args[0].target is aten.cat.default
                    and any(a.target is aten.arange.default for a in _ancestors(n))]


def _tied_loss(h: torch.Tensor, emb: nn.Embedding, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy((h @ emb.weight.t()).flatten(0, 1), labels.flatten())


class LearnedFrequencies(nn.Module):
    """Positions times a learned frequency vector: the table needs a gradient."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.freq = nn.Parameter(torch.linspace(0.1, 1.0, dim))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        S = ids.shape[1]
        pos = torch.arange(S, device=ids.device, dtype=torch.float32)[:, None] * self.freq
        return _tied_loss(self.emb(ids) + pos.sin(), self.emb, labels)


def test_a_table_that_needs_a_gradient_stays_global():
    torch.manual_seed(0)
    gm = _local(LearnedFrequencies(), 2, 1)
    assert [n.args for n in _aranges(gm)] == [(64,)]
    assert [n for n in gm.graph.nodes if n.target is C.take]


def test_the_table_is_rebuilt_when_its_gradient_stops_being_needed():
    torch.manual_seed(0)
    model = LearnedFrequencies()
    model.freq.requires_grad_(False)
    gm = _local(model, 2, 1)
    assert [n.args[:2] for n in _aranges(gm)] == [(32, 64)]


def _ancestors(n: torch.fx.Node) -> set:
    seen, todo = set(), list(n.all_input_nodes)
    while todo:
        a = todo.pop()
        if a not in seen:
            seen.add(a)
            todo.extend(a.all_input_nodes)
    return seen


def test_freezing_a_parameter_retraces():
    torch.manual_seed(0)
    model = LearnedFrequencies()
    f = spdsl.sp_shard(seq=2)(model)
    ids = torch.zeros(1, 64, dtype=torch.long)
    first = f.build((ids, ids), {})
    assert f.build((ids, ids), {}) is first
    model.freq.requires_grad_(False)
    again = f.build((ids, ids), {})
    assert again is not first and not again.stale()


class RandomTable(nn.Module):
    """A table drawn at random from positions: rows of the global draw are not a new draw."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        S, D = ids.shape[1], self.emb.embedding_dim
        p = (torch.arange(S, device=ids.device, dtype=torch.float32) / S)[:, None].expand(S, D)
        return _tied_loss(self.emb(ids) + torch.bernoulli(p), self.emb, labels)


def test_a_random_table_stays_global():
    torch.manual_seed(0)
    gm = _local(RandomTable(), 2, 1)
    assert [n.args for n in _aranges(gm)] == [(64,)]
    assert [n for n in gm.graph.nodes if n.target is aten.bernoulli.default]
