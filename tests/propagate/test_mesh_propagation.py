"""Every mesh axis in one walk (``spdsl.propagate.mesh_propagation``): what each axis splits in
a program with a batch dim and a sequence dim, constraints pinning one axis and leaving the
other free, the sequence axis refusing to cut the batch dp splits (on a third axis too), a
failure raised in priority order, and the walk deciding, node for node, what one pass per
axis in priority order decides. One process, traced on fake tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spdsl
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.propagate.engine import Propagator
from spdsl.propagate.mesh_propagation import MeshAxis, MeshPropagator
from spdsl.propagate.placement import PARTIAL, REPLICATE, Shard
from spdsl.propagate.trace import trace

B, S, D = 4, 16, 8
BATCH, SEQ, FEATURES = Shard(0, 1, B), Shard(1, 1, S), Shard(2, 1, D)


def _traced(fn, *args):
    gm = trace(fn, args, {}).graph
    return gm, [n for n in gm.graph.nodes if n.op == "placeholder"]


def _node(gm, target, i: int = 0) -> torch.fx.Node:
    return [n for n in gm.graph.nodes if n.target is target][i]


def _walk(gm, x, starts: dict, **options) -> MeshPropagator:
    """Axes in the order of ``starts`` (name -> the placement of ``x``), two ranks each."""
    mesh = MeshPropagator(gm, [MeshAxis(a, 2, **options) for a in starts])
    mesh.run({a: {x: (p, f"in_specs[0] over {a!r}")} for a, p in starts.items()})
    return mesh


def test_each_axis_splits_its_own_dim():
    w = torch.randn(D, D)

    def f(x):
        h = torch.relu(x @ w)                # [B, S, D]: rows over dp, tokens over sp
        pooled = h.mean(1)                   # [B, D]: a partial sum over the tokens
        return pooled.pow(2).sum()

    gm, (x,) = _traced(f, torch.randn(B, S, D))
    mesh = _walk(gm, x, {"dp": BATCH, "sp": SEQ})
    aten = torch.ops.aten
    mm, relu = _node(gm, aten.mm.default), _node(gm, aten.relu.default)
    mean, pow_, total = (_node(gm, aten.mean.dim), _node(gm, aten.pow.Tensor_Scalar),
                         _node(gm, aten.sum.default))
    assert mesh.axes == ("dp", "sp")
    # the [B*S, D] rows of the matmul: dp holds whole rows of the batch factor, sp a chunk of
    # the 16 tokens inside each of the 4 rows
    assert mesh.placements(mm) == {"dp": Shard(0, 1, B), "sp": Shard(0, B, S)}
    assert mesh.placements(relu) == {"dp": BATCH, "sp": SEQ}
    assert mesh.placements(mean) == {"dp": BATCH, "sp": PARTIAL}
    # pow is not linear: sp sums its partial first (an all-reduce); dp keeps the rows
    assert mesh.placements(pow_) == {"dp": BATCH, "sp": REPLICATE}
    assert mesh["sp"].decisions[pow_].redistribute == {0: (PARTIAL, REPLICATE)}
    assert mesh["dp"].decisions[pow_].redistribute == {}
    assert mesh.placements(total) == {"dp": PARTIAL, "sp": REPLICATE}
    # moves happen only where the placement changes: nothing moves over dp
    assert not any(d.moves for d in mesh["dp"].decisions.values())


def test_a_constraint_pins_one_axis_and_leaves_the_other_free():
    def f(x):
        a = torch.ops.spdsl.constraint(x * 2, "")     # pins are passed as values, not read
        b = torch.ops.spdsl.constraint(a + 1, "")     # from the node
        return b.sum()

    gm, (x,) = _traced(f, torch.randn(B, S, D))
    a, b = (_node(gm, torch.ops.spdsl.constraint.default, i) for i in (0, 1))
    mesh = MeshPropagator(gm, [MeshAxis("dp", 2), MeshAxis("sp", 2)])
    mesh.run({"dp": {x: (BATCH, "in")}, "sp": {x: (SEQ, "in")}},
             {"dp": {a: None, b: REPLICATE}, "sp": {a: FEATURES, b: None}})
    # a: sp moved to the features (an all-to-all), dp left as it came
    assert mesh.placements(a) == {"dp": BATCH, "sp": FEATURES}
    assert mesh["sp"].decisions[a].redistribute == {0: (SEQ, FEATURES)}
    assert mesh["dp"].decisions[a].redistribute == {}
    # b: dp gathered, sp left as it came
    assert mesh.placements(b) == {"dp": REPLICATE, "sp": FEATURES}
    assert mesh["dp"].decisions[b].redistribute == {0: (BATCH, REPLICATE)}
    assert mesh["sp"].decisions[b].redistribute == {}
    # with no pins at all, every constraint leaves every axis as it comes
    free = MeshPropagator(gm, [MeshAxis("dp", 2), MeshAxis("sp", 2)])
    free.run({"dp": {x: (BATCH, "in")}, "sp": {x: (SEQ, "in")}})
    assert free.placements(b) == {"dp": BATCH, "sp": SEQ}


def _pooled_head():
    w, bias = torch.randn(5, D), torch.randn(5)
    return _traced(lambda x: F.linear(x.mean(1), w, bias), torch.randn(B, S, D))


def test_the_sequence_axis_does_not_cut_the_batch_dp_splits():
    """A mean over the split tokens is a partial sum; the biased linear after it is not
    linear in it. Alone, sp reduce-scatters it to batch rows (half the bytes of an
    all-reduce); where dp already splits the rows, that would cut dp's piece: all-reduce."""
    gm, (x,) = _pooled_head()
    addmm = _node(gm, torch.ops.aten.addmm.default)
    alone = _walk(gm, x, {"sp": SEQ})["sp"].decisions[addmm]
    assert alone.redistribute == {1: (PARTIAL, Shard(0, 1, B))} and alone.output == BATCH
    with_dp = _walk(gm, x, {"dp": BATCH, "sp": SEQ})["sp"].decisions[addmm]
    assert with_dp.redistribute == {1: (PARTIAL, REPLICATE)} and with_dp.output == REPLICATE
    assert with_dp.cost == 2 * alone.cost


def test_a_third_axis_sees_every_axis_before_it():
    """``tp`` splits the features; it does not split the rows, but ``dp`` before it does."""
    gm, (x,) = _pooled_head()
    addmm = _node(gm, torch.ops.aten.addmm.default)
    mean = _node(gm, torch.ops.aten.mean.dim)
    mesh = _walk(gm, x, {"dp": BATCH, "tp": FEATURES, "sp": SEQ})
    assert mesh.axes == ("dp", "tp", "sp")
    assert mesh.placements(mean) == {"dp": BATCH, "tp": Shard(1, 1, D), "sp": PARTIAL}
    assert mesh["sp"].taken == (mesh["dp"], mesh["tp"])
    assert mesh["sp"].decisions[addmm].redistribute == {1: (PARTIAL, REPLICATE)}


@torch.library.custom_op("spdsl_test_mesh::opaque", mutates_args=())
def _opaque(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


_opaque.register_fake(lambda x: torch.empty_like(x))


def test_a_failure_is_raised_in_priority_order():
    """sp fails first in the graph (a scan along its split dim, under ``gathers="error"``);
    dp fails later (an op without a rule over its split rows). One pass per axis would have
    raised dp's, so the walk does; with dp whole, sp's is raised."""
    def f(x):
        return _opaque(x.cumsum(1))

    gm, (x,) = _traced(f, torch.randn(B, S, D))
    with pytest.raises(spdsl.ShardingError, match=r"\[unknown op\].*'dp'"):
        _walk(gm, x, {"dp": BATCH, "sp": SEQ}, gathers="error")
    with pytest.raises(spdsl.ShardingError, match=r"\[sequence gathered\]"):
        _walk(gm, x, {"dp": REPLICATE, "sp": SEQ}, gathers="error")


def test_one_walk_decides_what_one_pass_per_axis_decides():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    gm, phs = _traced(model, ids, ids)
    n_state = len(phs) - 2
    for ph in phs[:n_state]:
        ph.meta["spdsl_requires_grad"] = True
    dp = {ph: (REPLICATE if j < n_state else Shard(0, 1, 2), "in") for j, ph in enumerate(phs)}
    sp = {ph: (REPLICATE if j < n_state else Shard(1, 1, 32), "in") for j, ph in enumerate(phs)}
    mesh = MeshPropagator(gm, [MeshAxis("dp", 2), MeshAxis("sp", 2, gathers="warn")])
    mesh.run({"dp": dp, "sp": sp})
    first = Propagator(gm, 2, "dp")
    first.run(dp)
    second = Propagator(gm, 2, "sp", gathers="warn", taken=(first,))
    second.run(sp)
    assert len(first.decisions) > 100
    assert mesh["dp"].decisions == first.decisions
    assert mesh["sp"].decisions == second.decisions
    assert any(d.strategy.lowering == "ulysses" for d in second.decisions.values())
