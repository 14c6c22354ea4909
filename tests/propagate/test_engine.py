"""The propagation engine's own decisions, on tiny traced functions: of a rule's strategies the
cheapest is kept (extra costs counted), a tie goes to the first, the moves of the chosen one are
recorded, a split value feeding an op without a rule is an error while replicated ones run
whole, and a replicated operand of split work has its gradient reduced. The rules are a test
op's own, registered for one test and removed after."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import spdsl
from spdsl import ShardingError
from spdsl.propagate.engine import Propagator, redistribute_cost
from spdsl.propagate.moves import Move
from spdsl.propagate.placement import PARTIAL, REPLICATE, shard_of
from spdsl.propagate.rules import _RULE_NAMES, RULES, lookup


@torch.library.custom_op("spdsl_engine_test::twin", mutates_args=())
def twin(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twin.register_fake
def _(x):
    return torch.empty_like(x)


TWIN = torch.ops.spdsl_engine_test.twin


@pytest.fixture
def teach():
    """``teach(strategies)``: register a rule for ``twin`` that offers ``strategies(ctx)``;
    the registry is as before after the test."""
    def register(strategies):
        spdsl.register_rule(TWIN, strategies)
    yield register
    RULES.pop(TWIN, None)
    _RULE_NAMES.pop(TWIN, None)
    assert lookup(TWIN.default) is None


def _propagate(fn, x: torch.Tensor, p, parts: int = 4) -> tuple[Propagator, dict]:
    gm = make_fx(fn, tracing_mode="fake")(x)
    prop = Propagator(gm, parts, "sp")
    prop.run({n: (p, "in") for n in gm.graph.nodes if n.op == "placeholder"})
    return prop, {n.target: d for n, d in prop.decisions.items() if n.op == "call_function"}


def _doubled(x):
    return TWIN(x).sum()


def _plan(x):
    return spdsl.plan(spdsl.sp_shard(seq=4)(_doubled), x)


def _gather(ctx):
    return spdsl.Strategy((REPLICATE,), REPLICATE, None, "gather")


def _keep(ctx, name: str = "keep", extra: float = 0.0):
    p = ctx.placements[0]
    return spdsl.Strategy((p,), p, None, name, extra)


X = torch.randn(2, 16, 8)
SPLIT = shard_of(X.shape, 1)           # the sequence, 16 tokens


@pytest.mark.parametrize("order", ["cheap first", "cheap last"])
def test_the_cheapest_strategy_wins_whatever_its_place(teach, order):
    teach(lambda ctx: [_keep(ctx), _gather(ctx)] if order == "cheap first"
          else [_gather(ctx), _keep(ctx)])
    _, d = _propagate(lambda x: TWIN(x), X, SPLIT)
    d = d[TWIN.default]
    assert d.origin == "keep" and d.output == SPLIT
    assert d.redistribute == {} and d.moves == {} and d.cost == 0.0
    assert d.alternatives == 2


def test_an_extra_cost_counts_against_a_free_strategy(teach):
    # keeping the split costs more than gathering [2,16,8] f32 (512 bytes): the gather wins
    teach(lambda ctx: [_keep(ctx, extra=1e9), _gather(ctx)])
    _, d = _propagate(lambda x: TWIN(x), X, SPLIT)
    d = d[TWIN.default]
    assert d.origin == "gather" and d.output == REPLICATE
    # the chosen one's move is recorded, priced as the plan prices it
    assert d.redistribute == {0: (SPLIT, REPLICATE)}
    assert d.moves[0] == Move(SPLIT, REPLICATE, X.numel() * 4, 4)
    assert d.moves[0].kind == "all_gather"
    assert d.cost == redistribute_cost(SPLIT, REPLICATE, X, 4) > 0


@pytest.mark.parametrize("first", ["left", "right"])
def test_a_tie_goes_to_the_first_strategy(teach, first):
    names = ["left", "right"] if first == "left" else ["right", "left"]
    teach(lambda ctx: [_keep(ctx, names[0]), _keep(ctx, names[1])])
    _, d = _propagate(lambda x: TWIN(x), X, SPLIT)
    assert d[TWIN.default].origin == first


def test_a_rule_registered_by_the_user_shows_in_the_plan(teach):
    teach(lambda ctx: [_gather(ctx), _keep(ctx, "twin keeps the split")])
    plan = _plan(X)
    v = next(v for v in plan.values if v.op == "spdsl_engine_test.twin.default")
    assert v.origin == "twin keeps the split" and v.typed == "f32[2,16@sp,8]"
    assert v.moves == () and v.alternatives == 2


def test_no_strategy_without_an_allowed_move_is_an_error(teach):
    # a split value cannot become a partial sum: the only strategy is priced infinite
    teach(lambda ctx: [spdsl.Strategy((PARTIAL,), PARTIAL, None, "needs partial")])
    with pytest.raises(ShardingError) as e:
        _plan(X)
    msg = str(e.value)
    assert msg.startswith("[no strategy for spdsl_engine_test.twin.default]")
    assert "value: f32[2,16@sp,8]" in msg and "at:" in msg and "test_engine.py:" in msg
    assert "fix:" in msg and "with_sharding_constraint" in msg


def test_an_op_without_a_rule_on_a_split_value_is_an_error():
    assert lookup(TWIN.default) is None
    with pytest.raises(ShardingError) as e:
        _plan(X)
    msg = str(e.value)
    assert msg.startswith("[unknown op] spdsl has no propagation rule for "
                          "spdsl_engine_test.twin.default, and an input is split over 'sp'")
    assert "value: f32[2,16@sp,8]" in msg
    assert "at:" in msg and "test_engine.py:" in msg
    assert "fix:" in msg and "spdsl.register_rule(spdsl_engine_test.twin.default" in msg


def test_an_op_without_a_rule_on_replicated_values_runs_whole():
    _, d = _propagate(lambda x: TWIN(x) + 1, X, REPLICATE)
    d = d[TWIN.default]
    assert d.output == REPLICATE and d.origin == "replicated inputs"
    assert d.redistribute == {} and d.grad_reduce == []


def test_a_replicated_operand_of_split_work_has_its_gradient_reduced():
    w = torch.randn(8)
    for p, reduced in ((SPLIT, [1]), (REPLICATE, [])):
        gm = make_fx(torch.mul, tracing_mode="fake")(X, w)
        x_in, w_in = [n for n in gm.graph.nodes if n.op == "placeholder"]
        prop = Propagator(gm, 4, "sp")
        prop.run({x_in: (p, "x"), w_in: (REPLICATE, "w")})
        mul = next(d for n, d in prop.decisions.items() if n.target is torch.ops.aten.mul.Tensor)
        # w (input 1) stays whole: its gradient is a partial sum over the ranks' tokens when
        # x is split, and complete when nothing is
        assert mul.output == p and mul.redistribute == {}
        assert mul.grad_reduce == reduced
