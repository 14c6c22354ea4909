"""``spdsl.pipeline.decide`` in one process: the decisions of a tiny Llama at four ranks
(Ulysses at every attention, the loss whole, hidden states split on the sequence), frozen and
one per call signature, made from values alone (a trace, ``Starts``, the ``Job``) the same as
``Sharded`` makes them, ``out_specs`` pins and partial outputs kept, the data axis on a dp x sp
mesh (a constraint naming both axes pinning each), and the refusal of ``shard_state`` over a
parameter that is still whole."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import spdsl
import spdsl.pipeline as PR
from spdsl import P
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.pipeline.decide import Decisions, Starts, decide, out_nodes
from spdsl.propagate.forms import is_attention_node
from spdsl.propagate.placement import PARTIAL, REPLICATE, Shard
from spdsl.propagate.trace import trace

SEQ = 64


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.tiny())


def _loss_and_hidden(model: Llama):
    def f(ids, labels):
        return model(ids, labels), model.tok_embeddings(ids)
    return f


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _outputs(d: Decisions) -> list:
    """What propagation decided for each node, in graph order (comparable across traces)."""
    return [(n.op, str(n.target), repr(d.prop.decisions[n].output))
            for n in d.traced.graph.graph.nodes if n in d.prop.decisions]


def test_four_ranks_of_attention_are_ulysses_and_the_outputs_are_placed():
    ids = _ids()
    f = spdsl.sp_shard(seq=4, remat="none")(_loss_and_hidden(_model()))
    d = f.build((ids, ids), {}).decisions
    attention = [n for n in d.traced.graph.graph.nodes if is_attention_node(n)]
    assert len(attention) == LlamaConfig.tiny().n_layers
    assert [d.prop.decisions[n].strategy.lowering for n in attention] == ["ulysses"] * 2
    assert d.in_placements == (Shard(1, 1, SEQ), Shard(1, 1, SEQ))
    assert d.out_placements == (REPLICATE, Shard(1, 1, SEQ))   # the loss; [B, S, D] split
    assert d.data is None and d.sharded == () and dict(d.reduced) == {}
    assert d.state_requires == tuple(isinstance(t, torch.nn.Parameter) for t in d.traced.state)
    assert not d.stale()


def test_decisions_are_frozen_and_one_per_call_signature():
    ids, model = _ids(), _model()
    f = spdsl.sp_shard(seq=4, remat="none")(_loss_and_hidden(model))
    entry = f.build((ids, ids), {})
    d = entry.decisions
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.out_placements = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.step = None
    with pytest.raises(TypeError):
        d.requires[next(iter(d.requires))] = False      # a read-only view
    assert f.build((ids.clone(), ids.clone()), {}).decisions is d     # same key, same value
    assert f.build((ids[:, :32], ids[:, :32]), {}).decisions is not d
    model.layers[0].attention_norm.weight.requires_grad_(False)
    assert d.stale() and f.build((ids, ids), {}).decisions is not d


def test_decide_from_values_alone_is_what_sharded_decides():
    ids, model = _ids(), _model()
    f = spdsl.sp_shard(seq=4, remat="none")(_loss_and_hidden(model))
    by_sharded = f.build((ids, ids), {}).decisions
    split = (Shard(1, 1, SEQ), "in_specs[0]")
    starts = Starts((split, split), (REPLICATE, REPLICATE), (False, False))
    d = decide(trace(_loss_and_hidden(model), (ids, ids), {}), starts, f.job)
    assert d.out_placements == by_sharded.out_placements
    assert _outputs(d) == _outputs(by_sharded) and len(_outputs(d)) > 50
    # out_specs pin an output (P() says whole): the hidden states gathered
    pinned = decide(trace(_loss_and_hidden(model), (ids, ids), {}),
                    dataclasses.replace(starts, outs=(None, REPLICATE)), f.job)
    assert pinned.out_placements == (REPLICATE, REPLICATE)


def test_a_partial_output_stays_partial_only_where_asked():
    x = torch.randn(2, SEQ, 8)
    w = torch.randn(8, 8)

    def f(x):
        return (x @ w).sum(1)            # a sum over the split sequence: a partial sum

    job = spdsl.sp_shard(seq=4, remat="none")(f).job
    starts = Starts(((Shard(1, 1, SEQ), "in_specs[0]"),), (REPLICATE,), (False,))
    whole = decide(trace(f, (x,), {}), starts, job)
    kept = decide(trace(f, (x,), {}), dataclasses.replace(starts, keep_partial=True), job)
    assert kept.prop.placement(out_nodes(kept.traced)[0]) == PARTIAL
    assert whole.out_placements == (REPLICATE,) and kept.out_placements == (PARTIAL,)


def test_the_data_axis_is_decided_before_the_sequence_axis():
    ids = _ids()
    with PR.planning_group(4):
        f = spdsl.sp_shard(seq=2, remat="none")(_loss_and_hidden(_model()))   # dp 2 x sp 2
        d = f.build((ids, ids), {}).decisions
    assert d.data is not None and d.data.parts == 2
    assert d.data_in == (Shard(0, 1, 2), Shard(0, 1, 2))       # the batch's rows
    assert d.data_out == (REPLICATE, Shard(0, 1, 2))
    assert d.in_placements == (Shard(1, 1, SEQ), Shard(1, 1, SEQ))


def test_a_constraint_naming_both_axes_pins_each_axis_in_one_walk():
    def f(x):
        a = spdsl.with_sharding_constraint(x * 2, P("dp", None, "sp"))    # tokens -> features
        b = spdsl.with_sharding_constraint(a + 1, P(None, "sp", None))    # dp free: as it comes
        c = spdsl.with_sharding_constraint(b * 3, P("dp", None, None))    # sp gathered
        return c.sum()

    with PR.planning_group(4):
        g = spdsl.shard(f, mesh=spdsl.mesh(dp=2, sp=2), in_specs=(P("dp", "sp", None),),
                        out_specs=P())
        d = g.build((torch.randn(4, SEQ, 8),), {}).decisions
    a, b, c = [n for n in d.traced.graph.graph.nodes
               if n.target is torch.ops.spdsl.constraint.default]
    rows, seq, features = Shard(0, 1, 4), Shard(1, 1, SEQ), Shard(2, 1, 8)
    assert [d.prop.decisions[n].redistribute for n in (a, b, c)] == [
        {0: (seq, features)}, {0: (features, seq)}, {0: (seq, REPLICATE)}]
    assert [d.data.placement(n) for n in (a, b, c)] == [rows] * 3
    assert not any(d.data.decisions[n].redistribute for n in (a, b, c))


def test_shard_state_refuses_a_parameter_that_is_still_whole():
    ids, model = _ids(), _model()
    f = spdsl.sp_shard(seq=4, remat="none")(_loss_and_hidden(model))
    split = (Shard(1, 1, SEQ), "in_specs[0]")
    starts = Starts((split, split), (REPLICATE, REPLICATE), (False, False))
    with pytest.raises(spdsl.ShardingError, match="state sharding"):
        decide(trace(_loss_and_hidden(model), (ids, ids), {}), starts,
               dataclasses.replace(f.job, shard_state=True))
