"""Lowering the propagated graph to one rank's program: shape arguments of views become the
rank's local shape (uneven splits too), every redistribution the engine recorded becomes one
call of the matching ``spdsl.collectives`` function, and a program that needs no collective,
run on a rank's piece of the input, gives that rank's piece of the single-device result.
Lowered in one process against a fake process group (``planning_group``: no ranks run);
programs that move data are run by the multi-rank parity tests."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import spdsl
from spdsl import P
from spdsl import collectives as C
from spdsl.lower.graph import lower
from spdsl.pipeline import planning_group
from spdsl.propagate.engine import Propagator
from spdsl.propagate.moves import kind_of
from spdsl.propagate.placement import Shard, chunk_bounds, shard_of

aten = torch.ops.aten
PARTS = 4


def _lowered(fn, x: torch.Tensor, rank: int) -> tuple[Propagator, torch.fx.GraphModule]:
    """``fn`` traced at global shapes, ``x`` split on dim 1 over ``PARTS`` ranks, its outputs
    kept as propagated; the local program of ``rank``."""
    gm = make_fx(fn, tracing_mode="fake")(x)
    prop = Propagator(gm, PARTS, "sp")
    prop.run({n: (shard_of(x.shape, 1), "x") for n in gm.graph.nodes if n.op == "placeholder"})
    outs = [prop.placement(o) for o in gm.graph.output_node().args[0]]
    with planning_group(PARTS) as group:
        return prop, lower(prop, rank, group, outs)


def _calls(gm: torch.fx.GraphModule, target) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def _piece(t: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
    lo, hi = chunk_bounds(t.shape[dim], PARTS, rank)
    return t.narrow(dim, lo, hi - lo)


def _heads(x):
    # [B, S, H*D] -> [B, H, S, D]: the sequence moves to dim 2 and stays split
    return (x.reshape(x.shape[0], x.shape[1], 2, 4).transpose(1, 2) * 2,)


def _broadcast(x):
    return (x[None].expand(3, *x.shape) + 1,)


@pytest.mark.parametrize("rank", range(PARTS))
def test_a_view_of_the_global_shape_takes_the_local_one(rank):
    _, gm = _lowered(_heads, torch.randn(2, 16, 8), rank)
    views = [n for n in gm.graph.nodes if n.target in (aten.view.default, aten.reshape.default)]
    assert [n.args[1] for n in views] == [[2, 4, 2, 4]]       # 16 tokens: 4 a rank
    assert not [n for n in gm.graph.nodes if getattr(n.target, "__module__", "") == C.__name__]
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert x.meta["spdsl_local"] == ((2, 4, 8), torch.float32)


@pytest.mark.parametrize("rank", range(PARTS))
def test_an_uneven_split_gives_each_rank_its_own_count(rank):
    # 10 tokens over 4 ranks, torch.chunk-style: 3, 3, 3, 1
    n = [3, 3, 3, 1][rank]
    _, gm = _lowered(_broadcast, torch.randn(2, 10, 8), rank)
    assert [e.args[1] for e in _calls(gm, aten.expand.default)] == [[3, 2, n, 8]]
    x = next(a for a in gm.graph.nodes if a.op == "placeholder")
    assert x.meta["spdsl_local"][0] == (2, n, 8)


@pytest.mark.parametrize("fn, size, dim", [(_heads, 16, 2), (_broadcast, 10, 2)],
                         ids=["view", "uneven expand"])
def test_the_local_program_gives_the_rank_its_piece_of_the_result(fn, size, dim):
    torch.manual_seed(0)
    x = torch.randn(2, size, 8)
    want = fn(x)[0]
    for rank in range(PARTS):
        prop, gm = _lowered(fn, x, rank)
        out = next(iter(prop.gm.graph.output_node().args[0]))
        assert prop.placement(out) == Shard(dim, 1, size)
        got = gm(_piece(x, 1, rank))[0]
        torch.testing.assert_close(got, _piece(want, dim, rank), rtol=0, atol=0)


def _moved(x):
    a = spdsl.with_sharding_constraint(x * 2, P(None, None, "sp"))   # sequence -> features
    b = spdsl.with_sharding_constraint(x + 1, P())                   # gathered
    return a.sum() + b.sum()                                         # a partial sum, reduced


_COLLECTIVE = {"all_to_all": C.all_to_all, "all_gather": C.gather, "all_reduce": C.all_reduce,
               "reduce_scatter": C.reduce_scatter, "take": C.take}


def test_each_recorded_redistribution_is_one_collective_call():
    x = torch.randn(2, 16, 8)
    entry = spdsl.sp_shard(seq=PARTS)(_moved).build((x,), {})
    prop = entry.prop
    moves = [(node, i, kind_of(*move)) for node, d in prop.decisions.items()
             for i, move in d.redistribute.items()]
    assert sorted(k for *_, k in moves) == ["all_gather", "all_reduce", "all_to_all"]
    rank = 1
    with planning_group(PARTS) as group:
        gm = lower(prop, rank, group, entry.out_placements)
    for kind, fn in _COLLECTIVE.items():
        assert len(_calls(gm, fn)) == sum(k == kind for *_, k in moves), kind
    # each call takes the local value of the input the engine moved, for this rank and axis
    for node, i, kind in moves:
        call, = _calls(gm, _COLLECTIVE[kind])
        assert call.args[0].meta["spdsl_origin"] == node.all_input_nodes[i].name
        assert group in call.args
    a2a, = _calls(gm, C.all_to_all)
    assert a2a.args[1:4] == ((1, 1), (2, 1), PARTS)              # split dim 1 -> dim 2
    gather, = _calls(gm, C.gather)
    assert gather.args[1:4] == ((1, 1, 16, 1), PARTS, rank)      # dim 1 of 16, rank 1's piece
